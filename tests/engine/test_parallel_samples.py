"""``n`` samples per prompt: prefill runs once, the samples share the prompt's KV blocks, each is correct."""

import pytest
import torch

from kunlun_infer import RequestError, SamplingParams
from tests.engine.tiny_models import hf_greedy

PROMPT = list(range(40, 80))  # 40 tokens: two full 16-token blocks and 8 in a partial one


def used_blocks(engine):
    stats = engine.stats()
    return stats["kv_blocks_total"] - stats["kv_blocks_free"]


def test_samples_share_the_prompt_blocks_and_prefill_runs_once(tiny_model, make_llm):
    engine = make_llm(tiny_model("llama"), cache__prefix_caching="false").engine
    engine.add_request(PROMPT, SamplingParams(n=4, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True))
    outputs = engine.step()
    # one prefill of the prompt, four first tokens sampled from its logits
    assert engine.stats()["num_computed_tokens"] == len(PROMPT)
    assert sorted(o.index for o in outputs) == [0, 1, 2, 3] and all(len(o.token_ids) == 1 for o in outputs)
    running = engine.scheduler.running
    assert len(running) == 4
    parent = running[0]
    for child in running[1:]:
        assert child.block_table == parent.block_table[:2]  # the two full blocks, by reference
    assert used_blocks(engine) == 3  # not 12
    engine.step()
    # each fork recomputed only the 8 tokens of the partial block (plus its own token); the parent decoded one
    assert engine.stats()["num_computed_tokens"] == len(PROMPT) + 1 + 3 * (8 + 1)
    assert all(child.block_table[:2] == parent.block_table[:2] for child in running[1:])
    assert used_blocks(engine) == 3 + 3  # shared blocks + one own block per fork
    while engine.has_unfinished():
        engine.step()
    assert used_blocks(engine) == 0


def test_greedy_samples_are_all_the_greedy_continuation(platform, tiny_model, hf_model, make_llm):
    folder = tiny_model("llama")
    llm = make_llm(folder, **platform)
    outs = llm.generate([PROMPT, [1, 2, 3]], SamplingParams(n=3, max_tokens=8, temperature=0.0), use_tqdm=False)
    assert [o.index for o in outs] == [0, 1, 2, 0, 1, 2]
    expected = hf_greedy(hf_model(folder), PROMPT, 8)
    assert all(o.token_ids == expected for o in outs[:3])
    assert outs[3].token_ids == outs[4].token_ids == outs[5].token_ids == hf_greedy(hf_model(folder), [1, 2, 3], 8)
    assert len({o.request_id for o in outs[:3]}) == 1 and all(o.prompt_token_ids == PROMPT for o in outs[:3])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_every_sample_follows_the_model_distribution_of_its_own_tokens(arch, platform, tiny_model, hf_model,
                                                                        make_llm):
    """Logprobs of each sample's tokens equal transformers' for that sample's own prefix: its KV is right."""
    folder = tiny_model(arch)
    hf = hf_model(folder)
    outs = make_llm(folder, **platform).generate([PROMPT], SamplingParams(n=3, max_tokens=6, temperature=1.5, seed=7,
                                                              logprobs=0, ignore_eos=True), use_tqdm=False)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # the samples differ
    for out in outs:
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + out.token_ids])).logits[0, len(PROMPT) - 1:-1]
        expected = torch.log_softmax(logits.float(), -1)
        for pos, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert entry[token] == pytest.approx(expected[pos, token].item(), abs=1e-4)


def test_seeded_samples_repeat_and_differ_from_each_other(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"))
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    first = [o.token_ids for o in llm.generate([PROMPT], params, use_tqdm=False)]
    again = [o.token_ids for o in llm.generate([PROMPT], params, use_tqdm=False)]
    assert first == again and len({tuple(t) for t in first}) == 4
    single = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True),
                          use_tqdm=False)[0]
    assert single.token_ids == first[0]  # sample 0 draws from the seed itself


