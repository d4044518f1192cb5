"""Attention over a paged KV cache: store this step's K/V, then attend through the op table.

One path serves prefill, chunked prefill on top of a cached prefix, and
decode: the new tokens of every sequence in the step are laid end to end
(a flat batch), ``ops.store_kv`` writes their keys and values to the slots the
block manager gave them, and ``ops.paged_attention`` attends each new query
over its sequence's whole context through the block table.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kunlun_infer.layers.context import LayerContext


@dataclasses.dataclass
class AttentionMetadata:
    """Where the step's tokens sit in the paged cache.

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


class Attention(nn.Module):
    """Causal multi-head (grouped-query) attention of new tokens over the paged cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ctx: LayerContext):
        super().__init__()
        self.ctx = ctx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``q``: ``[T, Hq, D]``, ``k``/``v``: ``[T, Hk, D]`` → ``[T, Hq, D]``."""
        k_cache, v_cache = kv_cache
        self.ctx.ops.store_kv(k, v, k_cache, v_cache, attn.slot_mapping)
        return self.ctx.ops.paged_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens,
                                            attn.query_start_loc, self.scale)
