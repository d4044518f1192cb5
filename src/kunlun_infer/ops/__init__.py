"""The op table's contract: every named kernel, its signature, and its plain-torch reference.

A model declares the ops it needs by name; the runtime resolves each against
the chosen ops plugin and falls back to the reference here (logged and
counted) or refuses under ``ops.strict``. ``OP_SPECS`` is also what the
conformance suite iterates over: each spec can build sample inputs so any
plugin's kernel is compared with the reference within the dtype's tolerance.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from kunlun_infer.ops import reference

__all__ = ["OP_SPECS", "OpSpec", "TOLERANCES", "reference"]

#: (rtol, atol) per dtype used when comparing a kernel with its reference
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op of the table.

    ``reference``: the plain-torch definition. ``sample``: builds
    ``(args, kwargs)`` for a conformance check from a dtype, a torch device and
    a seeded generator. ``in_place_arg``: index of an argument the op mutates
    (compared instead of the return value), or ``None``. ``variants``: how
    many distinct samples the conformance suite draws (seeds ``0..variants-1``;
    a sample may choose its case from ``g.initial_seed()``), for ops whose
    options change what they compute.
    """

    name: str
    reference: Callable[..., Any]
    sample: Callable[[torch.dtype, torch.device, torch.Generator], tuple[tuple, dict]]
    in_place_arg: int | None = None
    doc: str = ""
    variants: int = 1


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def _sample_rms(dtype, device, g):
    return (_randn(g, 7, 64, dtype=dtype, device=device), _randn(g, 64, dtype=dtype, device=device), 1e-6), {}


def _sample_add_rms(dtype, device, g):
    x = _randn(g, 7, 64, dtype=dtype, device=device)
    r = _randn(g, 7, 64, dtype=dtype, device=device)
    return (x, r, _randn(g, 64, dtype=dtype, device=device), 1e-6), {}


def _sample_rotary(dtype, device, g):
    head_dim, max_pos = 32, 64
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    cache = torch.stack((emb.cos(), emb.sin()), dim=1).to(device)
    positions = torch.randint(0, max_pos, (9,), generator=g).to(device)
    return (positions, _randn(g, 9, 4, head_dim, dtype=dtype, device=device),
            _randn(g, 9, 2, head_dim, dtype=dtype, device=device), cache), {}


def _sample_silu(dtype, device, g):
    return (_randn(g, 5, 2 * 48, dtype=dtype, device=device),), {}


def _sample_pack(dtype, device, g):
    return (_randn(g, 24, 40, dtype=dtype, device=device),), {}


def _sample_linear(dtype, device, g):
    return (_randn(g, 6, 40, dtype=dtype, device=device), _randn(g, 24, 40, dtype=dtype, device=device),
            _randn(g, 24, dtype=dtype, device=device)), {}


def _sample_pack_int8(dtype, device, g):
    q, scale = reference.quantize_int8(torch.randn(24, 40, generator=g))
    return (q.to(device), scale.to(device)), {}


def _sample_int8_linear(dtype, device, g):
    q, scale = reference.quantize_int8(torch.randn(24, 40, generator=g))
    x = _randn(g, 6, 40, dtype=dtype, device=device)
    return (x, (q.to(device), scale.to(device)), _randn(g, 24, dtype=dtype, device=device)), {}


def _sample_embedding(dtype, device, g):
    return (torch.randint(0, 50, (11,), generator=g).to(device), _randn(g, 50, 16, dtype=dtype, device=device)), {}


def _paged_layout(g, device, seqs: list[tuple[int, int]], num_blocks: int, block_size: int):
    """Random disjoint block tables for ``seqs`` = [(ctx_len, q_len)]."""
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(math.ceil(c / block_size) for c, _ in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for i, (ctx, _) in enumerate(seqs):
        for b in range(math.ceil(ctx / block_size)):
            tables[i, b] = perm.pop()
    qsl = [0]
    for _, q_len in seqs:
        qsl.append(qsl[-1] + q_len)
    return (tables.to(device), torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=device),
            torch.tensor(qsl, dtype=torch.int32, device=device))


