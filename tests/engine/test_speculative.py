"""Speculative decoding: the same greedy text as one token at a time, the target distribution when sampling,
rejected drafts' KV blocks freed, and what was kept counted."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kunlun_infer import ConfigError, SamplingParams
from kunlun_infer.engine.rejection import verify
from kunlun_infer.engine.sampler import Sampler
from kunlun_infer.engine.speculative import NgramProposer
from tests.engine.tiny_models import build_tiny_model

#: prompts that repeat themselves, so prompt lookup has something to find, and one that does not
PROMPTS = [[5, 6, 7, 8, 9] * 5, list(range(40, 72)) * 2, [3, 1, 4, 1, 5, 9, 2, 6]]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def noisy_copy(folder, tmp_path, scale):
    """The model in ``folder`` with noise on its output layer: a draft that agrees with it only sometimes."""
    copy = tmp_path / f"draft-{scale}"
    shutil.copytree(folder, copy)
    weights = load_file(str(copy / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for name in weights:
        if "lm_head" in name or "embed_tokens" in name:
            weights[name] = weights[name] + scale * torch.randn(weights[name].shape, generator=g)
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


def run(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_text_is_the_same_with_prefix_caching_and_preemption(arch, tiny_model, make_llm, tmp_path):
    folder = tiny_model(arch)
    plain = run(make_llm(folder), PROMPTS, GREEDY)
    tight = dict(cache__num_blocks=14, cache__block_size=8)  # 112 KV slots for ~3 x 100: preemption
    draft = noisy_copy(folder, tmp_path, 0.05)
    for spec in (dict(speculative__method="ngram", speculative__num_tokens=3),
                 dict(speculative__method="draft", speculative__draft_model=str(draft), speculative__num_tokens=4)):
        llm = make_llm(folder, **tight, **spec)
        assert run(llm, PROMPTS, GREEDY) == plain, spec
        again = run(llm, PROMPTS[:1], GREEDY)  # its prompt now comes from the prefix cache
        assert again == plain[:1]
        stats = llm.engine.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
        assert stats["spec_verifications"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
        if spec["speculative__method"] == "draft":  # a draft that is right some of the time, wrong at others
            assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


def test_a_draft_that_is_always_right_writes_several_tokens_per_step(tiny_model, make_llm):
    folder = tiny_model("llama")
    plain = make_llm(folder)
    expected = run(plain, PROMPTS, GREEDY)
    llm = make_llm(folder, speculative__method="draft", speculative__draft_model=str(folder),
                   speculative__num_tokens=4)
    assert run(llm, PROMPTS, GREEDY) == expected
    stats = llm.engine.stats()
    assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_tokens_per_step"] > 4
    assert stats["num_steps"] < plain.engine.stats()["num_steps"] / 3
    # the draft model's one-token steps replay captures (ops.step_graphs), as the model's decode steps do
    assert llm.engine._draft.runner.graphs.replays > 0


def test_stops_logprobs_and_max_tokens_inside_kept_drafts(tiny_model, make_llm):
    folder = tiny_model("llama")
    plain = make_llm(folder)
    reference = run(plain, PROMPTS[:1], GREEDY)[0]
    stop = reference[17]  # a token the text reaches after a few steps of four drafts
    params = [SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop], ignore_eos=True),
              SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True, logprobs=2)]
    expected = plain.generate([PROMPTS[0]] * 2, params, use_tqdm=False)
    llm = make_llm(folder, speculative__method="draft", speculative__draft_model=str(folder))
    got = llm.generate([PROMPTS[0]] * 2, params, use_tqdm=False)
    assert got[0].token_ids == expected[0].token_ids and got[0].token_ids[-1] == stop
    assert got[0].finish_reason == "stop" and got[1].finish_reason == "length"
    assert got[1].token_ids == expected[1].token_ids and len(got[1].token_ids) == 13
    for mine, theirs in zip(got[1].logprobs, expected[1].logprobs):
        assert mine.keys() == theirs.keys()
        assert list(mine.values()) == pytest.approx(list(theirs.values()), abs=1e-4)


def test_rejected_drafts_give_their_kv_blocks_back(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"), cache__block_size=4, speculative__method="ngram",
                   speculative__num_tokens=6)
    engine = llm.engine
    engine.add_request(PROMPTS[0], GREEDY)
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            # nothing beyond the sequence's own tokens stays allocated, and every kept token's KV is there
            blocks_for = engine.block_manager.blocks_for
            assert blocks_for(seq.num_computed_tokens) <= len(seq.block_table) <= blocks_for(len(seq))
            assert seq.num_computed_tokens == len(seq) - 1
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] and stats["kv_blocks_free"] == \
        stats["kv_blocks_total"]


def test_sampled_tokens_keep_the_target_distribution():
    """Rejection sampling: whatever the drafts and their distribution, each token is a draw from ``p``."""
    vocab, trials = 6, 6000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    sampler = Sampler(torch.Generator().manual_seed(1))
    p = sampler.distribution(logits, [params] * 3)
    q = torch.softmax(torch.randn(2, vocab, generator=g), -1)
    for draft_probs in (None, q):  # certain guesses (prompt lookup) and a draft model's draws
        counts = torch.zeros(vocab)
        generator = torch.Generator().manual_seed(2)
        for _ in range(trials):
            drafts = [int(torch.multinomial(q[0], 1, generator=generator)), int(torch.multinomial(q[1], 1,
                                                                                                generator=generator))]
            kept = verify(logits, drafts, draft_probs, params, generator, sampler)
            assert 1 <= len(kept) <= 3 and kept[:-1] == drafts[:len(kept) - 1]
            counts[kept[0]] += 1
        assert (counts / trials - p[0]).abs().max() < 0.025, (counts / trials, p[0])
        assert counts[p[0] == 0].sum() == 0  # never a token the filters removed


@pytest.mark.parametrize("reshaped", ["repetition_penalty", "logit_bias"])
def test_requests_that_cannot_be_checked_in_bulk_decode_one_token_at_a_time(tiny_model, make_llm, reshaped):
    llm = make_llm(tiny_model("llama"), speculative__method="draft", speculative__draft_model=str(
        tiny_model("llama")))
    plain = make_llm(tiny_model("llama"))
    if reshaped == "logit_bias":  # the token greedy decoding writes most, banned
        tokens = run(plain, PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0))[0]
        banned = max(set(tokens), key=tokens.count)
        params = SamplingParams(max_tokens=12, temperature=0.0, logit_bias={banned: -100})
    else:
        params = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3)
    expected = run(plain, PROMPTS[:1], params)
    assert run(llm, PROMPTS[:1], params) == expected
    assert llm.engine.stats()["spec_verifications"] == 0
    if reshaped == "logit_bias":
        assert banned not in expected[0]


def test_bad_speculative_settings_are_named(tiny_model, make_llm):
    folder = tiny_model("llama")
    with pytest.raises(ConfigError, match="speculative.method=draft needs speculative.draft_model"):
        make_llm(folder, speculative__method="draft")
    with pytest.raises(ConfigError, match="ngram_min=3 must be <= speculative.ngram_max=2"):
        make_llm(folder, speculative__method="ngram", speculative__ngram_min=3, speculative__ngram_max=2)
    other = build_tiny_model(folder.parent / "other-vocab", "llama", vocab_size=300)
    with pytest.raises(ConfigError, match="must share the model's tokenizer"):
        make_llm(folder, speculative__method="draft", speculative__draft_model=str(other))
    with pytest.raises(ConfigError, match="speculative.method"):
        make_llm(folder, speculative__method="medusa")
    with pytest.raises(ConfigError, match="speculative.num_tokens"):
        make_llm(folder, speculative__method="ngram", speculative__num_tokens=0)


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_match():
    def by_definition(tokens, k, low, high):
        for n in range(min(high, len(tokens) - 1), low - 1, -1):
            for start in range(len(tokens) - n - 1, -1, -1):  # latest first, ending before the tail
                if tokens[start:start + n] == tokens[-n:]:
                    return tokens[start + n:start + n + k]
        return []

    proposer = NgramProposer(1, 3)
    assert proposer._lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3) == [7, 5, 1]
    assert proposer._lookup([4, 5, 6], 2) == []
    g = torch.Generator().manual_seed(0)
    for _ in range(500):  # ids beyond one byte, so matches across token boundaries are possible
        tokens = (torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
                  * 65793).tolist()
        assert proposer._lookup(tokens, 4) == by_definition(tokens, 4, 1, 3), tokens
