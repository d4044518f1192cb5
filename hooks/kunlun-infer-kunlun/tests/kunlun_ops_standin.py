"""A stand-in for the vendor's ``kunlun_ops``, in torch, strict about how it is called.

Each function takes the arguments the way vLLM-Kunlun and sglang-kunlun pass
them to the real library (order, keywords, in-place outputs, cache layout,
int32 lengths as a host tensor and a device tensor) and refuses a call that
the real kernel could not have meant: a wrong dtype, a shape that does not fit
the others, a host copy that differs from its device copy, a length table that
is not int32. What it computes is plain torch attention and normalisation, so
a call that passes every check but swaps two same-shaped arguments still gives
a wrong answer, which the comparisons against the framework's references
catch.

Where the sources disagree or say nothing (what ``alpha`` of
``prefill_attention`` defaults to, whether ``speculative_attention`` takes its
``scale``), the stand-in follows the newest vLLM-Kunlun call; those points are
listed in the plugin README as unverified until a card runs them.

``install(monkeypatch)`` puts this module in ``sys.modules`` as
``kunlun_ops``; ``calls`` records every call by function name.
"""

from __future__ import annotations

import collections
import sys

import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
calls: collections.Counter[str] = collections.Counter()


class Rejected(RuntimeError):
    """The stand-in refused a call the real kernel would not accept."""


def install(monkeypatch) -> None:
    """Make ``import kunlun_ops`` return this module for the test."""
    calls.clear()
    monkeypatch.setitem(sys.modules, "kunlun_ops", sys.modules[__name__])


# --------------------------------------------------------------------------- checks


def _tensor(fn: str, name: str, value, *, dtype=None, ndim=None, contiguous=True) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise Rejected(f"{fn}: {name} must be a tensor, got {type(value).__name__}")
    if dtype is not None and value.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        raise Rejected(f"{fn}: {name} must be {dtype}, got {value.dtype}")
    if ndim is not None and value.dim() not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise Rejected(f"{fn}: {name} must have {ndim} dims, got shape {tuple(value.shape)}")
    if contiguous and not value.is_contiguous():
        raise Rejected(f"{fn}: {name} must be contiguous")
    return value


def _same(fn: str, name: str, value, like: torch.Tensor, shape=None) -> torch.Tensor:
    _tensor(fn, name, value, dtype=like.dtype)
    want = tuple(like.shape) if shape is None else tuple(shape)
    if tuple(value.shape) != want:
        raise Rejected(f"{fn}: {name} must have shape {want}, got {tuple(value.shape)}")
    return value


