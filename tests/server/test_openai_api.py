"""The OpenAI-compatible API through the official ``openai`` client: same texts as in-process, same shapes."""

import httpx
import openai
import pytest

import kunlun_infer as ki

PROMPTS = ["Hello", "def f(x):", "Grüße, 世界"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def greedy(max_tokens=8, **keys):
    return ki.SamplingParams(max_tokens=max_tokens, temperature=0.0, **keys)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_equal_llm_generate(client, server, llm, prompt):
    expected = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    resp = client.completions.create(model=server.model_name, prompt=prompt, max_tokens=8, temperature=0)
    assert resp.object == "text_completion" and resp.model == server.model_name
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.token_ids)


def test_chat_completions_equal_llm_chat(client, server, llm):
    expected = llm.chat(CHAT, greedy(), use_tqdm=False)[0]
    resp = client.chat.completions.create(model=server.model_name, messages=CHAT, max_tokens=8, temperature=0)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streaming_agrees_with_non_streaming(client, server):
    whole = client.completions.create(model=server.model_name, prompt=PROMPTS[2], max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=server.model_name, prompt=PROMPTS[2], max_tokens=12,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])

    chat = client.chat.completions.create(model=server.model_name, messages=CHAT, max_tokens=12, temperature=0)
    stream = list(client.chat.completions.create(model=server.model_name, messages=CHAT, max_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert stream[0].object == "chat.completion.chunk" and stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == chat.choices[0].finish_reason
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_raw_stream_is_server_sent_events_ending_with_done(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                      json={"prompt": "Hi", "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_several_prompts_and_samples_come_back_as_indexed_choices(client, server, llm):
    resp = client.completions.create(model=server.model_name, prompt=PROMPTS[:2], n=2, max_tokens=6,
                                     temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    expected = [o.text for o in llm.generate(PROMPTS[:2], greedy(6), use_tqdm=False)]
    assert [c.text for c in resp.choices] == [expected[0], expected[0], expected[1], expected[1]]
    sampled = client.chat.completions.create(model=server.model_name, messages=CHAT, n=3, max_tokens=6,
                                             temperature=1.0, seed=4)
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]


def test_penalties_and_extensions_reach_the_engine(client, server, llm):
    params = dict(max_tokens=10, presence_penalty=1.5, frequency_penalty=0.5)
    expected = llm.generate("abcabc", greedy(repetition_penalty=1.3, min_tokens=2, **params), use_tqdm=False)[0]
    resp = client.completions.create(model=server.model_name, prompt="abcabc", temperature=0, **params,
                                     extra_body={"repetition_penalty": 1.3, "min_tokens": 2})
    assert resp.choices[0].text == expected.text


def test_logit_bias_reaches_the_engine_on_both_endpoints(client, server, llm):
    plain = llm.generate("abcabc", greedy(max_tokens=10), use_tqdm=False)[0]
    banned = plain.token_ids[0]
    forced = (banned + 7) % llm.engine.vocab_size
    for bias, check in (({banned: -100}, lambda ids: banned not in ids),
                        ({forced: 100}, lambda ids: ids == [forced] * 10)):
        expected = llm.generate("abcabc", greedy(max_tokens=10, logit_bias=bias), use_tqdm=False)[0]
        assert check(expected.token_ids)
        body = {str(token): value for token, value in bias.items()}
        resp = client.completions.create(model=server.model_name, prompt="abcabc", max_tokens=10, temperature=0,
                                         logit_bias=body)
        assert resp.choices[0].text == expected.text
    chat = client.chat.completions.create(model=server.model_name, messages=CHAT, max_tokens=6, temperature=0,
                                          logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == llm.chat(CHAT, greedy(max_tokens=6, logit_bias={forced: 100}),
                                                       use_tqdm=False)[0].text


def test_fields_clients_send_at_their_neutral_values_are_taken(client, server, llm):
    expected = llm.chat(CHAT, greedy(), use_tqdm=False)[0].text
    resp = client.chat.completions.create(model=server.model_name, messages=CHAT, max_tokens=8, temperature=0,
                                          metadata={"run": "nightly"}, store=False, service_tier="auto",
                                          modalities=["text"], top_logprobs=0)
    assert resp.choices[0].message.content == expected and resp.choices[0].logprobs is None
    completion = client.completions.create(model=server.model_name, prompt="Hello", max_tokens=8, temperature=0,
                                           extra_body={"metadata": {"run": "nightly"}, "store": False,
                                                       "service_tier": "default"})
    assert completion.choices[0].text == llm.generate("Hello", greedy(), use_tqdm=False)[0].text


def test_logprobs_have_the_openai_shapes(client, server, llm):
    expected = llm.generate("Hello", greedy(4, logprobs=2), use_tqdm=False)[0]
    resp = client.completions.create(model=server.model_name, prompt="Hello", max_tokens=4, temperature=0,
                                     logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(expected.token_ids)
    assert lp.token_logprobs == pytest.approx([e[t] for t, e in zip(expected.token_ids, expected.logprobs)],
                                              abs=1e-5)
    assert all(len(top) == 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=server.model_name, messages=CHAT, max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [server.model_name]
    assert client.models.retrieve(server.model_name).id == server.model_name
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-9")
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{server.url}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in ("kunlun_infer_http_requests_total", "kunlun_infer_generation_tokens_total",
                 "kunlun_infer_num_requests_waiting", "kunlun_infer_kv_cache_usage_ratio",
                 "kunlun_infer_time_to_first_token_seconds_bucket", "kunlun_infer_request_latency_seconds_count"):
        assert name in metrics.text


def test_server_binds_loopback_by_default():
    assert ki.compose_config([]).server.host == "127.0.0.1"


def test_each_prompt_is_tokenized_once_on_its_way_to_the_engine(client, server, monkeypatch):
    tokenizer = server.engine.tokenizer
    encode, encoded = tokenizer.encode, []

    def counted(text, *args, **kwargs):
        encoded.append(text)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counted)
    resp = client.completions.create(model=server.model_name, prompt=PROMPTS[:2], n=2, max_tokens=3)
    assert len(resp.choices) == 4 and all(c.finish_reason for c in resp.choices)
    assert encoded == PROMPTS[:2]
