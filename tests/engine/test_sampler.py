"""Token selection: greedy, temperature, top-k/top-p filters, seeds, logprobs."""

import math

import pytest
import torch

from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.sampler import (
    DRAW_BLOCK,
    EXP_FLOOR,
    Sampler,
    draw_from,
    keep_top_k_top_p,
    keep_top_p,
    mass_threshold,
)
from kunlun_infer.plugins import cpu_kernels
from tests.kernel_sets import kernel_set  # noqa: F401 - fixture


def sampler(seed=0, waits_are_free=False):
    return Sampler(torch.Generator().manual_seed(seed), waits_are_free=waits_are_free)


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_takes_the_argmax():
    logits = torch.randn(4, 50, generator=seeded(1))
    out = sampler()(logits, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_greedy_takes_the_first_of_tied_maxima_and_a_nan_as_argmax_does():
    """Greedy output is reproducible across engines only if ties break alike: the first index of the largest
    value, a NaN counted largest (a row of -inf gives 0), in a mixed batch too, and over a full vocabulary."""
    wide = torch.zeros(3, 151936)
    wide[0, [7, 150000]] = 2.0
    wide[1, [99_999, 100_000]] = float("inf")
    wide[2, [5, 6]] = float("nan")
    rows = [
        torch.tensor([[1.0, 3.0, 3.0, 2.0], [float("nan"), 1.0, float("nan"), 5.0],
                      [-math.inf] * 4, [2.0, 9.0, 9.0, math.inf]]),
        torch.randint(0, 3, (16, 1000), generator=seeded(2)).float(),
        wide,
    ]
    for logits in rows:
        expected = logits.argmax(-1).tolist()
        n = len(logits)
        assert sampler()(logits, [SamplingParams(temperature=0)] * n, [None] * n).token_ids == expected
        mixed = [SamplingParams(temperature=0) if i % 2 == 0 else SamplingParams(temperature=1.0) for i in range(n)]
        assert sampler()(logits, mixed, [None] * n).token_ids[::2] == expected[::2]
    assert [row[0] for row in rows[0].argmax(-1, keepdim=True).tolist()] == [1, 0, 0, 3]


def test_top_k_keeps_only_the_k_best():
    weights = torch.tensor([[0.1, 0.4, 0.2, 0.3, 0.05]])
    filtered = keep_top_k_top_p(weights, torch.tensor([2]), torch.tensor([1.0]))
    assert (filtered > 0).tolist() == [[False, True, False, True, False]]
    # the k-th token's ties all stay
    tied = keep_top_k_top_p(torch.tensor([[0.1, 0.4, 0.3, 0.3, 0.05]]), torch.tensor([2]), torch.tensor([1.0]))
    assert (tied > 0).tolist() == [[False, True, True, True, False]]


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    off = torch.tensor([0])
    assert (keep_top_k_top_p(probs, off, torch.tensor([0.75])) > 0).tolist() == [[True, True, False, False]]
    # a tiny top_p still keeps the most likely token
    assert (keep_top_k_top_p(probs, off, torch.tensor([1e-6])) > 0).tolist() == [[True, False, False, False]]
    # of tokens tied at the threshold, the first in column order, as many as the mass asks for
    flat = torch.full((1, 4), 0.25)
    assert (keep_top_k_top_p(flat, off, torch.tensor([0.6])) > 0).tolist() == [[True, True, True, False]]
    # the same without a sort (a vocabulary narrower than every candidate width: the mass threshold)
    for top_p, kept in ((0.75, [True, True, False, False]), (1e-6, [True, False, False, False])):
        dist = sampler(waits_are_free=True).distribution(probs.log(), [SamplingParams(top_p=top_p)])
        assert (dist > 0).tolist() == [kept]


def test_sampled_tokens_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = probs.log().expand(4000, 4).contiguous()
    out = sampler()(logits, [SamplingParams(temperature=1.0)] * 4000, [None] * 4000)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03)
    assert counts[3] == 0


@pytest.mark.parametrize("waits_are_free", [False, True])
@pytest.mark.parametrize("vocab", [100, 151936])
def test_seeded_request_draws_the_same_tokens_in_any_batch(vocab, waits_are_free):
    logits = torch.randn(6, vocab, generator=seeded(2)) * 4
    params = SamplingParams(temperature=1.3, top_p=0.9, seed=42)

    def draw(rows, position):
        batch = logits[rows]
        gens = [seeded(42) if i == position else None for i in range(len(rows))]
        plist = [params if i == position else SamplingParams(temperature=0.7, top_k=3 * i)
                 for i in range(len(rows))]
        return [sampler(len(rows), waits_are_free)(batch, plist, gens).token_ids[position] for _ in range(3)]

    alone = draw([3], 0)
    assert draw([0, 1, 3, 5], 2) == alone
    assert draw([3, 4], 0) == alone


