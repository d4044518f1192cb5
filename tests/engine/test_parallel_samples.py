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


def test_greedy_samples_are_all_the_greedy_continuation(tiny_model, hf_model, make_llm):
    folder = tiny_model("llama")
    llm = make_llm(folder)
    outs = llm.generate([PROMPT, [1, 2, 3]], SamplingParams(n=3, max_tokens=8, temperature=0.0), use_tqdm=False)
    assert [o.index for o in outs] == [0, 1, 2, 0, 1, 2]
    expected = hf_greedy(hf_model(folder), PROMPT, 8)
    assert all(o.token_ids == expected for o in outs[:3])
    assert outs[3].token_ids == outs[4].token_ids == outs[5].token_ids == hf_greedy(hf_model(folder), [1, 2, 3], 8)
    assert len({o.request_id for o in outs[:3]}) == 1 and all(o.prompt_token_ids == PROMPT for o in outs[:3])


def test_every_sample_follows_the_model_distribution_of_its_own_tokens(tiny_model, hf_model, make_llm):
    """Logprobs of each sample's tokens equal transformers' for that sample's own prefix: its KV is right."""
    folder = tiny_model("qwen2")
    hf = hf_model(folder)
    outs = make_llm(folder).generate([PROMPT], SamplingParams(n=3, max_tokens=6, temperature=1.5, seed=7,
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


def test_samples_survive_preemption(tiny_model, hf_model, make_llm):
    folder = tiny_model("llama")
    engine = make_llm(folder, cache__num_blocks=8).engine
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
