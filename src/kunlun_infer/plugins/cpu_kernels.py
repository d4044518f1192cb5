"""The ``cpu`` op table: tuned host-CPU kernels; each op's plain-torch reference stays the definition.

Which native kernel set serves (AVX-512 with bf16 dot products, AVX2 + FMA,
or none) is decided once, by :func:`kunlun_infer.plugins.cpu_native.selection`.
Where the time of a CPU step goes, and what each kernel does about it:

- ``linear`` — the weights. A bfloat16 or float32 weight is packed once, at
  load, for the native GEMM of :mod:`kunlun_infer.plugins.cpu_gemm`, which
  streams it at close to memory speed for the few rows of a decode step and
  keeps the FMA units (or, with AMX, the tile unit) busy for a prefill.
  Without native kernels, or for a bf16 weight they do not take (odd
  in-features), oneDNN multiplies bf16 (``mkldnn._reorder_linear_weight``,
  then ``mkldnn._linear_pointwise``). Other dtypes keep the weight as it is
  and use ``F.linear``.
- ``int8_linear`` (``model.quantization=int8``) — int8 weights packed at load
  for the native int8 GEMM (the AMX tiles or VNNI dot products where the CPU
  has them, AVX2 byte multiply-adds elsewhere), activations quantized per row
  in the call.
- ``paged_attention`` — :mod:`kunlun_infer.plugins.cpu_attention`: decode
  reads K/V in place through the block tables, prompts run through SDPA.
- ``rms_norm``, ``add_rms_norm``, ``silu_and_mul``, ``rotary_embedding``,
  ``store_kv`` — one C call each (``native/elementwise.c``) instead of two
  to fifteen torch ops, with the reference's roundings; plain torch where
  the native library is missing or the layout does not fit.
- ``fused_moe`` (mixture-of-experts layers) — :mod:`kunlun_infer.plugins.cpu_moe`:
  the (token, expert) pairs sorted by expert once, then two GEMMs per expert
  that any token chose, on each expert's weights packed like ``linear``'s.
- ``apply_token_bitmask`` (structured output) — one masked store of
  ``-inf`` per 16 logits (8 on AVX2; ``native/token_bitmask.c``) instead of
  unpacking the bitmask into a boolean tensor 32 times its size.
- ``greedy_tokens`` (greedy decoding) — each row's argmax in one pass of
  vector compares over float32 logits, rows among the threads
  (``native/greedy_tokens.c``), where torch's reduction read them at
  ~10 GB/s: a few percent of a decode step of many rows.
- ``sample_tokens`` (sampled decoding) — each row on one thread, in a few
  passes over its logits and weights: the largest logit, the weights, where
  top-k or top-p asks a histogram of their count and mass by their float
  bits and the threshold found among the tokens of the one bin it crosses,
  then the kept weights' sums by blocks and the draw
  (``native/sample_tokens.c``); the torch passes it replaces took 2.7-5.7x
  as long over 8-128 Zipf-like rows, 12x with top-p over wide normal ones.

Every kernel is checked against :mod:`kunlun_infer.ops.reference` by the
conformance suite (``kunlun_infer.testing``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from kunlun_infer.ops import OP_SPECS, reference
from kunlun_infer.plugins import cpu_gemm, cpu_memory, cpu_moe, cpu_native
from kunlun_infer.plugins.cpu_attention import paged_attention

#: attribute set on a weight this module reordered for oneDNN
_ONEDNN_PACKED = "_kunlun_onednn_packed"
#: batch size oneDNN is told to expect when it chooses the blocked layout (1 streams best, larger is no faster)
_PACK_BATCH_HINT = 1
_NATIVE_DTYPES = (torch.bfloat16, torch.float32)


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


def _native(*tensors: torch.Tensor) -> Any:
    """The native library when every tensor is a contiguous host tensor of one dtype it handles, else None."""
    lib = cpu_native.library()
    dtype = tensors[0].dtype
    if lib is None or dtype not in _NATIVE_DTYPES:
        return None
    if all(t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return lib
    return None


# ---------------------------------------------------------------------- linear

def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """An ``[out, in]`` weight packed for the native GEMM where it takes it, a bf16 one else for oneDNN;
    others unchanged."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return weight
    if cpu_gemm.can_pack(weight):
        return cpu_gemm.pack(weight)
    if weight.dtype is not torch.bfloat16 or not onednn_linear_available():
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


def pack_int8_linear_weight(qweight: torch.Tensor, scale: torch.Tensor) -> Any:
    """An int8 weight and its scales packed for the native int8 GEMM; the reference's pair without it."""
    if cpu_gemm.int8_available() and qweight.device.type == "cpu" and qweight.dim() == 2 and qweight.shape[1] > 0:
        return cpu_gemm.pack_int8(qweight, scale)
    return reference.pack_int8_linear_weight(qweight, scale)