def mixed_rows(vocab):
    """Logits of rows whose top-k / top-p nucleus closes at every candidate width and past the last, with
    their filters; ``[rows, vocab]`` and a list of ``SamplingParams``."""
    g = seeded(5)
    rank = torch.arange(1, vocab + 1, dtype=torch.float32)
    rows, params = [], []
    for slope, top_k, top_p in [(3.0, 0, 0.9), (1.3, 0, 0.9), (1.0, 0, 0.9), (0.2, 0, 0.99), (0.0, 0, 0.5),
                                (1.0, 50, 1.0), (0.5, 300, 1.0), (0.5, 5000, 1.0), (0.1, 15000, 0.9),
                                (0.8, 40, 1.0), (0.4, 2000, 0.7), (0.0, 0, 1.0)]:
        # Zipf-like: the slope sets how wide the nucleus is (0: flat, it holds nearly the whole vocabulary)
        row = -slope * rank.log() + 0.01 * torch.randn(vocab, generator=g)
        rows.append(row[torch.randperm(vocab, generator=g)])
        params.append(SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p))
    logits = torch.stack(rows)
    order = logits[9].argsort(descending=True)
    logits[9, order[29:45]] = float(logits[9, order[29]])  # ties: the 30th to 45th likeliest share the 40th's logit
    logits[10, 10:] = float("-inf")  # a mask (structured output) leaves 10 tokens, fewer than top_k
    return logits, params


def test_the_nucleus_search_keeps_what_sorting_the_vocabulary_keeps():
    vocab = 20000  # wider than the last candidate width: rows close at each width and past it
    logits, params = mixed_rows(vocab)
    sorted_probs = sampler(waits_are_free=False).distribution(logits, params)
    searched = sampler(waits_are_free=True).distribution(logits, params)
    kept = (sorted_probs > 0).sum(-1).tolist()
    assert kept[0] < 256 < kept[1] <= 1024 < kept[2] <= 8192 < kept[3]  # nuclei within each width and past it
    assert kept[5:8] == [50, 300, 5000] and kept[9] == 45  # top-k keeps the ties of its k-th token
    assert kept[10] <= 10
    assert ((searched > 0) == (sorted_probs > 0)).all()
    assert torch.allclose(searched, sorted_probs, atol=1e-6, rtol=1e-4)
    assert torch.allclose(searched.sum(-1), torch.ones(len(params)), atol=1e-5)


def test_the_nucleus_search_ends_at_the_first_width_that_holds_every_row(monkeypatch):
    logits, params = mixed_rows(20000)
    widths = []
    real_topk = torch.Tensor.topk

    def recording_topk(self, k, *args, **kwargs):
        widths.append((self.shape[0], k))
        return real_topk(self, k, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "topk", recording_topk)
    sampler(waits_are_free=True).distribution(logits[[0, 5, 9]], [params[i] for i in (0, 5, 9)])
    assert widths == [(3, 256)]  # peaked rows, a small top-k and ties inside the width: one pass
    widths.clear()
    sampler(waits_are_free=True).distribution(logits[[0, 1]], [params[i] for i in (0, 1)])
    assert widths == [(2, 256), (1, 1024)]  # only the row still open looks further
    widths.clear()
    sampler(waits_are_free=True).distribution(logits[[0, 2]], [params[i] for i in (0, 2)])
    # a row whose lightest candidate shows no width can hold it goes to the thresholds after the first
    assert widths == [(2, 256)]
    widths.clear()
    sampler(waits_are_free=True).distribution(logits[[4, 7]], [params[i] for i in (4, 7)])
    # a flat row likewise; a top-k of 5000, wider than every width, at once
    assert widths == [(1, 256)]


def test_counting_tokens_the_threshold_is_the_kth_heaviest_weight():
    g = seeded(11)
    weights = torch.cat([(torch.randn(3, 30000, generator=g) * s).exp() for s in (0.1, 2.0)])
    weights[0, :5000] = 0.0  # masked tokens
    weights[1, 100:9100] = weights[1, 50]  # 9000 ties
    weights[2, 200:] = 0.0  # fewer positive tokens than some k asked for
    for k in (1, 7, 8999, 9000, 15000, 30000):
        t = mass_threshold(weights, torch.full((6,), float(k)), by_count=True)
        assert torch.equal(t, weights.sort(dim=-1, descending=True).values[:, k - 1]), k


