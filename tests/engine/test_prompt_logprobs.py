"""``prompt_logprobs``: every prompt token scored as transformers scores it, whatever the scheduling.

Each prompt token after the first gets ``{token_id: logprob}`` with the
actual token and the ``prompt_logprobs`` most likely ones, equal to
``log_softmax`` of transformers' logits at the position before it — in one
step, cut into prefill chunks, after a prefix-cache warm-up (the cached
prefix must not leave tokens unscored), under preemption and for ``n > 1``.
"""

import pytest
import torch

from kunlun_infer import RequestError, SamplingParams

PROMPT_LENGTHS = [1, 2, 17, 70, 300]
TOP = 3


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def expected(tiny_model, hf_model):
    """transformers' log_softmax over each prompt: row ``p - 1`` scores prompt token ``p``."""
    model = hf_model(tiny_model("qwen3"))
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts()]


def check(outputs, expected, top=TOP):
    for prompt, out, reference in zip(prompts(), outputs, expected):
        scored = out.prompt_logprobs
        assert scored is not None and len(scored) == len(prompt) == len(out.prompt_token_ids)
        assert scored[0] is None
        for position in range(1, len(prompt)):
            entry, row = scored[position], reference[position - 1]
            actual = prompt[position]
            assert set(entry) == set(row.topk(top).indices.tolist()) | {actual}, position
            for token, value in entry.items():
                assert value == pytest.approx(row[token].item(), abs=1e-4)


def run(llm, **params):
    params = {"max_tokens": 3, "temperature": 0, "prompt_logprobs": TOP, **params}
    return llm.generate(prompts(), SamplingParams(**params), use_tqdm=False)


def test_prompt_logprobs_equal_transformers_log_softmax(tiny_model, make_llm, expected):
    check(run(make_llm(tiny_model("qwen3"))), expected)


def test_rows_scored_a_slice_at_a_time_score_the_same(tiny_model, make_llm, expected, monkeypatch):
    from kunlun_infer.engine import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "SCORE_ROWS", 7)  # ~390 scored rows in one step: many slices, a ragged end
    check(run(make_llm(tiny_model("qwen3"))), expected)
    check(run(make_llm(tiny_model("qwen3")), prompt_logprobs=0), expected, top=0)


def test_chunked_prefill_scores_every_chunk(tiny_model, make_llm, expected):
    llm = make_llm(tiny_model("qwen3"), scheduler__max_num_batched_tokens=24)
    check(run(llm), expected)
    assert llm.engine.stats()["num_steps"] > 300 // 24  # the long prompt really was cut into chunks


def test_a_cached_prefix_does_not_skip_prompt_tokens(tiny_model, make_llm, expected):
    llm = make_llm(tiny_model("qwen3"))
    warm = llm.generate(prompts(), SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert all(o.prompt_logprobs is None for o in warm)  # not asked: not computed
    outputs = run(llm)
    check(outputs, expected)
    assert all(o.num_cached_tokens == 0 for o in outputs)
    again = llm.generate(prompts(), SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert again[-1].num_cached_tokens > 0  # the cache itself still serves requests that do not ask


def test_preemption_and_parallel_samples_keep_them(tiny_model, make_llm, expected):
    # 30 blocks of 16 tokens hold the longest request but not the batch: sequences are preempted
    llm = make_llm(tiny_model("qwen3"), cache__num_blocks=30, scheduler__max_num_batched_tokens=64)
    outputs = run(llm, n=2, max_tokens=8, ignore_eos=True)
    assert llm.engine.stats()["num_preemptions"] > 0
    assert [o.index for o in outputs] == [0, 1] * len(PROMPT_LENGTHS)
    check(outputs[0::2], expected)
    check(outputs[1::2], expected)


def test_zero_gives_the_actual_token_only_and_mixes_with_other_requests(tiny_model, make_llm, expected):
    llm = make_llm(tiny_model("qwen3"))
    params = [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0 if i % 2 else None, logprobs=1)
              for i in range(len(PROMPT_LENGTHS))]
    outputs = llm.generate(prompts(), params, use_tqdm=False)
    for i, (prompt, out, reference) in enumerate(zip(prompts(), outputs, expected)):
        assert len(out.logprobs) == 2
        if i % 2 == 0:
            assert out.prompt_logprobs is None
            continue
        assert out.prompt_logprobs[0] is None
        for position, entry in enumerate(out.prompt_logprobs[1:], 1):
            assert list(entry) == [prompt[position]]
            assert entry[prompt[position]] == pytest.approx(reference[position - 1, prompt[position]].item(),
                                                            abs=1e-4)


@pytest.mark.parametrize("value", [-1, 21, 2.0, True, "3"])
def test_bad_prompt_logprobs_is_refused_naming_the_field(value):
    with pytest.raises(RequestError) as err:
        SamplingParams(prompt_logprobs=value)
    assert err.value.field == "prompt_logprobs" and "prompt_logprobs" in str(err.value)
