"""The server drives an engine through its public surface alone: requests, steps, stats and a few facts."""

import httpx
import pytest

from tests.server.harness import RunningServer, engine_for

KV_TOKENS = 6 * 16  # cache.num_blocks=6 of cache.block_size=16, well under model.max_model_len=512


class PublicOnly:
    """An engine whose scheduler, block manager, runner and private state are out of reach."""

    HIDDEN = ("scheduler", "block_manager", "runner", "intake", "parallel")

    def __init__(self, engine):
        self.__dict__["_engine"] = engine

    def __getattr__(self, name):
        if name.startswith("_") or name in self.HIDDEN:
            raise AttributeError(f"the server reached into engine.{name}")
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def public_server(chat_folder):
    engine = engine_for(chat_folder, scheduler__max_num_seqs=2, cache__num_blocks=6)
    running = RunningServer(PublicOnly(engine), max_queue=3)
    yield running
    running.stop()
    engine.close()


def chat(server, content, **body):
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": content}], "temperature": 0, **body})


def test_stats_name_the_limits_a_request_meets(public_server):
    stats = public_server.engine.stats()
    assert stats["max_num_seqs"] == 2
    assert stats["max_request_tokens"] == KV_TOKENS
    assert public_server.loop.capacity == 2 + 3  # running sequences + server.max_queue


def test_a_chat_without_max_tokens_answers_within_what_the_kv_cache_holds(public_server):
    resp = chat(public_server, "Hi", ignore_eos=True)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == KV_TOKENS
    assert resp.json()["choices"][0]["finish_reason"] == "length"
    refused = chat(public_server, "x" * KV_TOKENS)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "messages" and f"within {KV_TOKENS} tokens" in error["message"]


def test_completions_and_streams_run_on_the_public_surface(public_server):
    body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{public_server.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert sorted(c["index"] for c in resp.json()["choices"]) == [0, 1, 2, 3]
    with httpx.stream("POST", f"{public_server.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as stream:
        assert stream.status_code == 200
        assert stream.read().decode().rstrip().endswith("data: [DONE]")