def test_a_top_k_wider_than_every_width_keeps_exactly_what_sorting_keeps():
    logits, _ = mixed_rows(20000)
    cases = [SamplingParams(temperature=1.0, top_k=k, top_p=p) for k, p in ((9000, 1.0), (15000, 1.0), (12000, 0.95),
                                                                          (19999, 1.0))]
    rows = logits[[1, 3, 4, 7]]
    order = rows[0].argsort(descending=True)
    rows[0, order[8500:11500]] = rows[0, order[8500]].item()  # the 9000th token's ties reach the 11500th
    sorted_probs = sampler(waits_are_free=False).distribution(rows, cases)
    searched = sampler(waits_are_free=True).distribution(rows, cases)
    kept = (searched > 0).sum(-1).tolist()
    assert kept[0] == 11500 and kept[1] == 15000 and kept[3] == 19999
    assert kept[2] < 12000  # top-p then cut into the top-k
    assert ((searched > 0) == (sorted_probs > 0)).all()
    assert torch.allclose(searched, sorted_probs, atol=1e-6, rtol=1e-4)


def test_top_p_keeps_as_many_tied_tokens_as_a_sort_would():
    """Past the candidate widths, tokens tied at the threshold are kept while the mass before them is short of
    top_p, the first in column order: a flat row keeps top_p of its tokens, not all of them."""
    vocab, heavy_count = 20000, 5000
    flat = torch.zeros(vocab)
    groups = torch.ones(vocab)
    groups[torch.randperm(vocab, generator=seeded(13))[:heavy_count]] = 2.0
    logits = torch.stack([flat, groups, flat, groups])
    params = [SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0, top_p=0.25, top_k=2500), SamplingParams(temperature=1.0, top_p=0.9)]
    searched = sampler(waits_are_free=True).distribution(logits, params)
    kept = [torch.nonzero(row).squeeze(1).tolist() for row in searched]
    assert kept[0] == list(range(10000))  # 10000 of 20000 equal tokens carry half the mass
    assert kept[2] == list(range(5000))  # top-k keeps all 20000 ties, then top-p a quarter of them
    heavy, light = (torch.nonzero(groups == v).squeeze(1).tolist() for v in (2.0, 1.0))
    light_weight = float(torch.tensor(-1.0).exp())  # the heavy tokens weigh 1
    total = heavy_count + (vocab - heavy_count) * light_weight
    for row, p in ((1, 0.5), (3, 0.9)):  # the nucleus ends inside the lighter group
        lights = math.ceil((p * total - heavy_count) / light_weight)
        assert kept[row] == sorted(heavy + light[:lights]), row
    sorted_kept = (sampler(waits_are_free=False).distribution(logits, params) > 0).sum(-1).tolist()
    assert [len(k) for k in kept[1::2]] == sorted_kept[1::2]  # as many as a sort keeps
    weights = torch.ones(2, 10)
    keep_top_p(weights, torch.tensor([3.5, 100.0]))  # 4 tokens reach 3.5; more than the mass keeps all
    assert weights.sum(-1).tolist() == [4.0, 10.0]


def test_the_mass_threshold_is_where_the_heaviest_tokens_reach_the_mass_asked_for():
    g = seeded(9)
    weights = torch.cat([(torch.randn(6, 50000, generator=g) * s).exp() for s in (0.1, 1.0, 3.0)])
    weights[0, :100] = 0.0  # tokens of no weight (masked) sit below every threshold
    weights[1, 7:20] = weights[1, 5]  # ties
    total = weights.double().sum(-1)
    for p in (1e-9, 0.3, 0.9, 0.999):
        need = (p * total).float()
        t = mass_threshold(weights, need).double().unsqueeze(1)
        heavier = (weights.double() * (weights > t)).sum(-1)
        kept = (weights.double() * (weights >= t)).sum(-1)
        assert ((weights >= t).sum(-1) >= 1).all()  # at least the heaviest token
        assert (heavier < need.double() + 1e-6 * total).all() and (kept >= need.double() - 1e-6 * total).all(), p
    # asking for more than all of it keeps every token
    assert (weights >= mass_threshold(weights, total.float() * 2).unsqueeze(1)).all()