def _sample_store_kv(dtype, device, g):
    block_size, num_blocks, hk, d = 4, 8, 2, 16
    k_cache = torch.zeros(num_blocks, block_size, hk, d, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:10].to(device)
    slots[3] = -1
    return (_randn(g, 10, hk, d, dtype=dtype, device=device), _randn(g, 10, hk, d, dtype=dtype, device=device),
            k_cache, v_cache, slots), {}


def _sample_paged_attention(dtype, device, g):
    block_size, num_blocks, hq, hk, d = 4, 24, 4, 2, 16
    seqs = [(1, 1), (9, 9), (13, 1), (10, 3)]  # prefill of 1, full prefill, decode, chunked prefill
    tables, lens, qsl = _paged_layout(g, device, seqs, num_blocks, block_size)
    k_cache = _randn(g, num_blocks, block_size, hk, d, dtype=dtype, device=device)
    v_cache = _randn(g, num_blocks, block_size, hk, d, dtype=dtype, device=device)
    q = _randn(g, int(qsl[-1]), hq, d, dtype=dtype, device=device)
    return (q, k_cache, v_cache, tables, lens, qsl, d ** -0.5), {}


def _sample_token_bitmask(dtype, device, g):
    vocab, words = 100, 4  # the mask covers 128 tokens: the last 28 bits lie beyond the vocabulary
    logits = _randn(g, 5, vocab, dtype=dtype, device=device)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # every token allowed
    bitmask[2, 1:] = 0  # only the first 32 tokens may be drawn
    return (logits, bitmask.to(device), torch.tensor([4, 0, 2], device=device)), {}


def _sample_greedy(dtype, device, g):
    """float32 logits (what the sampler is given) whatever ``dtype``: rows with a tie for the largest value, a
    NaN, nothing but -inf, +inf twice, a largest value in a row's last few logits, and a row a vector's width
    plus a few long (the last one's sample rows are 37 logits, the others 1000)."""
    vocab = 37 if g.initial_seed() % 2 else 1000
    logits = torch.randn(8, vocab, generator=g)
    logits[0, [3, vocab - 2]] = 50.0  # a tie: the first wins
    logits[1, [vocab // 2, vocab - 1]] = float("nan")  # the first NaN wins
    logits[2] = float("-inf")  # nothing drawable: index 0
    logits[3, [5, 9]] = float("inf")
    logits[4, vocab - 1] = 50.0  # in the tail past the last whole vector
    logits[5] = 1.0  # all tied
    return (logits.to(device),), {}


def _sample_tokens(dtype, device, g):
    """float32 logits whatever ``dtype``, 8 rows (3000 logits: a draw by blocks; odd seeds 37: by token): greedy;
    temperature alone; top-k; top-k whose k-th token is tied; top-p; top-k, top-p and min-p at once; min-p alone; and
    a row of nothing but -inf. Each sampled row's uniforms fall 1% inside one end of a token's share (one at least
    a quarter as likely as its block's likeliest) in the reference's distribution, the end drawn at random: far
    enough from it for any order of float sums to agree, near enough that a kernel whose distribution moves that
    end by more than 1% of the token's share draws another."""
    vocab = 37 if g.initial_seed() % 2 else 3000
    logits = torch.randn(8, vocab, generator=g) * 2
    logits[3, [4, 9, vocab - 3]] = 9.0  # k = 2: the top token and these three ties
    logits[3, 1] = 10.0
    logits[7] = float("-inf")
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.0, 1.3, 0.9, 1.0, 1.0])
    top_k = torch.tensor([0, 0, 5, 2, 0, 50, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.8, 0.9, 1.0, 0.5])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.1, 0.0])
    weights = reference.kept_weights(logits, temperature, top_k, top_p, min_p).double()
    uniforms = torch.zeros(8, 2)
    for row in range(8):
        if float(weights[row].sum()) == 0:
            continue
        blocks = weights[row].split(reference.DRAW_BLOCK)  # the block first (where there are several), then in it
        sums = torch.stack([b.sum() for b in blocks])
        block = int(torch.multinomial(sums, 1, generator=g))
        within = blocks[block]
        heavy = (within >= within.max() / 4).nonzero().squeeze(1)  # a share wide enough for any rounding
        token = int(heavy[torch.randint(len(heavy), (1,), generator=g)])
        inside = torch.where(torch.rand(2, generator=g, dtype=torch.float64) < 0.5, 0.01, 0.99)
        at_token = (within[:token].sum() + inside[1] * within[token]) / within.sum()
        if len(blocks) == 1:
            uniforms[row, 0] = at_token
        else:
            uniforms[row] = torch.stack([(sums[:block].sum() + inside[0] * sums[block]) / sums.sum(), at_token])
    return tuple(t.to(device) for t in (logits, temperature, top_k, top_p, min_p, uniforms)), {}


