"""The reference attention backend: the 1.0 cache layout, attended through the op table.

Each layer's cache is two tensors, K and V, shaped ``[num_blocks, block_size,
num_kv_heads, head_dim]``. ``store_kv`` and ``paged_attention`` come from the
run's op table — the ops plugin's kernels where it has them, the plain-torch
references otherwise — so an ops plugin that only provides ops (every 1.0
plugin) keeps working unchanged. One ``paged_attention`` call serves prefill,
chunked prefill and decode of the whole flat batch, in the scheduler's order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from kunlun_infer.ops.attention import AttentionBackend, AttentionSpec, CacheTensorSpec
from kunlun_infer.ops.attention_step import AttentionStep

#: the op-table ops the reference backend calls (resolved only when it serves the run)
REFERENCE_ATTENTION_OPS: tuple[str, ...] = ("store_kv", "paged_attention")


@dataclasses.dataclass
class AttentionMetadata:
    """The reference backend's per-step metadata: where the step's tokens sit in the paged cache.

    ``slot_mapping``: ``[T]`` int64, flat KV slot (``block * block_size +
    offset``) of each new token (negative = padding, not stored).
    ``block_tables``: ``[B, max_blocks]`` int32. ``seq_lens``: ``[B]`` int32,
    context length of each sequence *including* its new tokens.
    ``query_start_loc``: ``[B + 1]`` int32; the new tokens of sequence ``i`` are
    rows ``query_start_loc[i]:query_start_loc[i + 1]``. The optional host-side
    facts let kernels pick a fast path; ``None`` means unknown.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int | None = None
    max_seq_len: int | None = None
    is_decode_only: bool | None = None


def reference_metadata(step: AttentionStep) -> AttentionMetadata:
    """The :class:`AttentionMetadata` of ``step``, on ``step.device``."""
    return AttentionMetadata(
        slot_mapping=step.tensor(step.slot_mapping, torch.int64),
        block_tables=torch.from_numpy(step.block_table_array()).to(step.device),
        seq_lens=step.tensor(step.seq_lens, torch.int32),
        query_start_loc=step.tensor(step.query_start_loc, torch.int32),
        max_query_len=step.max_query_len, max_seq_len=step.max_seq_len, is_decode_only=step.is_decode_only)


class ReferenceAttentionBackend(AttentionBackend):
    """Separate K and V caches ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``store_kv`` + ``paged_attention``.

    ``ops``: the run's op table (anything with ``store_kv`` and
    ``paged_attention`` attributes); ``None`` builds a backend that can only
    size caches (what the memory plan needs).
    """

    name = "reference"

    def __init__(self, spec: AttentionSpec, ops: Any = None) -> None:
        self.spec = spec
        self.ops = ops

    def kv_cache_tensors(self, num_blocks: int, block_size: int) -> Sequence[CacheTensorSpec]:
        shape = (num_blocks, block_size, self.spec.num_kv_heads, self.spec.head_dim)
        return (CacheTensorSpec(shape, self.spec.dtype, "key"), CacheTensorSpec(shape, self.spec.dtype, "value"))

    def build_metadata(self, step: AttentionStep) -> AttentionMetadata:
        return reference_metadata(step)

    def update_metadata(self, static: AttentionMetadata, step: AttentionStep) -> bool:
        """In place, for a captured decode step: slots, lengths and tables are tensors the kernels read; tables
        narrower than ``static``'s keep stale ids past their own blocks, which no kernel reads."""
        tables = step.block_table_array()
        if (not step.is_decode_only or static.seq_lens.shape[0] != step.num_seqs
                or tables.shape[1] > static.block_tables.shape[1]):
            return False
        static.slot_mapping.copy_(torch.tensor(step.slot_mapping, dtype=torch.int64))
        static.seq_lens.copy_(torch.tensor(step.seq_lens, dtype=torch.int32))
        static.query_start_loc.copy_(torch.tensor(step.query_start_loc, dtype=torch.int32))
        if tables.size:
            static.block_tables[:, :tables.shape[1]].copy_(torch.from_numpy(tables))
        static.max_query_len, static.max_seq_len, static.is_decode_only = 1, step.max_seq_len, True
        return True

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                 metadata: AttentionMetadata) -> None:
        k_cache, v_cache = kv_cache
        self.ops.store_kv(key, value, k_cache, v_cache, metadata.slot_mapping)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: tuple[torch.Tensor, ...], metadata: AttentionMetadata, *, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        return self.ops.paged_attention(query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                                        metadata.query_start_loc, scale)
