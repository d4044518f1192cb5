"""``ops.attention=triton``: paged attention that reads the KV cache in place, on the plugin's Triton kernels.

The cache of a layer is two tensors ``[num_blocks, num_kv_heads,
block_size, head_dim]`` (keys, values). A step is laid out decodes first;
its metadata is one int32 buffer on the device (slots, sequence lengths,
query offsets, prefill tiles, block tables), made from the host lists in one
copy and shared by every layer; each part starts on a 16-byte boundary
(:data:`ALIGN` numbers), so no kernel is compiled again for a part that
happens to land unaligned. Decode tokens go to the split-context decode
kernel, the other sequences' tokens (prompts, chunks after a cached prefix)
to the prefill kernel, which reads each block of context once per block of
queries (:mod:`kunlun_infer_cuda.triton_kernels`).

Decode-only steps can be captured (hook API 1.5): the decode kernel's grid
depends only on the batch size and on the width of the block tables the
metadata was built for, never on this step's lengths, so
:meth:`TritonAttentionBackend.update_metadata` rewrites the buffer in place
and a replay serves any later step of that batch size. Padding sequences
(slot ``-1``) store nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np
import torch

from kunlun_infer.ops.attention import AttentionBackend, AttentionSpec, CacheTensorSpec
from kunlun_infer.ops.attention_step import AttentionStep, decodes_first
from kunlun_infer.ops.upload import upload
from kunlun_infer_cuda import triton_kernels as tk


#: int32 numbers each part of the metadata buffer is padded to (16 bytes: the alignment Triton specialises on)
ALIGN = 4


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclasses.dataclass
class TritonMetadata:
    """One step's device buffer and the host facts the kernels' launches depend on."""

    buffer: torch.Tensor
    num_seqs: int
    num_tokens: int
    num_decodes: int
    num_tiles: int
    width: int
    split_tokens: int
    num_splits: int

    def _part(self, start: int, count: int) -> torch.Tensor:
        return self.buffer[start:start + count]

    @functools.cached_property
    def _offsets(self) -> list[int]:
        """Where each part (slots, seq_lens, query_start, tile_seq, tile_row, tables) starts: worked out once,
        since every layer reads the parts."""
        starts = [0]
        for n in (self.num_tokens, self.num_seqs, self.num_seqs + 1, self.num_tiles, self.num_tiles):
            starts.append(starts[-1] + _padded(n))
        return starts

    @property
    def slots(self) -> torch.Tensor:
        return self._part(0, self.num_tokens)

    @property
    def seq_lens(self) -> torch.Tensor:
        return self._part(self._offsets[1], self.num_seqs)

    @property
    def query_start(self) -> torch.Tensor:
        return self._part(self._offsets[2], self.num_seqs + 1)

    @property
    def tile_seq(self) -> torch.Tensor:
        return self._part(self._offsets[3], self.num_tiles)

    @property
    def tile_row(self) -> torch.Tensor:
        return self._part(self._offsets[4], self.num_tiles)

    @property
    def tables(self) -> torch.Tensor:
        return self._part(self._offsets[5], self.num_seqs * self.width).view(self.num_seqs, self.width)


def _host_buffer(step: AttentionStep, width: int, tiles: tuple[list[int], list[int]]) -> torch.Tensor:
    """The step's metadata laid out as :class:`TritonMetadata` reads it, each part padded to :data:`ALIGN`
    numbers (block tables padded with numpy)."""
    parts = (step.slot_mapping, step.seq_lens, step.query_start_loc, *tiles)
    tables = step.block_table_array(width).ravel()
    out = np.zeros(sum(_padded(len(p)) for p in parts) + tables.size, dtype=np.int32)
    at = 0
    for part in parts:
        out[at:at + len(part)] = part
        at += _padded(len(part))
    out[at:] = tables
    return torch.from_numpy(out)


class TritonAttentionBackend(AttentionBackend):
    """Multi-head (grouped-query) attention over a paged cache, on the plugin's Triton kernels."""

    name = "triton-paged"

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec
        self._programs: int | None = None

    def kv_cache_tensors(self, num_blocks: int, block_size: int) -> Sequence[CacheTensorSpec]:
        shape = (num_blocks, self.spec.num_kv_heads, block_size, self.spec.head_dim)
        return (CacheTensorSpec(shape, self.spec.dtype, "key"), CacheTensorSpec(shape, self.spec.dtype, "value"))

    def order_batch(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> Sequence[int] | None:
        return decodes_first(query_lens, context_lens)

    def programs(self, device: torch.device) -> int:
        """How many decode programs fill the device: two per multiprocessor (8 off a GPU)."""
        if self._programs is None:
            self._programs = 8
            if device.type == "cuda":
                self._programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
        return self._programs

    def build_metadata(self, step: AttentionStep) -> TritonMetadata:
        width = max(1, max((len(t) for t in step.block_tables), default=1))
        decodes = step.num_leading_decodes
        tiles = tk.prefill_tiles(step.query_lens, decodes)
        split_tokens, num_splits = tk.decode_splits(decodes, self.spec.num_kv_heads, width * step.block_size,
                                                    self.programs(step.device))
        buffer = upload(_host_buffer(step, width, tiles), step.device)
        return TritonMetadata(buffer, step.num_seqs, step.num_tokens, decodes, len(tiles[0]), width, split_tokens,
                              num_splits)

    def update_metadata(self, static: TritonMetadata, step: AttentionStep) -> bool:
        if (not step.is_decode_only or step.num_seqs != static.num_seqs or static.num_tiles
                or any(len(t) > static.width for t in step.block_tables)):
            return False
        static.buffer.copy_(_host_buffer(step, static.width, ([], [])), non_blocking=True)  # see ops/upload.py
        return True

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                 metadata: TritonMetadata) -> None:
        tk.store_kv(key, value, kv_cache[0], kv_cache[1], metadata.slots)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: tuple[torch.Tensor, ...], metadata: TritonMetadata, *, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        query = tk.unit_stride(query)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        decodes = metadata.num_decodes
        if decodes:
            tk.decode_attention(query[:decodes], k_cache, v_cache, metadata.tables[:decodes],
                                metadata.seq_lens[:decodes], out[:decodes], scale, metadata.split_tokens,
                                metadata.num_splits)
        if metadata.num_tiles:
            tk.prefill_attention(query, k_cache, v_cache, metadata.tables, metadata.seq_lens, metadata.query_start,
                                 metadata.tile_seq, metadata.tile_row, out, scale)
        return out