def test_draws_from_a_wide_row_follow_its_distribution():
    vocab = 3 * DRAW_BLOCK + 300  # three whole blocks and a short one
    probs = torch.zeros(vocab)
    probs[[0, 5, DRAW_BLOCK - 1, DRAW_BLOCK, 2 * DRAW_BLOCK + 7, vocab - 300, vocab - 1]] = \
        torch.tensor([0.1, 0.2, 0.05, 0.25, 0.15, 0.05, 0.2])
    n = 40000
    tokens = draw_from(probs.expand(n, vocab), torch.rand(n, 2, generator=seeded(7)))
    counts = torch.bincount(tokens, minlength=vocab).float() / n
    assert counts[probs == 0].sum() == 0  # never a token of probability 0
    assert torch.allclose(counts, probs, atol=0.01)


def test_a_draw_at_either_end_of_the_unit_interval_takes_a_token_of_nonzero_probability():
    for vocab in (50, 3 * DRAW_BLOCK + 300):
        probs = torch.zeros(2, vocab)
        probs[:, 3] = probs[:, vocab - 5] = 0.5  # zeros before, between and after
        largest = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))  # the largest float32 below 1
        for u in (0.0, float(largest)):
            tokens = draw_from(probs * torch.tensor([[1.0], [3.0]]), torch.full((2, 2), u))  # any scale
            assert set(tokens.tolist()) <= {3, vocab - 5}
    assert draw_from(probs, torch.tensor([[0.2, 0.0], [0.9, 0.0]])).tolist() == [3, vocab - 5]


def test_sampling_is_drawn_without_an_exponential_per_token(monkeypatch):
    """Drawing costs a few passes over a row: one exponential variate per token cost ~15 ns each on a CPU
    core (20 ms a step for eight rows of a 150k vocabulary), a sort ~5 ms a row."""
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda *a, **k: pytest.fail("exponential noise drawn"))
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: pytest.fail("the vocabulary sorted"))
    logits, params = mixed_rows(20000)
    rows = [0, 1, 3, 4, 5, 6, 8, 9, 10]  # 3, 4 and 8 (a top-k of 15000): nuclei wider than every width
    out = sampler(waits_are_free=True)(logits[rows], [params[i] for i in rows], [None] * len(rows))
    assert len(out.token_ids) == len(rows)


def test_weights_are_exact_above_the_exponent_floor_and_zero_below(monkeypatch):
    """Masked tokens and a low temperature put most of a row far below its top token, where torch's exp on a
    CPU takes 12-30x longer: no exponent goes below the floor, weights above it are the exact exp, and
    tokens at or below it weigh 0."""
    assert torch.tensor(EXP_FLOOR).exp() >= torch.finfo(torch.float32).tiny  # still a normal float
    logits = torch.randn(4, 5000, generator=seeded(7)) * 4
    logits[1, ::3] = float("-inf")  # masked tokens
    temperatures = [1.0, 0.7, 0.1, 0.05]
    params = [SamplingParams(temperature=t) for t in temperatures]
    lowest = []
    real_exp = torch.Tensor.exp_
    monkeypatch.setattr(torch.Tensor, "exp_", lambda t: (lowest.append(t.min().item()), real_exp(t))[1])
    weights = sampler(waits_are_free=True).weights(logits, params)
    assert lowest and min(lowest) >= EXP_FLOOR
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / torch.tensor(temperatures).unsqueeze(1)
    above = scaled > EXP_FLOOR
    assert torch.equal(weights[above], scaled[above].exp())
    assert not weights[~above].any()
    assert (~above[2:]).float().mean() > 0.3  # the low temperatures do put much of their rows below it


@pytest.mark.parametrize("waits_are_free", [True, False])
def test_degenerate_rows_draw_a_token_without_error(waits_are_free):
    """Logits pushed to +inf by a tiny repetition penalty, a row masked whole, a NaN from the model, and a
    temperature past float32's range (1e300 is a valid request: as float32 it is inf, and inf / inf is NaN)."""
    logits = torch.randn(4, 5000, generator=seeded(12))
    logits[0, :10] = float("inf")
    logits[1] = float("-inf")
    logits[2, 3] = float("nan")
    for keys in ({"temperature": 1e300, "top_p": 0.5}, {"temperature": 1e300, "top_k": 3000},
                 {"temperature": 0.7, "top_p": 0.99}, {"temperature": 1e300, "min_p": 0.5}):
        params = [SamplingParams(**keys)] * 4
        tokens = sampler(waits_are_free=waits_are_free)(logits, params, [None] * 4).token_ids
        assert all(0 <= t < 5000 for t in tokens), keys
        weights = sampler(waits_are_free=waits_are_free).weights(logits, params)
        assert not weights[[0, 3]].isnan().any(), keys
        if waits_are_free:
            assert not weights[1].isnan().any() and weights[1].sum() == 0, keys  # masked whole: nothing weighs


