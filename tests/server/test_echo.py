"""``echo`` on ``/v1/completions``: the prompt's text and logprobs before the completion's, and prompts scored
alone (``max_tokens=0``), as evaluation harnesses ask for log-likelihoods."""

import pytest

import kunlun_infer as ki

PROMPT = "def f(x):\n    return"


def greedy(max_tokens, **keys):
    return ki.SamplingParams(max_tokens=max_tokens, temperature=0.0, **keys)


def test_echo_puts_the_prompt_before_the_completion(client, server, llm):
    expected = llm.generate(PROMPT, greedy(5), use_tqdm=False)[0]
    resp = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert resp.choices[0].text == PROMPT + expected.text
    assert resp.choices[0].logprobs is None
    assert resp.usage.completion_tokens == len(expected.token_ids)

    ids = expected.prompt_token_ids
    by_ids = client.completions.create(model=server.model_name, prompt=ids, max_tokens=5, temperature=0, echo=True)
    assert by_ids.choices[0].text == llm.engine.tokenizer.decode(ids, skip_special_tokens=False) + expected.text

    two = client.completions.create(model=server.model_name, prompt=[PROMPT, "Hello"], n=2, max_tokens=3,
                                    temperature=0, echo=True)
    assert [c.text.startswith(p) for c, p in zip(two.choices, [PROMPT, PROMPT, "Hello", "Hello"])] == [True] * 4


def test_echo_logprobs_start_with_the_prompt_tokens(client, server, llm):
    expected = llm.generate(PROMPT, greedy(4, logprobs=2, prompt_logprobs=2), use_tqdm=False)[0]
    n_prompt = len(expected.prompt_token_ids)
    resp = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=4, temperature=0,
                                     echo=True, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == n_prompt + len(expected.token_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [e[t] for t, e in zip(expected.prompt_token_ids[1:], expected.prompt_logprobs[1:])]
    want += [e[t] for t, e in zip(expected.token_ids, expected.logprobs)]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert lp.text_offset[n_prompt] == len(PROMPT)  # the completion's first token right after the prompt's text


def test_a_prompt_scored_alone_generates_nothing(client, server, llm):
    expected = llm.generate(PROMPT, greedy(1, prompt_logprobs=1), use_tqdm=False)[0]
    resp = client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = resp.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert len(choice.logprobs.tokens) == len(expected.prompt_token_ids)
    nll = -sum(e[t] for t, e in zip(expected.prompt_token_ids[1:], expected.prompt_logprobs[1:]))
    assert -sum(choice.logprobs.token_logprobs[1:]) == pytest.approx(nll, abs=1e-4)

    chunks = list(client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=0, echo=True,
                                            logprobs=1, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    assert chunks[-1].usage.completion_tokens == 0


def test_an_echoed_stream_adds_up_to_the_whole_answer(client, server):
    keys = dict(model=server.model_name, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=1)
    whole = client.completions.create(**keys).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**keys, stream=True)]
    assert chunks[0].text.startswith(PROMPT)
    assert "".join(c.text for c in chunks) == whole.text
    for field in ("tokens", "token_logprobs", "text_offset"):
        assert [v for c in chunks for v in getattr(c.logprobs, field)] == getattr(whole.logprobs, field)
