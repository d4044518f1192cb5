"""The simulated chip's attention backend (hook API 1.1): Kunlun's cache layout, decodes first, split calls.

What the framework sees is the contract of :mod:`kunlun_infer.ops.attention`;
what the kernels (:mod:`kunlun_infer_simchip.attention_kernels`) see is what
Kunlun's vendor kernels want:

- one cache tensor per layer, ``(2, num_blocks, num_kv_heads, block_size,
  head_dim)``;
- a batch ordered decodes first (:meth:`SimchipAttentionBackend.order_batch`),
  so the decodes are one slice of the flat batch and the prefills another;
- int32 slots, block tables and lengths, each length as a host and a device
  tensor, built once per step from the engine's neutral step description;
- a decode call for the one-token sequences, and a prefill call for the
  rest — in prefix mode (reading the cache through the block tables) when
  any prefill has cached context (a later chunk, a prefix-cache hit).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kunlun_infer.ops.attention import AttentionBackend, AttentionSpec, CacheTensorSpec
from kunlun_infer.ops.attention_step import AttentionStep, decodes_first

from kunlun_infer_simchip import attention_kernels as kernels


@dataclasses.dataclass
class DecodeMetadata:
    """The decode slice: ``num`` one-token sequences at the front of the batch."""

    num: int
    block_tables: torch.Tensor
    context_lens_host: torch.Tensor
    context_lens_device: torch.Tensor


@dataclasses.dataclass
class PrefillMetadata:
    """The prefill slice: every other sequence, its tokens after the decodes' (offsets relative to it)."""

    q_lod_host: torch.Tensor
    q_lod_device: torch.Tensor
    #: prefix mode (cached context in some prefill): the cache is read through these
    block_tables: torch.Tensor | None = None
    kv_lod_host: torch.Tensor | None = None
    kv_lod_device: torch.Tensor | None = None


@dataclasses.dataclass
class SimchipAttentionMetadata:
    slot_mapping: torch.Tensor
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None


def _lengths(step: AttentionStep, values: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    host = torch.tensor(values, dtype=torch.int32)
    return host, host.to(step.device)


def _lod(values: Sequence[int]) -> list[int]:
    offsets = [0]
    for n in values:
        offsets.append(offsets[-1] + n)
    return offsets


class SimchipAttentionBackend(AttentionBackend):
    """Paged attention the way the simulated chip's (Kunlun-shaped) kernels want it."""

    name = "simchip-kunlun-layout"

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    def kv_cache_tensors(self, num_blocks: int, block_size: int) -> Sequence[CacheTensorSpec]:
        shape = (2, num_blocks, self.spec.num_kv_heads, block_size, self.spec.head_dim)
        return (CacheTensorSpec(shape, self.spec.dtype, "kv"),)

    def order_batch(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> Sequence[int] | None:
        return decodes_first(query_lens)

    def build_metadata(self, step: AttentionStep) -> SimchipAttentionMetadata:
        num_decodes = step.num_leading_decodes
        if any(n == 1 for n in step.query_lens[num_decodes:]):
            raise ValueError(f"the simchip kernels need the batch ordered decodes first (order_batch), got query "
                             f"lengths {step.query_lens}")
        decode = prefill = None
        if num_decodes:
            tables = step.padded_block_tables()[:num_decodes]
            decode = DecodeMetadata(num_decodes, step.tensor(tables, torch.int32),
                                    *_lengths(step, step.seq_lens[:num_decodes]))
        if num_decodes < step.num_seqs:
            query_lens = step.query_lens[num_decodes:]
            prefill = PrefillMetadata(*_lengths(step, _lod(query_lens)))
            if any(step.context_lens[num_decodes:]):
                tables = step.padded_block_tables()[num_decodes:]
                prefill.block_tables = step.tensor(tables, torch.int32)
                prefill.kv_lod_host, prefill.kv_lod_device = _lengths(step, _lod(step.seq_lens[num_decodes:]))
        return SimchipAttentionMetadata(step.tensor(step.slot_mapping, torch.int32), decode, prefill)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                 metadata: SimchipAttentionMetadata) -> None:
        (cache,) = kv_cache
        kernels.reshape_and_cache(key=key, value=value, kv_cache=cache, slot_mapping=metadata.slot_mapping)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: tuple[torch.Tensor, ...], metadata: SimchipAttentionMetadata, *,
               scale: float) -> torch.Tensor:
        (cache,) = kv_cache
        out = torch.empty_like(query)
        decode, prefill = metadata.decode, metadata.prefill
        num_decodes = decode.num if decode is not None else 0
        if decode is not None:
            kernels.paged_decode_attention(
                query=query[:num_decodes], kv_cache=cache, block_tables=decode.block_tables,
                context_lens_host=decode.context_lens_host, context_lens_device=decode.context_lens_device,
                scale=scale, out=out[:num_decodes])
        if prefill is not None:
            prefix = prefill.block_tables is not None
            kernels.prefill_attention(
                query=query[num_decodes:], key=key[num_decodes:], value=value[num_decodes:],
                out=out[num_decodes:], q_lod_host=prefill.q_lod_host, q_lod_device=prefill.q_lod_device,
                scale=scale, kv_cache=cache if prefix else None, block_tables=prefill.block_tables,
                kv_lod_host=prefill.kv_lod_host, kv_lod_device=prefill.kv_lod_device)
        return out
