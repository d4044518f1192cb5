"""The CUDA plugin's own Triton kernels: paged attention read in place, the KV store, fused norms, rotary, SwiGLU.

Every kernel here reads and writes device memory directly through strides
and block tables: no gathered K/V copy, no host synchronisation, and launch
grids fixed by shapes the caller chose (so a decode step's launches can be
captured once in a CUDA graph and replayed). The cache of one layer is two
tensors ``[num_blocks, num_kv_heads, block_size, head_dim]`` (keys, values):
a block of one head is one contiguous tile.

- :func:`store_kv`: new keys and values into their cache slots; a negative
  slot (a padding row) stores nothing.
- :func:`decode_attention`: one query token per sequence, all query heads of
  a KV head in one program (grouped-query attention reads each key and value
  once), the context split into ``num_splits`` pieces that run in parallel
  (flash-decoding) and are merged by their log-sum-exp in a second kernel.
- :func:`prefill_attention`: blocks of a sequence's new queries against blocks
  of its cached context (prefix included), causal from the sequence's own
  offset, online softmax; one program per (query block, query head).
- :func:`rms_norm`, :func:`add_rms_norm`, :func:`rotary_embedding`,
  :func:`silu_and_mul`: one pass each (rotary: queries and keys of a token in
  one program), with the references' roundings.

Scores and the softmax are float32; the two products run on the tensor cores
in the cache's dtype, and in exact float32 (``ieee``) for float32 caches.
Without a GPU the same kernels run in Triton's interpreter on CPU tensors
(:func:`launch`), which is how they are tested where no GPU is.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

#: context tokens one decode program reads per iteration, and the fewest one split holds
DECODE_TOKENS = 32
#: query rows and key rows of one prefill tile
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args)`` compiled for the GPU, or interpreted when its tensors are on the host CPU."""
    if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args):
        _interpret(kernel, grid, args, kwargs)
    else:
        kernel[grid](*args, **kwargs)


_INTERPRETED: dict[Any, Any] = {}


