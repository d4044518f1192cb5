"""Token selection: greedy, temperature, top-k/top-p filters, seeds, logprobs."""

import torch

from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.sampler import Sampler, apply_top_k_top_p


def sampler(seed=0):
    return Sampler(torch.Generator().manual_seed(seed))


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_takes_the_argmax():
    logits = torch.randn(4, 50, generator=seeded(1))
    out = sampler()(logits, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_best():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    filtered = apply_top_k_top_p(logits, torch.tensor([2]), None)
    assert torch.isfinite(filtered).tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    filtered = apply_top_k_top_p(probs.log(), None, torch.tensor([0.75]))
    assert torch.isfinite(filtered).tolist() == [[True, True, False, False]]
    # a tiny top_p still keeps the most likely token
    filtered = apply_top_k_top_p(probs.log(), None, torch.tensor([1e-6]))
    assert torch.isfinite(filtered).tolist() == [[True, False, False, False]]


def test_sampled_tokens_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = probs.log().expand(4000, 4).contiguous()
    out = sampler()(logits, [SamplingParams(temperature=1.0)] * 4000, [None] * 4000)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03)
    assert counts[3] == 0


def test_seeded_request_draws_the_same_tokens_in_any_batch():
    logits = torch.randn(6, 100, generator=seeded(2))
    params = SamplingParams(temperature=1.3, top_p=0.9, seed=42)

    def draw(rows, position):
        batch = logits[rows]
        gens = [seeded(42) if i == position else None for i in range(len(rows))]
        plist = [params if i == position else SamplingParams(temperature=0.7) for i in range(len(rows))]
        return [sampler(seed=len(rows))(batch, plist, gens).token_ids[position] for _ in range(3)]

    alone = draw([3], 0)
    assert draw([0, 1, 3, 5], 2) == alone
    assert draw([3, 4], 0) == alone


def test_logprobs_are_the_raw_log_softmax_with_top_alternatives():
    logits = torch.randn(3, 30, generator=seeded(3))
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0),
              SamplingParams(temperature=0.5, logprobs=0)]
    out = sampler()(logits, params, [None] * 3)
    expected = torch.log_softmax(logits, -1)
    first = out.logprobs[0]
    assert set(first) == set(expected[0].topk(3).indices.tolist())
    for token, value in first.items():
        assert abs(value - expected[0, token].item()) < 1e-6
    assert out.logprobs[1] is None
    assert list(out.logprobs[2]) == [out.token_ids[2]]
    assert abs(out.logprobs[2][out.token_ids[2]] - expected[2, out.token_ids[2]].item()) < 1e-6
