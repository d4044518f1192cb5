"""The Kunlun attention backend: ``kunlun_ops``' paged cache layout and its split decode / prefill kernels.

Cache: one tensor per layer, ``(2, num_blocks, kv_heads, block_size,
head_dim)`` — keys then values, head-major inside a block — of which
``cache[0]`` and ``cache[1]`` are the key and value caches the kernels take.

Batch: decodes first (:func:`~kunlun_infer.ops.attention_step.decodes_first`),
then the prefills and chunked prefills, as vLLM-Kunlun orders it. The
metadata of a step splits there: the leading one-token sequences go to the
decode kernel, the rest to ``prefill_attention``. Lengths are int32, each as
a host tensor and its device copy (the kernels read both); the prefill
lengths are cumulative (``lod``) and start at 0 for the prefill part.

Calls (see the plugin README for the sources):

- store: ``reshape_and_cache_flash(key, value, key_cache, value_cache,
  slots, BLHD_LAYOUT=False)`` with int32 slots;
- decode: ``speculative_attention(...)`` with ``qlen=1`` and the scale, or,
  without it (or with one that has no ``max_window_size``: an older library,
  as vLLM-Kunlun tells them apart), ``paged_attention(...)``, which always
  scales by ``1/sqrt(head_dim)`` and so serves only that scale;
- prefill: ``prefill_attention(...)`` on the step's own keys and values when
  no prefill of the step has cached context, and in prefix-cache mode on the
  cache (``is_prefix_cache=True``, block tables and key lods) when one has.
  The kernel scales scores by ``1/sqrt(head_dim)`` itself and then by
  ``alpha``; ``alpha`` is passed only when the scale differs.

Each call falls back on its own to a torch path on the same layout when its
function is missing (said once, when the backend is built).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from collections.abc import Sequence

import torch

from kunlun_infer.ops.attention import MHA, AttentionBackend, AttentionSpec, CacheTensorSpec
from kunlun_infer.ops.attention_step import AttentionStep, decodes_first
from kunlun_infer_cuda.ops import paged_attention as torch_paged_attention
from kunlun_infer_kunlun.vendor import MODULE_NAME, VendorKernels

log = logging.getLogger("kunlun_infer.plugin.kunlun")

#: head sizes the vendor's paged-attention kernels serve (vLLM-Kunlun's ``PagedAttention.get_supported_head_sizes``)
SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 120, 128, 192, 256, 512)
#: the library functions the backend can call, by role; the first present of each role is used
STORE = ("reshape_and_cache_flash",)
DECODE = ("speculative_attention", "paged_attention")
PREFILL = ("prefill_attention",)


@dataclasses.dataclass(frozen=True)
class HostDevice:
    """An int32 tensor on the host and its copy on the device."""

    host: torch.Tensor
    device: torch.Tensor

    @classmethod
    def of(cls, values: Sequence[int], step: AttentionStep) -> HostDevice:
        host = step.tensor(values, torch.int32, on_device=False)
        return cls(host, host.to(step.device))


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """The leading one-token sequences: one query each over its whole context."""

    num_seqs: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 on the device
    context_lens: HostDevice  # tokens of each sequence including the new one
    max_context_len: int


@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    """The other sequences: several queries each (or one, for a batch not ordered decodes first)."""

    first_token: int  # its rows of the flat batch start here
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 on the device
    query_lod: HostDevice  # [num_seqs + 1]: cumulative new tokens, from 0
    kv_lod: HostDevice  # [num_seqs + 1]: cumulative tokens including the cached ones, from 0
    #: True when a sequence has cached context: the kernel then reads keys from the cache
    prefix_cache: bool
    seq_lens: torch.Tensor  # [num_seqs] int32 on the device (for the torch path)


@dataclasses.dataclass(frozen=True)
class KunlunStep:
    """One step's metadata, built once and read by every layer."""

    slot_mapping: torch.Tensor  # [tokens] int32 on the device
    decode: DecodeBatch | None
    prefill: PrefillBatch | None


def _tables(step: AttentionStep, rows: range) -> torch.Tensor:
    width = max(len(step.block_tables[i]) for i in rows)
    return step.tensor([list(step.block_tables[i]) + [0] * (width - len(step.block_tables[i])) for i in rows])