def _interpret(kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Run ``kernel`` in Triton's interpreter (numpy on the host). The language's own jit'd helpers
    (``tl.sum``, ``tl.max`` …) were compiled-mode functions when Triton was imported without
    ``TRITON_INTERPRET=1``; while the kernel runs, calls to them are interpreted too."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def interpreted(fn: Any) -> Any:
        if fn not in _INTERPRETED:
            _INTERPRETED[fn] = InterpretedFunction(fn)
        return _INTERPRETED[fn]

    compiled_call = JITFunction.__call__
    JITFunction.__call__ = lambda self, *a, **k: interpreted(self.fn)(*a, **k)  # type: ignore[method-assign]
    try:
        interpreted(kernel.fn)[grid](*args, **kwargs)
    finally:
        JITFunction.__call__ = compiled_call  # type: ignore[method-assign]


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last axis is contiguous (the kernels' one requirement on strides), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: exact float32 for float32 operands (tf32 would change results)."""
    return "ieee" if dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------------- KV store


@triton.jit
def _store_kv_kernel(Key, Value, KCache, VCache, Slots,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_ch, stride_ct,
                     num_kv_heads, head_dim,
                     BLOCK_SIZE: tl.constexpr, HEADS_P: tl.constexpr, D_P: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        h = tl.arange(0, HEADS_P)
        d = tl.arange(0, D_P)
        ok = (h[:, None] < num_kv_heads) & (d[None, :] < head_dim)
        k = tl.load(Key + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok)
        v = tl.load(Value + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok)
        dst = block * stride_cb + h[:, None] * stride_ch + offset * stride_ct + d[None, :]
        tl.store(KCache + dst, k.to(KCache.dtype.element_ty), mask=ok)
        tl.store(VCache + dst, v.to(VCache.dtype.element_ty), mask=ok)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """``key``/``value`` ``[T, Hk, D]`` (any row and head strides, unit last stride) into slots ``slots`` (int64)."""
    tokens, heads, dim = key.shape
    if tokens == 0:
        return
    key, value = unit_stride(key), unit_stride(value)
    launch(_store_kv_kernel, (tokens,), key, value, k_cache, v_cache, slots,
           key.stride(0), key.stride(1), value.stride(0), value.stride(1),
           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), heads, dim,
           BLOCK_SIZE=k_cache.shape[2], HEADS_P=_pow2(heads), D_P=_pow2(dim, 16))


# ---------------------------------------------------------------------- attention: what both kernels share


@triton.jit
def _kv_tile(KCache, VCache, table, t0, end, cache_head, d, d_ok, stride_cb, stride_ct,
             BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr):
    """The keys and values of context positions ``t0 .. t0 + TOKENS`` of one KV head (zeros from ``end`` on), read
    through a block table; returns ``(positions, which are before end, keys, values)``."""
    pos = t0 + tl.arange(0, TOKENS)
    ok = pos < end
    block = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    rows = block * stride_cb + cache_head + (pos % BLOCK_SIZE) * stride_ct
    tile_ok = ok[:, None] & d_ok[None, :]
    k = tl.load(KCache + rows[:, None] + d[None, :], mask=tile_ok, other=0.0)
    v = tl.load(VCache + rows[:, None] + d[None, :], mask=tile_ok, other=0.0)
    return pos, ok, k, v


@triton.jit
def _online_softmax(s, v, m, denom, acc, PRECISION: tl.constexpr):
    """One tile of scores ``s`` (hidden ones at -inf; every row sees at least one key by its first tile) and its
    values ``v`` folded into the running maximum ``m``, denominator and weighted sum (float32)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, denom, acc


# ---------------------------------------------------------------------- decode attention


#: arguments that change from step to step: Triton would compile a kernel again whenever one of them became 1 or
#: a multiple of 16, in the middle of serving
STEP_VARYING = ("stride_tb", "split_tokens", "num_splits")


@triton.jit(do_not_specialize=STEP_VARYING)
def _decode_kernel(Q, KCache, VCache, Tables, SeqLens, Out, PartOut, PartLse,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_cb, stride_ch, stride_ct, stride_tb,
                   split_tokens, num_splits, scale, head_dim,
                   GROUP: tl.constexpr, GROUP_P: tl.constexpr, D_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   TOKENS: tl.constexpr, SINGLE: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    start = split * split_tokens
    end = tl.minimum(seq_len, start + split_tokens)

    g = tl.arange(0, GROUP_P)
    heads = kv_head * GROUP + g
    d = tl.arange(0, D_P)
    head_ok = g < GROUP
    d_ok = d < head_dim
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=head_ok[:, None] & d_ok[None, :], other=0.0)

    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    denom = tl.full([GROUP_P], 0.0, tl.float32)
    acc = tl.full([GROUP_P, D_P], 0.0, tl.float32)
    cache_head = kv_head.to(tl.int64) * stride_ch
    table = Tables + b.to(tl.int64) * stride_tb
    for t0 in range(start, end, TOKENS):
        _, ok, k, v = _kv_tile(KCache, VCache, table, t0, end, cache_head, d, d_ok, stride_cb, stride_ct,
                               BLOCK_SIZE, TOKENS)
        s = tl.where(ok[None, :], tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale, float("-inf"))
        m, denom, acc = _online_softmax(s, v, m, denom, acc, PRECISION)

    filled = denom > 0
    out = acc / tl.where(filled, denom, 1.0)[:, None]
    out_ok = head_ok[:, None] & d_ok[None, :]
    if SINGLE:
        tl.store(Out + b * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=out_ok)
    else:
        # partial results [B, Hq, num_splits, D_P] and their log-sum-exp [B, Hq, num_splits]; empty splits: -inf
        row = (b * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(PartOut + row[:, None] * D_P + d[None, :], out, mask=out_ok)
        lse = tl.where(filled, m + tl.log(tl.where(filled, denom, 1.0)), float("-inf"))
        tl.store(PartLse + row, lse, mask=head_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(PartOut, PartLse, Out, stride_ot, stride_oh, num_heads, head_dim, num_splits,
                         SPLITS_P: tl.constexpr, D_P: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_P)
    d = tl.arange(0, D_P)
    base = (b * num_heads + h) * num_splits
    lse = tl.load(PartLse + base + s, mask=s < num_splits, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, 0))  # the first split is never empty: the maximum is finite
    part = tl.load(PartOut + (base + s)[:, None] * D_P + d[None, :],
                   mask=(s < num_splits)[:, None] & (d < head_dim)[None, :], other=0.0)  # lanes past D: unwritten
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(Out + b * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < head_dim)


def decode_splits(batch: int, num_kv_heads: int, max_tokens: int, programs: int) -> tuple[int, int]:
    """``(split_tokens, num_splits)`` for decode programs over contexts of up to ``max_tokens`` tokens: enough
    splits that ``batch × num_kv_heads × num_splits`` reaches ``programs`` (the GPU's width), none shorter than
    :data:`DECODE_TOKENS`."""
    max_tokens = max(1, max_tokens)
    wanted = max(1, -(-programs // max(1, batch * num_kv_heads)))
    per_split = -(-max_tokens // wanted)
    split_tokens = -(-per_split // DECODE_TOKENS) * DECODE_TOKENS
    return split_tokens, -(-max_tokens // split_tokens)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     seq_lens: torch.Tensor, out: torch.Tensor, scale: float, split_tokens: int,
                     num_splits: int) -> None:
    """``q`` ``[B, Hq, D]`` (one token per sequence) → ``out`` ``[B, Hq, D]``, reading K/V in place.

    ``tables`` int32 ``[B, W]``, ``seq_lens`` int32 ``[B]``; ``split_tokens × num_splits`` must cover every
    sequence (:func:`decode_splits`)."""
    batch, num_heads, dim = q.shape
    if batch == 0:
        return
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    d_p = _pow2(dim, 16)
    parts = lse = out  # unused when one split writes the output itself
    if num_splits > 1:
        parts = torch.empty((batch, num_heads, num_splits, d_p), dtype=torch.float32, device=q.device)
        lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    launch(_decode_kernel, (batch, num_kv_heads, num_splits), q, k_cache, v_cache, tables, seq_lens, out, parts, lse,
           q.stride(0), q.stride(1), out.stride(0), out.stride(1),
           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
           split_tokens, num_splits, scale, dim,
           GROUP=group, GROUP_P=_pow2(group, 16), D_P=d_p, BLOCK_SIZE=k_cache.shape[2], TOKENS=DECODE_TOKENS,
           SINGLE=num_splits == 1, PRECISION=_precision(k_cache.dtype))
    if num_splits > 1:
        launch(_merge_splits_kernel, (batch, num_heads), parts, lse, out, out.stride(0), out.stride(1), num_heads,
               dim, num_splits, SPLITS_P=_pow2(num_splits), D_P=d_p)


# ---------------------------------------------------------------------- prefill attention


@triton.jit(do_not_specialize=["stride_tb"])
def _prefill_kernel(Q, KCache, VCache, Tables, SeqLens, QueryStart, TileSeq, TileRow, Out,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_cb, stride_ch, stride_ct, stride_tb,
                    scale, head_dim,
                    GROUP: tl.constexpr, D_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(TileSeq + tile)
    first_row = tl.load(TileRow + tile)
    q_start = tl.load(QueryStart + seq)
    q_len = tl.load(QueryStart + seq + 1) - q_start
    seq_len = tl.load(SeqLens + seq)
    context = seq_len - q_len

    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    d = tl.arange(0, D_P)
    d_ok = d < head_dim
    q = tl.load(Q + (q_start + rows)[:, None].to(tl.int64) * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = context + rows  # padding rows see key 0 at least: no row is ever all -inf

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D_P], 0.0, tl.float32)
    cache_head = (head // GROUP).to(tl.int64) * stride_ch
    table = Tables + seq.to(tl.int64) * stride_tb
    end = tl.minimum(seq_len, context + first_row + BLOCK_M)
    for t0 in range(0, end, BLOCK_N):
        pos, ok, k, v = _kv_tile(KCache, VCache, table, t0, end, cache_head, d, d_ok, stride_cb, stride_ct,
                                 BLOCK_SIZE, BLOCK_N)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m, denom, acc = _online_softmax(s, v, m, denom, acc, PRECISION)

    out = acc / denom[:, None]
    tl.store(Out + (q_start + rows)[:, None].to(tl.int64) * stride_ot + head * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def prefill_tiles(query_lens: list[int], first_seq: int) -> tuple[list[int], list[int]]:
    """The (sequence, first query row) of every prefill tile of sequences ``first_seq..``."""
    seqs: list[int] = []
    rows: list[int] = []
    for i in range(first_seq, len(query_lens)):
        for row in range(0, query_lens[i], PREFILL_BLOCK_M):
            seqs.append(i)
            rows.append(row)
    return seqs, rows


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start: torch.Tensor, tile_seq: torch.Tensor,
                      tile_row: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """The rows of ``q`` (``[T, Hq, D]``) named by the tiles, attended over their sequences' cached context
    (this step's keys already stored), into the same rows of ``out``."""
    num_tiles = tile_seq.shape[0]
    if num_tiles == 0:
        return
    num_heads, dim = q.shape[1], q.shape[2]
    launch(_prefill_kernel, (num_tiles, num_heads), q, k_cache, v_cache, tables, seq_lens, query_start, tile_seq,
           tile_row, out, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0), scale, dim,
           GROUP=num_heads // k_cache.shape[1], D_P=_pow2(dim, 16), BLOCK_SIZE=k_cache.shape[2],
           BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N, PRECISION=_precision(k_cache.dtype))


# ---------------------------------------------------------------------- norms, rotary and SwiGLU


@triton.jit
def _rms_norm_kernel(X, Residual, Weight, Out, Summed, stride_x, stride_r, stride_o, stride_s, n, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(X + row * stride_x + i, mask=ok, other=0.0)
    if ADD:  # the sum is rounded to the input's dtype before it is normalised, as the reference does
        x = (x.to(tl.float32) + tl.load(Residual + row * stride_r + i, mask=ok, other=0.0).to(tl.float32))
        x = x.to(Summed.dtype.element_ty)
        tl.store(Summed + row * stride_s + i, x, mask=ok)
    h = x.to(tl.float32)
    normed = (h * tl.rsqrt(tl.sum(h * h, 0) / n + eps)).to(X.dtype.element_ty)
    w = tl.load(Weight + i, mask=ok, other=0.0)
    tl.store(Out + row * stride_o + i, (w.to(tl.float32) * normed.to(tl.float32)).to(Out.dtype.element_ty),
             mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return unit_stride(x.reshape(-1, x.shape[-1]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last axis in one pass; the reference's roundings (normalised in ``x``'s dtype, then
    scaled by ``weight``)."""
    flat = _rows(x)
    out = torch.empty(flat.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if flat.shape[0]:
        launch(_rms_norm_kernel, (flat.shape[0],), flat, flat, weight, out, out, flat.stride(0), flat.stride(0),
               out.stride(0), out.stride(0), flat.shape[1], eps, ADD=False, BLOCK=_pow2(flat.shape[1]))
    return out.view(*x.shape[:-1], x.shape[-1])


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass."""
    flat, res = _rows(x), _rows(residual)
    summed = torch.empty(flat.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(flat.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if flat.shape[0]:
        launch(_rms_norm_kernel, (flat.shape[0],), flat, res, weight, out, summed, flat.stride(0), res.stride(0),
               out.stride(0), summed.stride(0), flat.shape[1], eps, ADD=True, BLOCK=_pow2(flat.shape[1]))
    shape = (*x.shape[:-1], x.shape[-1])
    return out.view(shape), summed.view(shape)


@triton.jit
def _rotate_heads(X, Out, stride_xh, stride_oh, num_heads, half, cos1, cos2, sin1, sin2,
                  HEADS_P: tl.constexpr, HALF_P: tl.constexpr):
    """Rotate-half RoPE of one token's ``num_heads`` heads: ``x * cos + [-x2, x1] * sin``, each product and the
    sum rounded to ``X``'s dtype as the reference's element-wise ops round them (the cos/sin rows come rounded)."""
    h = tl.arange(0, HEADS_P)[:, None]
    i = tl.arange(0, HALF_P)[None, :]
    ok = (h < num_heads) & (i < half)
    x1 = tl.load(X + h * stride_xh + i, mask=ok, other=0.0)
    x2 = tl.load(X + h * stride_xh + half + i, mask=ok, other=0.0)
    dtype = X.dtype.element_ty
    first = ((x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    second = ((x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    tl.store(Out + h * stride_oh + i, first.to(Out.dtype.element_ty), mask=ok)
    tl.store(Out + h * stride_oh + half + i, second.to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _rotary_kernel(Positions, Q, K, CosSin, QOut, KOut,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_oqt, stride_oqh, stride_okt, stride_okh,
                   stride_cp, stride_cs, num_q_heads, num_k_heads, half,
                   QHEADS_P: tl.constexpr, KHEADS_P: tl.constexpr, HALF_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = CosSin + tl.load(Positions + t).to(tl.int64) * stride_cp
    i = tl.arange(0, HALF_P)[None, :]
    i_ok = i < half
    dtype = Q.dtype.element_ty  # the reference rounds the float32 table to the queries' dtype first
    cos1 = tl.load(row + i, mask=i_ok, other=0.0).to(dtype).to(tl.float32)
    cos2 = tl.load(row + half + i, mask=i_ok, other=0.0).to(dtype).to(tl.float32)
    sin1 = tl.load(row + stride_cs + i, mask=i_ok, other=0.0).to(dtype).to(tl.float32)
    sin2 = tl.load(row + stride_cs + half + i, mask=i_ok, other=0.0).to(dtype).to(tl.float32)
    _rotate_heads(Q + t * stride_qt, QOut + t * stride_oqt, stride_qh, stride_oqh, num_q_heads, half,
                  cos1, cos2, sin1, sin2, QHEADS_P, HALF_P)
    _rotate_heads(K + t * stride_kt, KOut + t * stride_okt, stride_kh, stride_okh, num_k_heads, half,
                  cos1, cos2, sin1, sin2, KHEADS_P, HALF_P)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]`` (any token and head strides, e.g. views
    of one QKV projection) by the ``[max_pos, 2, D]`` float32 table rows of ``positions``, in one kernel; returns
    new contiguous ``(q, k)``. Products are not fused into FMAs, so float32 results are the reference's too."""
    tokens, q_heads, dim = q.shape
    if cos_sin_cache.shape[-1] != dim or dim % 2:
        raise ValueError(f"rotary_embedding: a table of width {cos_sin_cache.shape[-1]} for heads of {dim}")
    q_out = torch.empty((tokens, q_heads, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens:
        q, k, table = unit_stride(q), unit_stride(k), unit_stride(cos_sin_cache)
        launch(_rotary_kernel, (tokens,), positions, q, k, table, q_out, k_out,
               q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
               k_out.stride(0), k_out.stride(1), table.stride(0), table.stride(1), q_heads, k.shape[1], dim // 2,
               QHEADS_P=_pow2(q_heads), KHEADS_P=_pow2(k.shape[1]), HALF_P=_pow2(dim // 2), enable_fp_fusion=False)
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    gate = tl.load(X + row * stride_x + i, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n + i, mask=ok, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty)  # rounded as torch's silu output is
    tl.store(Out + row * stride_o + i, (silu.to(tl.float32) * up.to(tl.float32)).to(Out.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate | up]`` along the last axis, in one pass."""
    flat = _rows(x)
    n = flat.shape[1] // 2
    out = torch.empty((flat.shape[0], n), dtype=x.dtype, device=x.device)
    if flat.shape[0]:
        block = min(1024, _pow2(n))
        launch(_silu_and_mul_kernel, (flat.shape[0], -(-n // block)), flat, out, flat.stride(0), out.stride(0), n,
               BLOCK=block)
    return out.view(*x.shape[:-1], n)
