"""No response body of the server shows a path of the server's filesystem, whatever the error."""

from __future__ import annotations

import json
import os
import tempfile

import httpx
import pytest

from kunlun_infer.server.redact import public_text
from tests.chat_models import build_chat_model
from tests.server.harness import RunningServer, engine_for, fail_next_step


def server_paths(*folders) -> list[str]:
    """Absolute folders of this machine that a careless error message would show."""
    roots = {os.getcwd(), tempfile.gettempdir(), os.path.expanduser("~"), *map(str, folders)}
    return sorted(r for r in roots if r not in ("", "/"))


def assert_no_paths(text: str, *folders) -> None:
    for root in server_paths(*folders):
        assert root not in text, f"the response shows the server path {root}: {text}"


def test_public_text_keeps_routes_urls_and_words_and_shortens_paths_of_this_machine(tmp_path):
    missing = tmp_path / "model" / "chat_template.jinja"  # need not exist: its first component does
    said = public_text(f"neither {missing} nor {tmp_path}/tokenizer_config.json; POST /v1/completions at "
                       f"http://127.0.0.1:8000/v1/models, and/or 'x/y'")
    assert said == ("neither chat_template.jinja nor tokenizer_config.json; POST /v1/completions at "
                    "http://127.0.0.1:8000/v1/models, and/or 'x/y'")
    assert public_text("~/.cache/kunlun_infer/kernels failed") == "kernels failed"


@pytest.fixture
def templateless(tmp_path):
    """A server over a model whose tokenizer has no chat template."""
    folder = build_chat_model(tmp_path / "no-template", chat_template=None)
    engine = engine_for(folder, scheduler__max_num_seqs=2)
    running = RunningServer(engine)
    yield running, folder
    running.stop()
    engine.close()


def test_a_chat_request_to_a_model_without_a_template_names_no_folder(templateless):
    server, folder = templateless
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "no chat template" in message and "tokenizer_config.json" in message
    assert_no_paths(response.text, folder)


def test_internal_errors_stream_errors_and_health_name_no_path(templateless, monkeypatch):
    server, folder = templateless
    secret = folder / "weights" / "shard-3.bin"

    def failing_step():
        raise FileNotFoundError(2, "No such file or directory", str(secret))

    # a failure after the stream began: the error event before [DONE]
    body = {"prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(line for line in lines if line)
        monkeypatch.setattr(server.engine, "step", failing_step)
        rest = [line for line in lines if line]
    events = [json.loads(line.removeprefix("data: ")) for line in rest if line != "data: [DONE]"]
    errors = [e["error"]["message"] for e in events if "error" in e]
    assert errors and "shard-3.bin" in errors[-1]
    assert_no_paths("\n".join(rest), folder)
    # the loop is gone: health and every later request say why, without the path
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 503 and "shard-3.bin" in health.json()["reason"]
    assert_no_paths(health.text, folder)
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503
    assert_no_paths(refused.text, folder)


def test_a_failed_step_with_a_path_in_its_error_is_a_500_without_it(templateless, monkeypatch):
    server, folder = templateless
    fail_next_step(server.engine, monkeypatch, OSError(f"cannot map {folder}/model.safetensors"))
    failed = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
    assert failed.status_code == 500 and "model.safetensors" in failed.json()["error"]["message"]
    assert_no_paths(failed.text, folder)