def test_an_asynchronous_devices_draw_needs_no_searchsorted(monkeypatch):
    """torch.searchsorted is not in every vendor's torch: the draw an asynchronous device runs (sort-based
    filters, then the two-uniform draw) finds its index by comparisons."""
    logits, params = mixed_rows(3000)
    want = sampler(waits_are_free=False)(logits, params, [None] * len(params)).token_ids
    monkeypatch.setattr(torch, "searchsorted", lambda *a, **k: pytest.fail("torch.searchsorted called"))
    assert sampler(waits_are_free=False)(logits, params, [None] * len(params)).token_ids == want


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


def test_logit_bias_moves_its_rows_tokens_and_leaves_the_others_and_the_raw_logits_alone():
    logits = torch.randn(3, 40, generator=seeded(5))
    raw = logits.clone()
    top = logits.argmax(-1).tolist()
    banned, forced = top[0], (top[1] + 1) % 40
    params = [SamplingParams(temperature=0, logit_bias={banned: -100}),
              SamplingParams(temperature=0, logit_bias={forced: 100}, logprobs=2, logprobs_mode="processed"),
              SamplingParams(temperature=0, logprobs=1)]
    out = sampler()(logits, params, [None] * 3)
    assert out.token_ids[0] == raw[0].topk(2).indices[1].item()  # the banned argmax gives way to the next best
    assert out.token_ids[1] == forced
    assert out.token_ids[2] == top[2]
    assert torch.equal(logits, raw)  # the engine's logits are not modified
    biased = raw[1].clone()
    biased[forced] += 100
    assert abs(out.logprobs[1][forced] - torch.log_softmax(biased, -1)[forced].item()) < 1e-5
    assert abs(out.logprobs[2][top[2]] - torch.log_softmax(raw[2], -1)[top[2]].item()) < 1e-6


def test_a_sampled_row_never_draws_a_token_biased_by_minus_100():
    logits = torch.zeros(1, 4)
    logits[0, 2] = 5.0  # the likeliest by far, banned
    params = [SamplingParams(temperature=1.0, logit_bias={2: -100, 0: 2})]
    draws = [sampler(seed)(logits, params, [None]).token_ids[0] for seed in range(200)]
    assert 2 not in draws
    assert draws.count(0) > draws.count(1) and draws.count(0) > draws.count(3)  # +2 makes token 0 ~7x as likely


def test_an_ops_sample_tokens_draws_what_the_sampler_draws_itself(kernel_set):
    """Where the ops plugin has ``sample_tokens`` (hook API 1.10; the ``cpu`` ops, on every kernel set this CPU
    runs, and torch's where none is built) the sampler draws every sampled row through it, and a step's tokens and
    logprobs are those of the sampler's own draw: greedy rows among sampled ones, seeded rows, penalties, a logit
    bias and ``min_tokens`` applied before it, over a vocabulary of several draw blocks."""
    from tests.engine.test_penalties import History

    vocab, rows = 3 * DRAW_BLOCK + 77, 10
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8), SamplingParams(top_k=40),
              SamplingParams(top_p=0.9, temperature=1.1), SamplingParams(top_k=20, top_p=0.8, min_p=0.05),
              SamplingParams(temperature=0.7, seed=3, logprobs=2), SamplingParams(repetition_penalty=1.3, top_p=0.95),
              SamplingParams(min_p=0.1, logit_bias={5: 8.0}), SamplingParams(min_tokens=4, top_k=5),
              SamplingParams(temperature=3.0, presence_penalty=0.5, logprobs=0)]
    g = seeded(11)
    histories = [History(torch.randint(0, vocab, (30,), generator=g).tolist(), 20, frozenset({2})) for _ in params]
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return cpu_kernels.sample_tokens(*args)

    for step in range(3):
        logits = torch.randn(rows, vocab, generator=g) * 2.5
        outs = []
        for op in (counted, None):
            generators = [seeded(100 + i) if p.seed is not None else None for i, p in enumerate(params)]
            s = Sampler(seeded(step), waits_are_free=True, greedy=cpu_kernels.greedy_tokens, sample=op)
            outs.append(s(logits.clone(), params, generators, histories))
        assert outs[0].token_ids == outs[1].token_ids, step
        assert outs[0].logprobs == outs[1].logprobs
        assert outs[0].token_ids[0] == int(logits[0].argmax())
        assert outs[0].token_ids[8] != 2  # short of min_tokens: its stop token masked
    assert calls == [(rows, vocab)] * 3  # every row of a step in one call
