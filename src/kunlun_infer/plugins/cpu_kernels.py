"""Tuned host-CPU kernels for the ``cpu`` ops option; each op's plain-torch reference stays the definition.

Where the time of a CPU step goes, and what each kernel does about it:

- ``linear`` — the weights. A bfloat16 weight is packed once, at load, for
  the AVX512-BF16 GEMM of :mod:`kunlun_infer.plugins.cpu_gemm`, which streams
  it at close to memory speed for the few rows of a decode step; where that
  kernel is not available, for oneDNN (``mkldnn._reorder_linear_weight``,
  then ``mkldnn._linear_pointwise``), still markedly faster than ``F.linear``
  on bf16. Other dtypes keep the weight as it is and use ``F.linear``.
- ``paged_attention`` — decode tokens of the whole batch go to the C kernel
  of ``native/paged_decode_attention.c``, which reads each cached key and
  value once, in place, through the block tables (no gathered copy), for
  all query heads sharing a KV head, in float32. Without it they run as one
  SDPA over their block-gathered K/V (``index_select`` of the blocks in use)
  in the cache's dtype (the CPU SDPA kernel accumulates low precision in
  float32 itself), with the ``Hq / Hk`` query heads of a KV head folded into
  the query-length axis so K/V are never repeated per query head. Prompts
  run one SDPA each: plain causal without a cached prefix, bottom-right
  causal mask with one.
- ``rms_norm`` / ``add_rms_norm`` — torch's fused ``rms_norm`` on the float32
  upcast, rounded and scaled like the reference.

Every kernel is checked against :mod:`kunlun_infer.ops.reference` by the
conformance suite (``kunlun_infer.testing``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from kunlun_infer.ops import OP_SPECS
from kunlun_infer.plugins import cpu_gemm, cpu_native

#: attribute set on a weight this module reordered for oneDNN
_ONEDNN_PACKED = "_kunlun_onednn_packed"
#: batch size oneDNN is told to expect when it chooses the blocked layout (1 streams best, larger is no faster)
_PACK_BATCH_HINT = 1


@functools.cache
def onednn_linear_available() -> bool:
    """True when this torch build has the oneDNN prepacked-linear ops and runs them in bf16 here."""
    try:
        w = torch.ones(8, 16, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=torch.bfloat16), packed, None, "none",
                                                 [], "")
        return bool(torch.all(out == 16))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


# ---------------------------------------------------------------------- linear

def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 ``[out, in]`` weight packed for the bf16 GEMM kernel, else for oneDNN; others unchanged."""
    if weight.dtype is not torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return weight
    if cpu_gemm.can_pack(weight):
        return cpu_gemm.pack(weight)
    if not onednn_linear_available():
        return weight
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_BATCH_HINT)
    setattr(packed, _ONEDNN_PACKED, True)
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, by whichever kernel :func:`pack_linear_weight` packed the weight for."""
    if cpu_gemm.is_packed(weight):
        return cpu_gemm.linear(x, weight, bias)
    if getattr(weight, _ONEDNN_PACKED, False):
        return torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


# ---------------------------------------------------------------------- norms

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference's numerics (normalise in float32, round, then scale) with a fused normalisation."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual' = x + residual``; returns ``(rms_norm(residual'), residual')``."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


# ---------------------------------------------------------------------- paged attention

def _gather(cache: torch.Tensor, block_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """Blocks ``block_ids`` (``[rows, n]``) of a ``[blocks, bs, Hk, D]`` cache as ``[rows, Hk, n*bs, D]``."""
    blocks = cache.index_select(0, block_ids.reshape(-1))
    return blocks.view(rows, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)


def native_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Decode attention by ``native/paged_decode_attention.c``, reading K/V in place through the block
    tables; ``None`` when that kernel does not apply (library, dtype or head size)."""
    dtype = k_cache.dtype
    lib = cpu_native.library()
    if (lib is None or dtype not in (torch.bfloat16, torch.float32) or v_cache.dtype != dtype
            or q.shape[-1] % 16 or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return None
    batch, num_q_heads, head_dim = q.shape
    query = q.to(dtype).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    status = lib.kunlun_paged_decode_attention(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), out.data_ptr(), batch, num_q_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        scale, dtype is torch.bfloat16)
    if status != 0:
        raise MemoryError(f"paged decode attention could not allocate its scratch for {batch} sequences")
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """One query token per sequence: ``q`` ``[B, Hq, D]`` → ``[B, Hq, D]``, without copying K/V where the
    native kernel applies, else one SDPA for the batch over block-gathered K/V."""
    native = native_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    if native is not None:
        return native
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_blocks = -(-max_len // block_size)
    # entries past a sequence's own blocks may hold anything: clamp them into range, the mask hides them
    ids = block_tables[:, :num_blocks].long().clamp_(0, k_cache.shape[0] - 1)
    k = _gather(k_cache, ids, batch)
    v = _gather(v_cache, ids, batch)
    width = num_blocks * block_size
    mask = (torch.arange(width, device=q.device).unsqueeze(0) < seq_lens.unsqueeze(1))[:, None, None, :]
    grouped = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim).to(k.dtype)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_q_heads, head_dim)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                      ctx: int, scale: float) -> torch.Tensor:
    """The new tokens ``q`` ``[Lq, Hq, D]`` of one sequence with ``ctx`` tokens of context."""
    block_size = k_cache.shape[1]
    ids = table[: -(-ctx // block_size)].long().unsqueeze(0)
    k = _gather(k_cache, ids, 1)[:, :, :ctx]
    v = _gather(v_cache, ids, 1)[:, :, :ctx]
    q_len = q.shape[0]
    query = q.transpose(0, 1).unsqueeze(0).to(k.dtype)  # [1, Hq, Lq, D]
    gqa = q.shape[1] != k.shape[1]
    if q_len == ctx:  # no cached prefix: plain causal
        out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device).unsqueeze(1)
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= q_pos  # bottom-right causal
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention over paged K/V; same contract as the reference ``paged_attention``."""
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    num_seqs = len(lens)
    q_lens = [qsl[i + 1] - qsl[i] for i in range(num_seqs)]
    if all(n == 1 for n in q_lens):  # decode only: one query per sequence, rows in sequence order
        return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max(lens), scale).to(q.dtype)
    out = torch.empty_like(q)
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        rows = torch.tensor([qsl[i] for i in decode], device=q.device)
        idx = torch.tensor(decode, device=q.device)
        out[rows] = decode_attention(q.index_select(0, rows), k_cache, v_cache, block_tables.index_select(0, idx),
                                     seq_lens.index_select(0, idx), max(lens[i] for i in decode),
                                     scale).to(q.dtype)
    for i, n in enumerate(q_lens):
        start, end = qsl[i], qsl[i + 1]
        if n > 1:
            out[start:end] = prefill_attention(q[start:end], k_cache, v_cache, block_tables[i], lens[i],
                                               scale).to(q.dtype)
    return out


def kernels() -> dict[str, Any]:
    """The ``cpu`` op table: the tuned kernels above, the references for the rest."""
    table = {name: spec.reference for name, spec in OP_SPECS.items()}
    table.update(rms_norm=rms_norm, add_rms_norm=add_rms_norm, paged_attention=paged_attention,
                 pack_linear_weight=pack_linear_weight, linear=linear)
    return table
