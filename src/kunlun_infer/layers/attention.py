"""Attention over the paged KV cache: store this step's K/V, then attend, through the run's attention backend.

One path serves prefill, chunked prefill on top of a cached prefix, and
decode: the new tokens of every sequence in the step are laid end to end
(a flat batch). The backend (``ctx.attention``: the ops plugin's own, or the
reference backend over the op table's ``store_kv`` and ``paged_attention``)
writes their keys and values into this layer's cache and attends each new
query over its sequence's whole context. The layer never looks inside the
cache or the step's metadata: both belong to the backend.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kunlun_infer.layers.context import LayerContext
from kunlun_infer.ops.reference_attention import AttentionMetadata

__all__ = ["Attention", "AttentionMetadata"]


class Attention(nn.Module):
    """Causal multi-head (grouped-query) attention of new tokens over the paged cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ctx: LayerContext):
        super().__init__()
        self.ctx = ctx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: Any,
                kv_cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``q``: ``[T, Hq, D]``, ``k``/``v``: ``[T, Hk, D]``, ``attn``: the backend's metadata → ``[T, Hq, D]``."""
        backend = self.ctx.attention
        backend.store_kv(k, v, kv_cache, attn)
        return backend.attend(q, k, v, kv_cache, attn, scale=self.scale)