def _cumulative(values: Sequence[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def build_step(step: AttentionStep) -> KunlunStep:
    """Split ``step`` at its leading decodes and make the int32 host and device tensors of each part."""
    num_decodes = step.num_leading_decodes
    decode = prefill = None
    if num_decodes:
        rows = range(num_decodes)
        tables = _tables(step, rows)
        decode = DecodeBatch(num_decodes, tables, HostDevice.of(step.seq_lens[:num_decodes], step),
                             max_context_len=tables.shape[1] * step.block_size)
    if num_decodes < step.num_seqs:
        rows = range(num_decodes, step.num_seqs)
        seq_lens = step.seq_lens[num_decodes:]
        prefill = PrefillBatch(
            first_token=step.query_start_loc[num_decodes], block_tables=_tables(step, rows),
            query_lod=HostDevice.of(_cumulative(step.query_lens[num_decodes:]), step),
            kv_lod=HostDevice.of(_cumulative(seq_lens), step),
            prefix_cache=any(step.context_lens[i] for i in rows), seq_lens=step.tensor(seq_lens))
    return KunlunStep(step.tensor(step.slot_mapping), decode, prefill)


class KunlunAttention(AttentionBackend):
    """``kunlun_ops``' head-major paged cache, decodes first, ``reshape_and_cache_flash`` + split attention kernels."""

    name = "kunlun"

    def __init__(self, spec: AttentionSpec, vendor: VendorKernels) -> None:
        self.spec = spec
        self.vendor = vendor
        self.store_fn = next((f for f in STORE if vendor.has(f)), None)
        self.decode_fn = next((f for f in DECODE if vendor.has(f) and self._serves_decode(f)), None)
        self.prefill_fn = next((f for f in PREFILL if vendor.has(f)), None)
        self._warned_scale = False
        self.calls = {"store": self.store_fn, "decode": self.decode_fn, "prefill": self.prefill_fn}
        self.name = "kunlun (" + ", ".join(f"{role}: {MODULE_NAME}.{fn}" if fn else f"{role}: torch"
                                           for role, fn in self.calls.items()) + ")"
        torch_roles = [role for role, fn in self.calls.items() if fn is None]
        if torch_roles:
            log.warning("ops=kunlun: %s %s lacks the kernel for %s; those calls run on the torch path "
                        "(attention backend %s)", MODULE_NAME, vendor.version or "(version unknown)",
                        ", ".join(torch_roles), self.name)
        else:
            log.info("ops=kunlun: attention backend %s", self.name)

    def _serves_decode(self, function: str) -> bool:
        """False for an older library's ``speculative_attention`` (no ``max_window_size``): use paged_attention."""
        if function != "speculative_attention":
            return True
        try:
            return "max_window_size" in inspect.signature(self.vendor.get(function)).parameters
        except (TypeError, ValueError):  # a compiled function may carry no signature: assume the current one
            return True

    # ------------------------------------------------------------------ layout and metadata

    def kv_cache_tensors(self, num_blocks: int, block_size: int) -> Sequence[CacheTensorSpec]:
        s = self.spec
        return (CacheTensorSpec((2, num_blocks, s.num_kv_heads, block_size, s.head_dim), s.dtype, "kv"),)

    def order_batch(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> Sequence[int] | None:
        return decodes_first(query_lens, context_lens)

    def build_metadata(self, step: AttentionStep) -> KunlunStep:
        return build_step(step)

    # ------------------------------------------------------------------ store

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                 metadata: KunlunStep) -> None:
        (cache,) = kv_cache
        key, value = key.contiguous(), value.contiguous()
        if self.store_fn is None:
            _torch_store(key, value, cache, metadata.slot_mapping)
            return
        self.vendor.get(self.store_fn)(key, value, cache[0], cache[1], metadata.slot_mapping, BLHD_LAYOUT=False)

    # ------------------------------------------------------------------ attend

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: tuple[torch.Tensor, ...], metadata: KunlunStep, *, scale: float) -> torch.Tensor:
        (cache,) = kv_cache
        query = query.contiguous()
        out = torch.empty_like(query)
        if metadata.decode is not None:
            rows = slice(0, metadata.decode.num_seqs)
            self._decode(query[rows], out[rows], cache, metadata.decode, scale)
        if metadata.prefill is not None:
            rows = slice(metadata.prefill.first_token, query.shape[0])
            self._prefill(query[rows], key[rows].contiguous(), value[rows].contiguous(), out[rows], cache,
                          metadata.prefill, scale)
        return out

    def _decode(self, q: torch.Tensor, out: torch.Tensor, cache: torch.Tensor, batch: DecodeBatch,
                scale: float) -> None:
        fn = self.decode_fn
        if fn == "paged_attention" and not math.isclose(scale, self.spec.head_dim ** -0.5, rel_tol=1e-6):
            fn = None  # the kernel always scales by 1/sqrt(head_dim)
            if not self._warned_scale:
                self._warned_scale = True
                log.warning("ops=kunlun: %s.paged_attention scales by 1/sqrt(head_dim) only; decodes with scale "
                            "%g run on the torch path", MODULE_NAME, scale)
        if fn is None:
            lens = batch.context_lens.device
            starts = torch.arange(batch.num_seqs + 1, dtype=torch.int32, device=q.device)
            out.copy_(torch_paged_attention(q, cache[0].transpose(1, 2), cache[1].transpose(1, 2),
                                            batch.block_tables, lens, starts, scale))
            return
        kernel, s = self.vendor.get(fn), self.spec
        if fn == "paged_attention":
            kernel(x=q, k_cache=cache[0], v_cache=cache[1], block_tables=batch.block_tables,
                   context_lens_cpu=batch.context_lens.host, context_lens_xpu=batch.context_lens.device,
                   is_context=False, is_causal=True, out=out, vo_head_dim=s.head_dim)
            return
        shape = (batch.num_seqs, 1, s.num_heads, s.head_dim)  # [batch, qlen, heads, head_dim]
        kernel(out=out.view(shape), q=q.view(shape), k_cache=cache[0], v_cache=cache[1],
               context_lens_cpu=batch.context_lens.host, context_lens_xpu=batch.context_lens.device,
               batch_num=batch.num_seqs, qlen=1, max_context_len=batch.max_context_len, head_num=s.num_heads,
               head_dim=s.head_dim, scale=float(scale), kv_head_num=s.num_kv_heads, block_size=cache.shape[3],
               max_num_blocks_per_seq=batch.block_tables.shape[1], max_window_size=-1,
               block_tables=batch.block_tables)

    def _prefill(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                 cache: torch.Tensor, batch: PrefillBatch, scale: float) -> None:
        if self.prefill_fn is None:
            out.copy_(torch_paged_attention(q, cache[0].transpose(1, 2), cache[1].transpose(1, 2),
                                            batch.block_tables, batch.seq_lens, batch.query_lod.device, scale))
            return
        kernel = self.vendor.get(self.prefill_fn)
        extra = {}
        alpha = scale * math.sqrt(self.spec.head_dim)  # the kernel applies 1/sqrt(head_dim) itself
        if not math.isclose(alpha, 1.0, rel_tol=1e-6):
            extra["alpha"] = alpha
        lods = dict(context_qlen_lod_cpu=batch.query_lod.host, context_qlen_lod_xpu=batch.query_lod.device)
        if batch.prefix_cache:
            kernel(q=q, k=cache[0], v=cache[1], out=out, is_causal=True, is_prefix_cache=True,
                   block_table=batch.block_tables, context_kvlen_lod_cpu=batch.kv_lod.host,
                   context_kvlen_lod_xpu=batch.kv_lod.device, **lods, **extra)
        else:
            kernel(q=q, k=key, v=value, out=out, is_causal=True, **lods, **extra)


def _torch_store(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """``reshape_and_cache_flash`` in torch: token ``t`` to block ``slot // block_size``, row ``slot % block_size``."""
    block_size = cache.shape[3]
    slots = slots.long()
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    cache[0][blocks, :, offsets] = key[keep].to(cache.dtype)
    cache[1][blocks, :, offsets] = value[keep].to(cache.dtype)


def kunlun_attention(spec: AttentionSpec, vendor: VendorKernels) -> KunlunAttention | None:
    """The backend for ``spec``, or ``None`` when the library cannot serve it (the reference backend then does)."""
    if vendor.module is None or spec.kind != MHA:
        return None
    if not any(vendor.has(f) for f in (*STORE, *DECODE, *PREFILL)):
        return None
    if spec.head_dim not in SUPPORTED_HEAD_SIZES:
        log.info("ops=kunlun: head size %d is not one the vendor's attention kernels serve (%s); attention runs "
                 "on the torch path", spec.head_dim, ", ".join(map(str, SUPPORTED_HEAD_SIZES)))
        return None
    return KunlunAttention(spec, vendor)