#: the cases of ``moe_route``'s conformance samples: Mixtral / Qwen3-MoE (renormalised or not), DeepSeek-V2,
#: DeepSeek-V3
_ROUTE_CASES = (
    dict(top_k=2, scoring="softmax", renormalize=True),
    dict(top_k=3, scoring="softmax"),
    dict(top_k=3, scoring="softmax", num_expert_group=4, topk_group=2, group_score="max", routed_scaling_factor=16.0),
    dict(top_k=4, scoring="sigmoid", renormalize=True, num_expert_group=4, topk_group=2, group_score="top2_sum",
         routed_scaling_factor=2.5),
)


def _sample_moe_route(dtype, device, g):
    case = _ROUTE_CASES[g.initial_seed() % len(_ROUTE_CASES)]
    logits = _randn(g, 9, 16, dtype=dtype, device=device)
    kwargs = dict(case)
    if case["scoring"] == "sigmoid":
        kwargs["correction_bias"] = (0.1 * torch.randn(16, generator=g)).to(device)
    return (logits, kwargs.pop("top_k")), kwargs


def _moe_weights(g, dtype, device, experts: int, hidden: int, intermediate: int):
    w13 = (torch.randn(experts, 2 * intermediate, hidden, generator=g) / hidden ** 0.5).to(dtype=dtype, device=device)
    w2 = (torch.randn(experts, hidden, intermediate, generator=g) / intermediate ** 0.5).to(dtype=dtype, device=device)
    return w13, w2


def _sample_fused_moe(dtype, device, g):
    tokens, experts, top_k, hidden, intermediate = 11, 6, 2, 32, 24
    x = _randn(g, tokens, hidden, dtype=dtype, device=device)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    ids[3, 1] = -1  # an expert held by another rank: contributes nothing
    weights = torch.rand(tokens, top_k, generator=g)
    return (x, _moe_weights(g, dtype, device, experts, hidden, intermediate), weights.to(device), ids.to(device)), {}


OP_SPECS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec("rms_norm", reference.rms_norm, _sample_rms),
        OpSpec("add_rms_norm", reference.add_rms_norm, _sample_add_rms),
        OpSpec("rotary_embedding", reference.rotary_embedding, _sample_rotary),
        OpSpec("silu_and_mul", reference.silu_and_mul, _sample_silu),
        OpSpec("pack_linear_weight", reference.pack_linear_weight, _sample_pack),
        OpSpec("linear", reference.linear, _sample_linear),
        OpSpec("embedding", reference.embedding, _sample_embedding),
        OpSpec("store_kv", reference.store_kv, _sample_store_kv, in_place_arg=2),
        OpSpec("paged_attention", reference.paged_attention, _sample_paged_attention),
        OpSpec("apply_token_bitmask", reference.apply_token_bitmask, _sample_token_bitmask, in_place_arg=0),
        # added in hook API 1.3 (model.quantization=int8)
        OpSpec("pack_int8_linear_weight", reference.pack_int8_linear_weight, _sample_pack_int8),
        OpSpec("int8_linear", reference.int8_linear, _sample_int8_linear),
        # added in hook API 1.4 (mixture-of-experts models)
        OpSpec("moe_route", reference.moe_route, _sample_moe_route, variants=len(_ROUTE_CASES)),
        OpSpec("pack_moe_weights", reference.pack_moe_weights, _sample_fused_moe),
        OpSpec("fused_moe", reference.fused_moe, _sample_fused_moe),
        # added in hook API 1.8 (greedy decoding)
        OpSpec("greedy_tokens", reference.greedy_tokens, _sample_greedy, variants=2),
        OpSpec("sample_tokens", reference.sample_tokens, _sample_tokens, variants=2),
    )
}
for _name, _spec in OP_SPECS.items():
    object.__setattr__(_spec, "doc", (_spec.reference.__doc__ or "").strip().splitlines()[0])