def int8_linear(x: torch.Tensor, packed: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.reference.int8_linear`` by whichever kernel :func:`pack_int8_linear_weight` packed for."""
    if cpu_gemm.is_packed_int8(packed):
        if x.dtype in _NATIVE_DTYPES:
            return cpu_gemm.linear_int8(x, packed, bias)
        # other float dtypes widen exactly to float32, and the float32 result rounds as the reference's does
        return cpu_gemm.linear_int8(x.to(torch.float32), packed, bias).to(x.dtype)
    return reference.int8_linear(x, packed, bias)


# ---------------------------------------------------------------------- mixture of experts

def pack_moe_weights(w13: torch.Tensor, w2: torch.Tensor) -> Any:
    """Each expert's weights packed as ``pack_linear_weight`` packs a weight; the reference's pair off the host."""
    if w13.device.type != "cpu" or w2.device.type != "cpu":
        return reference.pack_moe_weights(w13, w2)
    return cpu_moe.pack_moe_weights(w13, w2, pack_linear_weight)


def fused_moe(x: torch.Tensor, packed: Any, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``ops.reference.fused_moe`` by :mod:`kunlun_infer.plugins.cpu_moe` (tokens grouped by expert)."""
    return cpu_moe.fused_moe(x, packed, topk_weights, topk_ids, linear=linear, silu_and_mul=silu_and_mul)


# ---------------------------------------------------------------------- norms, activation, rotary

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)``, normalised in float32 like the reference."""
    lib = _native(x, weight)
    if lib is None or weight.shape != x.shape[-1:]:
        return reference.rms_norm(x, weight, eps)
    out = torch.empty_like(x)
    lib.kunlun_rms_norm(x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), None, x.numel() // x.shape[-1],
                        x.shape[-1], eps, x.dtype is torch.bfloat16)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual' = x + residual``; returns ``(rms_norm(residual'), residual')``."""
    lib = _native(x, residual, weight)
    if lib is None or weight.shape != x.shape[-1:] or residual.shape != x.shape:
        return reference.add_rms_norm(x, residual, weight, eps)
    out, summed = torch.empty_like(x), torch.empty_like(x)
    lib.kunlun_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), summed.data_ptr(),
                        x.numel() // x.shape[-1], x.shape[-1], eps, x.dtype is torch.bfloat16)
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` (SwiGLU) in one pass."""
    lib = _native(x)
    if lib is None or x.shape[-1] % 2:
        return reference.silu_and_mul(x)
    n = x.shape[-1] // 2
    out = cpu_memory.host_empty((*x.shape[:-1], n), x.dtype)
    lib.kunlun_silu_and_mul(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], n, x.dtype is torch.bfloat16)
    return out


def _token_stride(t: torch.Tensor) -> int | None:
    """Elements between tokens of a ``[T, H, D]`` tensor whose heads are contiguous, else ``None``."""
    if t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t.stride(0)
    return None


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of ``q`` and ``k`` in one pass; same contract as the reference."""
    lib = cpu_native.library()
    q_stride, k_stride = _token_stride(q), _token_stride(k)
    if (lib is None or q.dtype not in _NATIVE_DTYPES or k.dtype != q.dtype or q_stride is None or k_stride is None
            or q.device.type != "cpu" or k.device.type != "cpu" or q.shape[-1] % 2 or q.shape[-1] != k.shape[-1]
            or cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous()
            or cos_sin_cache.shape[1:] != (2, q.shape[-1]) or positions.dtype != torch.int64
            or not positions.is_contiguous() or not q.shape[0] == k.shape[0] == positions.numel()):
        return reference.rotary_embedding(positions, q, k, cos_sin_cache)
    q_out = torch.empty(q.shape, dtype=q.dtype)
    k_out = torch.empty(k.shape, dtype=k.dtype)
    status = lib.kunlun_rotary(positions.data_ptr(), q.data_ptr(), q_stride, k.data_ptr(), k_stride,
                               cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], q_out.data_ptr(), k_out.data_ptr(),
                               q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.dtype is torch.bfloat16)
    if status != 0:  # a position outside the table: the reference raises the error a user should see
        return reference.rotary_embedding(positions, q, k, cos_sin_cache)
    return q_out, k_out


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """The step's keys and values into their cache slots in one C call (the reference takes a mask, a
    host sync and two index copies per layer); same contract as the reference."""
    lib = cpu_native.library()
    k_stride, v_stride = _token_stride(key), _token_stride(value)
    if (lib is None or k_stride is None or v_stride is None or key.dtype != k_cache.dtype
            or value.dtype != key.dtype or v_cache.dtype != key.dtype or key.shape != value.shape
            or k_cache.shape != v_cache.shape or key.shape[1:] != k_cache.shape[2:]
            or any(t.device.type != "cpu" for t in (key, value, k_cache, v_cache, slot_mapping))
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or slot_mapping.dtype != torch.int64
            or not slot_mapping.is_contiguous() or slot_mapping.numel() != key.shape[0]):
        return reference.store_kv(key, value, k_cache, v_cache, slot_mapping)
    size, slots = key.element_size(), k_cache.shape[0] * k_cache.shape[1]
    status = lib.kunlun_store_kv(key.data_ptr(), k_stride * size, value.data_ptr(), v_stride * size,
                                 k_cache.data_ptr(), v_cache.data_ptr(), slots, slot_mapping.data_ptr(), key.shape[0],
                                 key.shape[1] * key.shape[2] * size)
    if status != 0:
        raise IndexError(f"store_kv: slot {int(slot_mapping.max())} is past the KV caches' {slots} slots "
                         f"(nothing was stored)")
    return None


# ---------------------------------------------------------------------- structured output

def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Forbidden tokens' logits to ``-inf`` in place; same contract as the reference."""
    lib = cpu_native.library()
    if (lib is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2
            or logits.stride(1) != 1 or bitmask.dtype != torch.int32 or bitmask.device.type != "cpu"
            or not bitmask.is_contiguous() or bitmask.dim() != 2 or rows.dtype != torch.int64
            or rows.device.type != "cpu" or not rows.is_contiguous() or rows.numel() != bitmask.shape[0]
            or bitmask.shape[1] * 32 < logits.shape[1]
            or (rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < logits.shape[0])):
        return reference.apply_token_bitmask(logits, bitmask, rows)
    lib.kunlun_apply_token_bitmask(logits.data_ptr(), logits.stride(0), logits.shape[1], bitmask.data_ptr(),
                                   bitmask.shape[1], rows.data_ptr(), rows.numel())
    return None


# ---------------------------------------------------------------------- sampling

def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, one pass over float32 rows; same contract as the reference."""
    lib = cpu_native.library()
    if (lib is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2
            or logits.stride(1) != 1 or not 0 < logits.shape[1] < 2**31 - 64):
        return reference.greedy_tokens(logits)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.kunlun_greedy_tokens(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr())
    return out


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's token, drawn in a few passes over its float32 logits (``native/sample_tokens.c``); same
    contract as the reference."""
    lib = cpu_native.library()
    rows = logits.shape[0] if logits.dim() == 2 else -1
    row_args = (temperature, top_k, top_p, min_p)
    if (lib is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or rows < 0
            or logits.stride(1) != 1 or not 0 < logits.shape[1] < 2**31 - 64
            or any(a.device.type != "cpu" or not a.is_contiguous() or a.shape != (rows,) for a in row_args)
            or (temperature.dtype, top_k.dtype, top_p.dtype, min_p.dtype)
            != (torch.float32, torch.int64, torch.float32, torch.float32)
            or uniforms.dtype != torch.float32 or uniforms.device.type != "cpu" or not uniforms.is_contiguous()
            or uniforms.shape != (rows, 2)):
        return reference.sample_tokens(logits, temperature, top_k, top_p, min_p, uniforms)
    out = torch.empty(rows, dtype=torch.int64)
    if lib.kunlun_sample_tokens(logits.data_ptr(), logits.stride(0), rows, logits.shape[1], temperature.data_ptr(),
                                top_k.data_ptr(), top_p.data_ptr(), min_p.data_ptr(), uniforms.data_ptr(),
                                reference.EXP_FLOOR, reference.DRAW_BLOCK, out.data_ptr()):
        raise MemoryError(f"sample_tokens: no memory for the scratch of {rows} rows of {logits.shape[1]} weights")
    return out


def kernels() -> dict[str, Any]:
    """The ``cpu`` op table: the tuned kernels above, the references for the rest."""
    table = {name: spec.reference for name, spec in OP_SPECS.items()}
    table.update(rms_norm=rms_norm, add_rms_norm=add_rms_norm, silu_and_mul=silu_and_mul,
                 rotary_embedding=rotary_embedding, store_kv=store_kv, paged_attention=paged_attention,
                 pack_linear_weight=pack_linear_weight, linear=linear, apply_token_bitmask=apply_token_bitmask,
                 greedy_tokens=greedy_tokens, sample_tokens=sample_tokens,
                 pack_int8_linear_weight=pack_int8_linear_weight, int8_linear=int8_linear,
                 pack_moe_weights=pack_moe_weights, fused_moe=fused_moe)
    return table
