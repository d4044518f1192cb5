"""``suffix`` on ``/v1/completions``: a fill-in-the-middle prompt for a model that has infilling tokens, and a
400 naming the field for one that has not."""

import pytest

import kunlun_infer as ki
from tests.chat_models import SPECIAL_TOKENS, write_chat_tokenizer
from tests.engine.tiny_models import build_tiny_model, engine_overrides
from tests.server.harness import RunningServer, engine_for
from tests.server.test_errors import assert_openai_error, post

FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def fim_folder(tmp_path_factory):
    """A tiny random model whose byte-level tokenizer has the Qwen2.5-Coder infilling tokens."""
    folder = tmp_path_factory.mktemp("fim-model")
    specials = SPECIAL_TOKENS + FIM_TOKENS
    build_tiny_model(folder, "qwen2", vocab_size=256 + len(specials), eos_token_id=[256])
    write_chat_tokenizer(folder, None, specials=specials, eos_token="<|endoftext|>")
    return folder


@pytest.fixture(scope="module")
def fim_server(fim_folder):
    engine = engine_for(fim_folder)
    running = RunningServer(engine)
    yield running
    running.stop()
    engine.close()


def test_suffix_fills_the_hole_between_prefix_and_suffix(fim_server, fim_folder):
    fim_prefix, fim_suffix, fim_middle = (256 + len(SPECIAL_TOKENS) + i for i in range(3))
    with ki.LLM(model=str(fim_folder), overrides=engine_overrides()) as llm:
        text_ids = llm.engine.tokenizer.encode  # no BOS, nothing added: a byte's id each
        expected_ids = [fim_prefix, *text_ids(PREFIX), fim_suffix, *text_ids(SUFFIX), fim_middle]
        assert len(expected_ids) == len(PREFIX) + len(SUFFIX) + 3
        expected = llm.generate([expected_ids], ki.SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    body = {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "temperature": 0}
    response = post(fim_server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["text"] == expected.text
    assert answer["usage"]["prompt_tokens"] == len(expected_ids)
    two = post(fim_server, "/v1/completions", {**body, "prompt": [PREFIX, "x = "]}).json()
    assert two["choices"][0]["text"] == expected.text and two["usage"]["prompt_tokens"] == (
        len(expected_ids) + 3 + len("x = ") + len(SUFFIX))


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1, 2, 3], "suffix": "x"}, "suffix"),
    ({"prompt": "a", "suffix": "x", "echo": True}, "echo"),
])
def test_suffix_with_token_ids_or_echo_is_refused(fim_server, body, param):
    assert_openai_error(post(fim_server, "/v1/completions", body), 400, param)


def test_a_model_without_infilling_tokens_refuses_suffix_naming_it(server):
    error = assert_openai_error(post(server, "/v1/completions", {"prompt": "a", "suffix": "b"}), 400, "suffix")
    assert "fill-in-the-middle" in error["message"]
    ok = post(server, "/v1/completions", {"prompt": "a", "suffix": "", "max_tokens": 2})
    assert ok.status_code == 200