def test_samples_survive_preemption(platform, tiny_model, hf_model, make_llm):
    folder = tiny_model("llama")
    engine = make_llm(folder, cache__num_blocks=8, **platform).engine
    llm_outs = []
    engine.add_request(PROMPT, SamplingParams(n=4, max_tokens=30, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        llm_outs += [o for o in engine.step() if o.finished]
    assert engine.stats()["num_preemptions"] > 0
    expected = hf_greedy(hf_model(folder), PROMPT, 30)
    assert sorted(o.index for o in llm_outs) == [0, 1, 2, 3]
    assert all(o.token_ids == expected and o.finish_reason == "length" for o in llm_outs)
    assert used_blocks(engine) == 0


@pytest.mark.parametrize("steps_before_abort", [0, 2])
def test_abort_ends_every_sample_and_frees_their_blocks(tiny_model, make_llm, steps_before_abort):
    engine = make_llm(tiny_model("llama")).engine
    request_id = engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    for _ in range(steps_before_abort):
        engine.step()
    assert engine.abort(request_id)
    outputs = engine.step()
    assert sorted(o.index for o in outputs) == [0, 1, 2]
    assert all(o.finished and o.finish_reason == "abort" for o in outputs)
    assert not engine.has_unfinished() and used_blocks(engine) == 0 and not engine.scheduler.running


def test_n_beyond_the_batch_is_refused_naming_the_field(tiny_model, make_llm):
    engine = make_llm(tiny_model("llama"), scheduler__max_num_seqs=4).engine
    with pytest.raises(RequestError) as err:
        engine.add_request(PROMPT, SamplingParams(n=5))
    assert err.value.field == "n" and "scheduler.max_num_seqs" in str(err.value)


def test_a_sample_stopping_at_its_first_token_leaves_the_others_correct(tiny_model, hf_model, make_llm):
    """Sample 0 computes the prompt; when it stops at once the other samples still run on its blocks."""
    folder = tiny_model("qwen2")
    hf = hf_model(folder)
    engine = make_llm(folder, cache__prefix_caching="false").engine
    base = dict(n=4, max_tokens=6, temperature=1.5, seed=21, logprobs=0, ignore_eos=True)
    free = {o.index: o for o in make_llm(folder).generate([PROMPT], SamplingParams(**base), use_tqdm=False)}
    first = free[0].token_ids[0]
    assert any(free[i].token_ids[0] != first for i in (1, 2, 3))  # some sample goes on past its first token
    engine.add_request(PROMPT, SamplingParams(**base, stop_token_ids=[first]))
    finals = {o.index: o for o in engine.step() if o.finished}
    going_on = 4 - len(finals)
    finals.update((o.index, o) for o in engine.step() if o.finished)
    # the samples still going took sample 0's two full prompt blocks and recomputed only the 8-token tail
    assert engine.stats()["num_computed_tokens"] == len(PROMPT) + going_on * (8 + 1)
    while engine.has_unfinished():
        finals.update((o.index, o) for o in engine.step() if o.finished)
    assert finals[0].token_ids == [first] and finals[0].finish_reason == "stop"
    for index, out in finals.items():
        expected = free[index].token_ids
        cut = expected.index(first) + 1 if first in expected else len(expected)
        assert out.token_ids == expected[:cut]  # each sample draws from its own seeded stream
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + out.token_ids])).logits[0, len(PROMPT) - 1:-1]
        reference = torch.log_softmax(logits.float(), -1)
        for pos, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert entry[token] == pytest.approx(reference[pos, token].item(), abs=1e-4)
    assert used_blocks(engine) == 0


def test_a_request_waits_until_all_its_samples_fit_in_the_batch(tiny_model, hf_model, make_llm):
    folder = tiny_model("llama")
    engine = make_llm(folder, scheduler__max_num_seqs=4).engine
    greedy = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = engine.add_request([1, 2, 3], SamplingParams(n=2, **greedy))
    second = engine.add_request(PROMPT, SamplingParams(n=3, **greedy))
    finals, first_done_at, second_started_at = {}, None, None
    for step in range(1, 100):
        if not engine.has_unfinished():
            break
        outputs = engine.step()
        assert engine.stats()["num_running"] <= 4
        if second_started_at is None and any(o.request_id == second for o in outputs):
            second_started_at = step
            assert sorted(o.index for o in outputs if o.request_id == second) == [0, 1, 2]  # all at once
        finals.update(((o.request_id, o.index), o) for o in outputs if o.finished)
        if first_done_at is None and {(first, 0), (first, 1)} <= finals.keys():
            first_done_at = step
    # 2 + 3 samples never ran side by side: the second request started once the first had ended
    assert second_started_at > first_done_at
    assert {k: o.token_ids for k, o in finals.items()} == {
        **{(first, i): hf_greedy(hf_model(folder), [1, 2, 3], 6) for i in range(2)},
        **{(second, i): hf_greedy(hf_model(folder), PROMPT, 6) for i in range(3)}}