def _int(fn: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Rejected(f"{fn}: {name} must be an int, got {type(value).__name__}")
    return value


def _float(fn: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Rejected(f"{fn}: {name} must be a number, got {type(value).__name__}")
    return float(value)


def _host_device_pair(fn: str, name: str, host, dev, device: torch.device, length: int | None = None) -> list[int]:
    """An int32 host tensor and its int32 copy on ``device``, equal; returns the values."""
    _tensor(fn, f"{name}_cpu", host, dtype=torch.int32, ndim=1)
    _tensor(fn, f"{name}_xpu", dev, dtype=torch.int32, ndim=1)
    if host.device.type != "cpu":
        raise Rejected(f"{fn}: {name}_cpu must be a host tensor, got one on {host.device}")
    if dev.device != device:
        raise Rejected(f"{fn}: {name}_xpu must be on {device}, got {dev.device}")
    if length is not None and host.numel() != length:
        raise Rejected(f"{fn}: {name}_cpu must have {length} entries, got {host.numel()}")
    if not torch.equal(host, dev.cpu()):
        raise Rejected(f"{fn}: {name}_cpu {host.tolist()} and {name}_xpu {dev.tolist()} differ")
    return host.tolist()


def _lod(fn: str, name: str, host, dev, device: torch.device, total: int | None = None) -> list[int]:
    values = _host_device_pair(fn, name, host, dev, device)
    if not values or values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
        raise Rejected(f"{fn}: {name} must start at 0 and never decrease, got {values}")
    if total is not None and values[-1] != total:
        raise Rejected(f"{fn}: {name} ends at {values[-1]}, but there are {total} tokens")
    return values


def _cache(fn: str, name: str, cache, *, kv_heads: int, head_dim: int, dtype: torch.dtype,
           contiguous: bool = True) -> torch.Tensor:
    """A head-major block cache ``[num_blocks, kv_heads, block_size, head_dim]``."""
    _tensor(fn, name, cache, dtype=dtype, ndim=4, contiguous=contiguous)
    if cache.shape[1] != kv_heads or cache.shape[3] != head_dim:
        raise Rejected(f"{fn}: {name} must be [num_blocks, {kv_heads}, block_size, {head_dim}] (head-major blocks), "
                       f"got {tuple(cache.shape)}")
    return cache


def _block_table(fn: str, tables, device: torch.device, rows: int, num_blocks: int) -> torch.Tensor:
    _tensor(fn, "block_tables", tables, dtype=torch.int32, ndim=2)
    if tables.device != device or tables.shape[0] != rows:
        raise Rejected(f"{fn}: block_tables must be [{rows}, max_blocks] int32 on {device}, "
                       f"got {tuple(tables.shape)} on {tables.device}")
    if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= num_blocks):
        raise Rejected(f"{fn}: block_tables hold ids outside 0..{num_blocks - 1}")
    return tables


# --------------------------------------------------------------------------- math


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _gather(cache: torch.Tensor, blocks: list[int], length: int) -> torch.Tensor:
    """The first ``length`` tokens of a sequence from a head-major cache, as ``[length, kv_heads, head_dim]``."""
    rows = cache[torch.tensor(blocks, dtype=torch.long, device=cache.device)]  # [n, Hk, bs, D]
    return rows.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` ``[n, Hq, D]``, the last ``n`` positions of ``k``/``v`` ``[L, Hk, D]``."""
    n, length = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ kf.transpose(1, 2) * scale  # [Hq, n, L]
    q_pos = torch.arange(length - n, length, device=q.device).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(length, device=q.device).unsqueeze(0) > q_pos, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vf).transpose(0, 1)


# --------------------------------------------------------------------------- norms and activation


def rmsnorm(x, weight, output, eps, interweave=False, store_output_before_norm=True, bias=None,
            residual_output=None, output_max=None):
    calls["rmsnorm"] += 1
    _tensor("rmsnorm", "x", x, dtype=FLOATS, ndim=2)
    _tensor("rmsnorm", "weight", weight, dtype=(x.dtype, torch.float32), ndim=1)
    if weight.numel() != x.shape[-1]:
        raise Rejected(f"rmsnorm: weight has {weight.numel()} entries for rows of {x.shape[-1]}")
    _same("rmsnorm", "output", output, x)
    eps = _float("rmsnorm", "eps", eps)
    output.copy_(_norm(x, weight, eps))


def add_rmsnorm(x, y, weight, output, eps=1e-5, interweaved=False, store_output_before_norm=True, bias=None,
                smooth=None, residual_output=None, output_max=None):
    calls["add_rmsnorm"] += 1
    _tensor("add_rmsnorm", "x", x, dtype=FLOATS, ndim=2)
    _same("add_rmsnorm", "y", y, x)
    _tensor("add_rmsnorm", "weight", weight, dtype=(x.dtype, torch.float32), ndim=1)
    if weight.numel() != x.shape[-1]:
        raise Rejected(f"add_rmsnorm: weight has {weight.numel()} entries for rows of {x.shape[-1]}")
    _same("add_rmsnorm", "output", output, x)
    eps = _float("add_rmsnorm", "eps", eps)
    summed = x + y
    if residual_output is not None:
        _same("add_rmsnorm", "residual_output", residual_output, x)
        residual_output.copy_(summed)
    output.copy_(_norm(summed, weight, eps))


def swiglu(x, y):
    calls["swiglu"] += 1
    _tensor("swiglu", "x", x, dtype=FLOATS, ndim=(2, 3))
    if x.shape[-1] % 2:
        raise Rejected(f"swiglu: x's last dim ({x.shape[-1]}) must be even: gate and up halves")
    half = x.shape[-1] // 2
    _same("swiglu", "y", y, x, shape=(*x.shape[:-1], half))
    y.copy_(torch.nn.functional.silu(x[..., :half].float()).mul(x[..., half:].float()).to(x.dtype))


# --------------------------------------------------------------------------- rotary


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    if neox:
        a, b = x.chunk(2, dim=-1)
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    first, second = a * cos - b * sin, b * cos + a * sin
    if neox:
        return torch.cat((first, second), dim=-1)
    return torch.stack((first, second), dim=-1).flatten(-2)


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    calls["rotary_embedding"] += 1
    fn = "rotary_embedding"
    _tensor(fn, "positions", positions, dtype=torch.int64, ndim=1)
    tokens = positions.numel()
    head_size = _int(fn, "head_size", head_size)
    if not isinstance(is_neox, bool):
        raise Rejected(f"{fn}: is_neox must be a bool, got {type(is_neox).__name__}")
    for name, t in (("query", query), ("key", key)):
        _tensor(fn, name, t, dtype=FLOATS, ndim=(2, 3))
        if t.shape[0] != tokens or t.shape[-1] % head_size or (t.dim() == 3 and t.shape[-1] != head_size):
            raise Rejected(f"{fn}: {name} must be [{tokens}, heads * {head_size}], got {tuple(t.shape)}")
    if key.dtype != query.dtype:
        raise Rejected(f"{fn}: key is {key.dtype}, query {query.dtype}")
    _tensor(fn, "cos_sin_cache", cos_sin_cache, dtype=query.dtype, ndim=2)
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim > head_size:
        raise Rejected(f"{fn}: cos_sin_cache must be [max_position, rot_dim] with an even rot_dim <= {head_size}, "
                       f"got {tuple(cos_sin_cache.shape)}")
    if tokens and int(positions.max()) >= cos_sin_cache.shape[0]:
        raise Rejected(f"{fn}: a position is beyond the cache's {cos_sin_cache.shape[0]} rows")
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, rot_dim / 2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for t in (query, key):
        heads = t.view(tokens, -1, head_size)
        heads[..., :rot_dim] = _rotate(heads[..., :rot_dim], cos, sin, is_neox)


# --------------------------------------------------------------------------- paged cache and attention


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, BLHD_LAYOUT=False):  # noqa: N803
    calls["reshape_and_cache_flash"] += 1
    fn = "reshape_and_cache_flash"
    _tensor(fn, "key", key, dtype=FLOATS, ndim=3, contiguous=False)
    _tensor(fn, "value", value, dtype=key.dtype, ndim=3, contiguous=False)
    if value.shape != key.shape:
        raise Rejected(f"{fn}: value {tuple(value.shape)} and key {tuple(key.shape)} differ")
    tokens, kv_heads, head_dim = key.shape
    caches = []
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _tensor(fn, name, cache, dtype=key.dtype, ndim=4)
        # BLHD_LAYOUT=True: [num_blocks, block_size, kv_heads, head_dim], seen here through a head-major view
        caches.append(_cache(fn, name, cache.transpose(1, 2) if BLHD_LAYOUT else cache, kv_heads=kv_heads,
                             head_dim=head_dim, dtype=key.dtype, contiguous=False))
    _tensor(fn, "slot_mapping", slot_mapping, dtype=torch.int32, ndim=1)
    if slot_mapping.numel() != tokens:
        raise Rejected(f"{fn}: {slot_mapping.numel()} slots for {tokens} tokens")
    num_blocks, block_size = caches[0].shape[0], caches[0].shape[2]
    slots = slot_mapping.long()
    keep = slots >= 0
    if keep.any() and int(slots[keep].max()) >= num_blocks * block_size:
        raise Rejected(f"{fn}: a slot is beyond the cache's {num_blocks * block_size} slots")
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    for cache, new in zip(caches, (key, value)):
        cache[blocks, :, offsets] = new[keep]


def paged_attention(*, x, k_cache, v_cache, block_tables, context_lens_cpu, context_lens_xpu, is_context, is_causal,
                    out, vo_head_dim, alibi_slopes=None):
    calls["paged_attention"] += 1
    fn = "paged_attention"
    _tensor(fn, "x", x, dtype=FLOATS, ndim=3)
    batch, heads, head_dim = x.shape
    _same(fn, "out", out, x)
    kv_heads = k_cache.shape[1] if isinstance(k_cache, torch.Tensor) and k_cache.dim() == 4 else -1
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _cache(fn, name, cache, kv_heads=kv_heads, head_dim=head_dim, dtype=x.dtype)
    if heads % kv_heads:
        raise Rejected(f"{fn}: {heads} query heads are not a multiple of {kv_heads} kv heads")
    if is_context is not False or is_causal is not True:
        raise Rejected(f"{fn}: decode attention is is_context=False, is_causal=True")
    if _int(fn, "vo_head_dim", vo_head_dim) != head_dim:
        raise Rejected(f"{fn}: vo_head_dim {vo_head_dim} differs from the head size {head_dim}")
    lens = _host_device_pair(fn, "context_lens", context_lens_cpu, context_lens_xpu, x.device, batch)
    tables = _block_table(fn, block_tables, x.device, batch, k_cache.shape[0]).tolist()
    block_size = k_cache.shape[2]
    for b, length in enumerate(lens):
        blocks = tables[b][:-(-length // block_size)]
        out[b] = _attend(x[b:b + 1], _gather(k_cache, blocks, length), _gather(v_cache, blocks, length),
                         head_dim ** -0.5)[0].to(out.dtype)


def speculative_attention(*, out, q, k_cache, v_cache, context_lens_cpu, context_lens_xpu, batch_num, qlen,
                          max_context_len, head_num, head_dim, scale, kv_head_num, block_size,
                          max_num_blocks_per_seq, block_tables, max_window_size=-1, sink=None, qlod_cpu=None,
                          qlod_xpu=None):
    calls["speculative_attention"] += 1
    fn = "speculative_attention"
    batch, qlen = _int(fn, "batch_num", batch_num), _int(fn, "qlen", qlen)
    heads, head_dim = _int(fn, "head_num", head_num), _int(fn, "head_dim", head_dim)
    kv_heads, block_size = _int(fn, "kv_head_num", kv_head_num), _int(fn, "block_size", block_size)
    _tensor(fn, "q", q, dtype=FLOATS, ndim=4)
    if q.shape[-2:] != (heads, head_dim) or q.numel() != batch * qlen * heads * head_dim:
        raise Rejected(f"{fn}: q must hold [batch_num={batch}, qlen={qlen}, head_num={heads}, head_dim={head_dim}], "
                       f"got {tuple(q.shape)}")
    _tensor(fn, "out", out, dtype=q.dtype)
    if out.shape[-2:] != (heads, head_dim) or out.numel() != q.numel():
        raise Rejected(f"{fn}: out must hold q's {q.numel()} values as [..., {heads}, {head_dim}], "
                       f"got {tuple(out.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _cache(fn, name, cache, kv_heads=kv_heads, head_dim=head_dim, dtype=q.dtype)
    if k_cache.shape[2] != block_size:
        raise Rejected(f"{fn}: block_size {block_size} differs from the cache's {k_cache.shape[2]}")
    if heads % kv_heads:
        raise Rejected(f"{fn}: {heads} query heads are not a multiple of {kv_heads} kv heads")
    if _int(fn, "max_window_size", max_window_size) != -1 or sink is not None:
        raise Rejected(f"{fn}: the stand-in serves full attention only (max_window_size=-1, sink=None)")
    lens = _host_device_pair(fn, "context_lens", context_lens_cpu, context_lens_xpu, q.device, batch)
    tables = _block_table(fn, block_tables, q.device, batch, k_cache.shape[0])
    if _int(fn, "max_num_blocks_per_seq", max_num_blocks_per_seq) != tables.shape[1]:
        raise Rejected(f"{fn}: max_num_blocks_per_seq {max_num_blocks_per_seq} differs from block_tables' "
                       f"{tables.shape[1]} columns")
    if max(lens, default=0) > _int(fn, "max_context_len", max_context_len) or \
            max(lens, default=0) > tables.shape[1] * block_size:
        raise Rejected(f"{fn}: a context of {max(lens)} tokens exceeds max_context_len or the block tables")
    scale = _float(fn, "scale", scale) or head_dim ** -0.5
    queries, results = q.reshape(batch, qlen, heads, head_dim), out.view(batch, qlen, heads, head_dim)
    rows = tables.tolist()
    for b, length in enumerate(lens):
        if length < qlen:
            raise Rejected(f"{fn}: sequence {b} has {length} tokens of context for {qlen} queries")
        blocks = rows[b][:-(-length // block_size)]
        results[b] = _attend(queries[b], _gather(k_cache, blocks, length), _gather(v_cache, blocks, length),
                             scale).to(out.dtype)


def prefill_attention(*, q, k, v, out, is_causal, context_qlen_lod_cpu, context_qlen_lod_xpu, is_prefix_cache=False,
                      block_table=None, context_kvlen_lod_cpu=None, context_kvlen_lod_xpu=None, alpha=1.0,
                      alibi_slopes=None, softmax_lse=None, swa_left=-1, swa_right=-1, sink=None):
    calls["prefill_attention"] += 1
    fn = "prefill_attention"
    _tensor(fn, "q", q, dtype=FLOATS, ndim=3)
    tokens, heads, head_dim = q.shape
    _same(fn, "out", out, q)
    if is_causal is not True:
        raise Rejected(f"{fn}: the stand-in serves causal attention only")
    if alibi_slopes is not None or softmax_lse is not None or sink is not None or (swa_left, swa_right) != (-1, -1):
        raise Rejected(f"{fn}: the stand-in serves plain attention only (no alibi, lse, sink or window)")
    q_lod = _lod(fn, "context_qlen_lod", context_qlen_lod_cpu, context_qlen_lod_xpu, q.device, tokens)
    # the kernel scales scores by 1/sqrt(head_dim) itself and then by alpha
    scale = head_dim ** -0.5 * _float(fn, "alpha", alpha)
    if not is_prefix_cache:  # this step's own keys and values, laid out like q
        if block_table is not None:
            raise Rejected(f"{fn}: block_table is for is_prefix_cache=True")
        _tensor(fn, "k", k, dtype=q.dtype, ndim=3)
        if k.shape[0] != tokens or heads % k.shape[1] or k.shape[2] != head_dim:
            raise Rejected(f"{fn}: k must be [{tokens}, kv_heads, {head_dim}], got {tuple(k.shape)}")
        _same(fn, "v", v, k)
        for i in range(len(q_lod) - 1):
            a, b = q_lod[i], q_lod[i + 1]
            out[a:b] = _attend(q[a:b], k[a:b], v[a:b], scale).to(out.dtype)
        return
    calls["prefill_attention:prefix_cache"] += 1
    kv_heads = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else -1
    for name, cache in (("k", k), ("v", v)):
        _cache(fn, name, cache, kv_heads=kv_heads, head_dim=head_dim, dtype=q.dtype)
    if heads % kv_heads:
        raise Rejected(f"{fn}: {heads} query heads are not a multiple of {kv_heads} kv heads")
    if context_kvlen_lod_cpu is None or context_kvlen_lod_xpu is None:
        raise Rejected(f"{fn}: is_prefix_cache=True needs context_kvlen_lod_cpu and context_kvlen_lod_xpu")
    kv_lod = _lod(fn, "context_kvlen_lod", context_kvlen_lod_cpu, context_kvlen_lod_xpu, q.device)
    if len(kv_lod) != len(q_lod):
        raise Rejected(f"{fn}: {len(q_lod) - 1} query sequences but {len(kv_lod) - 1} key sequences")
    tables = _block_table(fn, block_table, q.device, len(q_lod) - 1, k.shape[0]).tolist()
    block_size = k.shape[2]
    for i in range(len(q_lod) - 1):
        a, b = q_lod[i], q_lod[i + 1]
        length = kv_lod[i + 1] - kv_lod[i]
        if length < b - a:
            raise Rejected(f"{fn}: sequence {i} has {length} keys for {b - a} queries")
        blocks = tables[i][:-(-length // block_size)]
        if len(blocks) * block_size < length:
            raise Rejected(f"{fn}: block_table row {i} covers fewer than its {length} keys")
        out[a:b] = _attend(q[a:b], _gather(k, blocks, length), _gather(v, blocks, length), scale).to(out.dtype)


# --------------------------------------------------------------------------- mixture of experts
#
# The routing kernels write int32 expert ids and float32 weights into caller-made outputs; the expert pipeline
# is gen_block_statistic -> moe_pre_sorted (token rows gathered in expert order) -> moe_fc (each expert's rows
# times its [out, in] weight, results kept in that order) -> swiglu -> moe_fc -> moe_post (each token's rows
# found through moe_index, scaled and summed), as vLLM-Kunlun and sglang-kunlun call it.

BLOCKS = 12  # rows of block_statistic: per-block expert counts over the tokens


def _route_outputs(fn: str, x, weights, ids) -> int:
    _tensor(fn, "x", x, dtype=torch.float32, ndim=2)
    _tensor(fn, "normed_score", weights, dtype=torch.float32, ndim=2)
    _tensor(fn, "topk_index", ids, dtype=torch.int32, ndim=2)
    if weights.shape[0] != x.shape[0] or ids.shape != weights.shape or weights.shape[1] > x.shape[1]:
        raise Rejected(f"{fn}: outputs must be [{x.shape[0]}, k <= {x.shape[1]}], got {tuple(weights.shape)} and "
                       f"{tuple(ids.shape)}")
    return weights.shape[1]


def _softmax_topk(fn: str, x, normed_score, topk_index, block_statistic, normalize: bool) -> None:
    calls[fn] += 1
    k = _route_outputs(fn, x, normed_score, topk_index)
    if block_statistic is not None:
        raise Rejected(f"{fn}: block_statistic is for the sigmoid kernel; pass None")
    top = torch.softmax(x, dim=-1).topk(k, dim=-1)
    values = top.values / top.values.sum(dim=-1, keepdim=True) if normalize else top.values
    normed_score.copy_(values)
    topk_index.copy_(top.indices.to(torch.int32))


def moe_softmax_topk(x, normed_score, topk_index, block_statistic=None):
    _softmax_topk("moe_softmax_topk", x, normed_score, topk_index, block_statistic, normalize=False)


def moe_softmax_topk_norm(x, normed_score, topk_index, block_statistic=None):
    _softmax_topk("moe_softmax_topk_norm", x, normed_score, topk_index, block_statistic, normalize=True)


def _block_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    rows = [part.reshape(-1).long() for part in ids.tensor_split(BLOCKS)]
    return torch.stack([torch.bincount(r, minlength=num_experts)[:num_experts] for r in rows]).to(torch.int32)


def gen_block_statistic(topk_ids, block_statistic):
    calls["gen_block_statistic"] += 1
    _tensor("gen_block_statistic", "topk_ids", topk_ids, dtype=torch.int32, ndim=2)
    _tensor("gen_block_statistic", "block_statistic", block_statistic, dtype=torch.int32, ndim=2)
    if block_statistic.shape[0] != BLOCKS:
        raise Rejected(f"gen_block_statistic: block_statistic must be [{BLOCKS}, experts], got "
                       f"{tuple(block_statistic.shape)}")
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= block_statistic.shape[1]):
        raise Rejected("gen_block_statistic: expert ids outside the experts of block_statistic")
    block_statistic.copy_(_block_counts(topk_ids, block_statistic.shape[1]))


def moe_pre_sorted(*, x, topk_index, block_statistic, moe_expand, moe_index, expert_m, sorted_tokens_num_lod,
                   index_have_neg=False):
    fn = "moe_pre_sorted"
    calls[fn] += 1
    _tensor(fn, "x", x, dtype=FLOATS, ndim=2)
    _tensor(fn, "topk_index", topk_index, dtype=torch.int32, ndim=2)
    tokens, k = topk_index.shape
    experts = expert_m.shape[0] if isinstance(expert_m, torch.Tensor) else 0
    _tensor(fn, "expert_m", expert_m, dtype=torch.int32, ndim=1)
    _tensor(fn, "sorted_tokens_num_lod", sorted_tokens_num_lod, dtype=torch.int32, ndim=1)
    _same(fn, "moe_expand", moe_expand, x, shape=(tokens * k, x.shape[1]))
    _tensor(fn, "moe_index", moe_index, dtype=torch.int32, ndim=1)
    if x.shape[0] != tokens or moe_index.numel() != tokens * k or sorted_tokens_num_lod.numel() != experts + 1:
        raise Rejected(f"{fn}: x {tuple(x.shape)}, topk_index {tuple(topk_index.shape)}, moe_index "
                       f"{tuple(moe_index.shape)}, lod {tuple(sorted_tokens_num_lod.shape)} for {experts} experts "
                       "do not fit together")
    if index_have_neg or (topk_index.numel() and int(topk_index.min()) < 0):
        raise Rejected(f"{fn}: negative expert ids are not what this call sorts")
    _tensor(fn, "block_statistic", block_statistic, dtype=torch.int32, ndim=2)
    if tuple(block_statistic.shape) != (BLOCKS, experts) or not torch.equal(block_statistic,
                                                                             _block_counts(topk_index, experts)):
        raise Rejected(f"{fn}: block_statistic does not hold gen_block_statistic's counts of these ids")
    flat = topk_index.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    moe_expand.copy_(x[order // k])
    moe_index.copy_(torch.argsort(order).to(torch.int32))  # (token, slot) -> its row in expert order
    counts = torch.bincount(flat, minlength=experts).to(torch.int32)
    expert_m.copy_(counts)
    sorted_tokens_num_lod.copy_(torch.cat([counts.new_zeros(1), counts.cumsum(0).to(torch.int32)]))


def moe_fc(*, x, weight, sorted_tokens_num_lod, sorted_tokens_idx, moe_topk, y, topk_ids, act=None,
           x_perchannel_max=None, w_perchannel_max=None):
    fn = "moe_fc"
    calls[fn] += 1
    _tensor(fn, "x", x, dtype=FLOATS, ndim=2)
    _tensor(fn, "weight", weight, dtype=x.dtype, ndim=3)
    _tensor(fn, "sorted_tokens_num_lod", sorted_tokens_num_lod, dtype=torch.int32, ndim=1)
    _tensor(fn, "sorted_tokens_idx", sorted_tokens_idx, dtype=torch.int32, ndim=1)
    _tensor(fn, "topk_ids", topk_ids, dtype=torch.int32, ndim=2)
    k = _int(fn, "moe_topk", moe_topk)
    experts, out_features, in_features = weight.shape
    if act is not None or x_perchannel_max is not None or w_perchannel_max is not None:
        raise Rejected(f"{fn}: only the unquantized call without a fused activation is modelled here")
    if x.shape[1] != in_features:
        raise Rejected(f"{fn}: rows of {x.shape[1]} features for a weight taking {in_features}")
    if k != topk_ids.shape[1] or x.shape[0] != topk_ids.shape[0] * k or sorted_tokens_idx.numel() != x.shape[0]:
        raise Rejected(f"{fn}: {x.shape[0]} rows do not match topk_ids {tuple(topk_ids.shape)} with moe_topk={k}")
    _same(fn, "y", y, x, shape=(topk_ids.shape[0], k, out_features))
    lod = sorted_tokens_num_lod.tolist()
    if len(lod) != experts + 1 or lod[0] != 0 or lod[-1] != x.shape[0] or any(b < a for a, b in zip(lod, lod[1:])):
        raise Rejected(f"{fn}: sorted_tokens_num_lod {lod} is not a lod of {x.shape[0]} rows over {experts} experts")
    rows = y.view(-1, out_features)
    for e in range(experts):
        if lod[e + 1] > lod[e]:
            rows[lod[e]:lod[e + 1]] = (x[lod[e]:lod[e + 1]].float() @ weight[e].float().T).to(y.dtype)


def moe_post(*, x, moe_index, normed_scale, dequant_scale, y):
    fn = "moe_post"
    calls[fn] += 1
    _tensor(fn, "x", x, dtype=FLOATS, ndim=3)
    tokens, k, hidden = x.shape
    _tensor(fn, "moe_index", moe_index, dtype=torch.int32, ndim=2)
    _tensor(fn, "normed_scale", normed_scale, dtype=torch.float32, ndim=2)
    _tensor(fn, "dequant_scale", dequant_scale, dtype=torch.float32, ndim=2)
    if not tuple(moe_index.shape) == tuple(normed_scale.shape) == tuple(dequant_scale.shape) == (tokens, k):
        raise Rejected(f"{fn}: moe_index, normed_scale and dequant_scale must be [{tokens}, {k}]")
    _same(fn, "y", y, x, shape=(tokens, hidden))
    rows = x.reshape(-1, hidden).float()[moe_index.reshape(-1).long()].view(tokens, k, hidden)
    y.copy_((rows * (normed_scale * dequant_scale).unsqueeze(-1)).sum(dim=1).to(y.dtype))
