"""/tokenize and /detokenize, usage at the end of a stream, and logprobs before or after penalties."""

import httpx
import pytest

import kunlun_infer as ki
from kunlun_infer.server.metrics import PREFIX
from tests.chat_models import IM_END_ID

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße, 世界!"}]


def post(server, path, body):
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_tokenize_a_prompt_and_detokenize_it_back(server, llm):
    tokenizer = llm.engine.tokenizer
    body = post(server, "/tokenize", {"prompt": "Grüße, 世界!", "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode("Grüße, 世界!") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == llm.engine.max_model_len
    assert body["token_strs"] == [tokenizer.id_to_token(t) for t in body["tokens"]]
    back = post(server, "/detokenize", {"tokens": body["tokens"]}).json()
    assert back == {"prompt": "Grüße, 世界!"}
    plain = post(server, "/tokenize", {"prompt": "x", "add_special_tokens": False}).json()
    assert plain["tokens"] == list(tokenizer.backend.encode("x", add_special_tokens=False).ids)
    assert post(server, "/detokenize", {"tokens": [IM_END_ID]}).json() == {"prompt": "<|im_end|>"}


def test_tokenize_messages_gives_the_ids_a_chat_request_uses(server, client, chat_folder):
    import transformers as tf

    body = post(server, "/tokenize", {"messages": CHAT}).json()
    hf = tf.AutoTokenizer.from_pretrained(chat_folder).apply_chat_template(CHAT, add_generation_prompt=True,
                                                                           tokenize=True, return_dict=False)
    assert body["tokens"] == list(hf)
    answer = client.chat.completions.create(model=server.model_name, messages=CHAT, max_tokens=2, temperature=0)
    assert answer.usage.prompt_tokens == body["count"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens[1]"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_bad_tokenize_requests_are_named(server, path, body, status, param):
    response = post(server, path, body)
    assert response.status_code == status and response.json()["error"]["param"] == param, response.text


def test_a_completion_stream_ends_with_its_usage(client, server):
    whole = client.completions.create(model=server.model_name, prompt="abc", max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model=server.model_name, prompt="abc", max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_logprobs_before_or_after_penalties(client, server, llm):
    kwargs = dict(model=server.model_name, prompt="aaaa", max_tokens=3, temperature=0, logprobs=3)
    answers = {mode: client.completions.create(**kwargs, extra_body={"repetition_penalty": 3.0,
                                                                     "logprobs_mode": mode}).choices[0]
               for mode in ("raw", "processed")}
    assert answers["raw"].text == answers["processed"].text
    for mode, answer in answers.items():
        expected = llm.generate("aaaa", ki.SamplingParams(max_tokens=3, temperature=0, logprobs=3,
                                                          repetition_penalty=3.0, logprobs_mode=mode),
                                use_tqdm=False)[0]
        assert answer.logprobs.token_logprobs == pytest.approx(
            [e[t] for t, e in zip(expected.token_ids, expected.logprobs)], abs=1e-5)
    assert answers["raw"].logprobs.token_logprobs != pytest.approx(answers["processed"].logprobs.token_logprobs,
                                                                   abs=1e-3)


def test_speculation_counters_reach_metrics(chat_folder, llm):
    from tests.server.harness import RunningServer, engine_for

    engine = engine_for(chat_folder, speculative__method="ngram", speculative__num_tokens=3)
    running = RunningServer(engine)
    try:
        body = {"prompt": "abcdabcdabcdabcdabcd", "max_tokens": 24, "temperature": 0}
        answer = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60).json()
        plain = llm.generate(body["prompt"], ki.SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
        assert answer["choices"][0]["text"] == plain.text
        metrics, stats = running.metrics(), engine.stats()
        assert metrics[f"{PREFIX}_spec_draft_tokens_total"] == stats["spec_draft_tokens"] > 0
        assert metrics[f"{PREFIX}_spec_accepted_tokens_total"] == stats["spec_accepted_tokens"]
        assert metrics[f"{PREFIX}_spec_acceptance_rate"] == pytest.approx(stats["spec_acceptance_rate"])
        assert metrics[f"{PREFIX}_spec_tokens_per_step"] == pytest.approx(stats["spec_tokens_per_step"])
        assert stats["spec_tokens_per_step"] >= 1
    finally:
        running.stop()
        engine.close()
