"""Multi-head latent attention (DeepSeek-V2/V3): the latent cache is stored and attended through the MLA backend.

The attention module of a DeepSeek layer computes, per token, the query
heads (split into a part without position and a rotated part), the
compressed latent ``c`` (normalised) and the rotated key ``k_rope`` shared by
every head. :class:`MLAAttention` hands ``c`` and ``k_rope`` to the run's
:class:`~kunlun_infer.ops.attention.MLAAttentionBackend`, which caches them
in its own layout, and asks it for the attention output of the queries,
passing the up-projection ``kv_b_proj`` per head (:class:`MLAUpProjection`)
so that the backend may decompress the latent or fold the projection into
the queries, as suits its kernels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kunlun_infer.layers.context import LayerContext
from kunlun_infer.layers.linear import ColumnParallelLinear


class MLAUpProjection(ColumnParallelLinear):
    """``kv_b_proj``: latent → per-head key (without position) and value; this rank's heads.

    Never multiplied as a linear layer: the attention backend reads it per
    head (:attr:`per_head`), so the weight stays as loaded — in the model's
    dtype, unpacked and unquantized.
    """

    def __init__(self, kv_lora_rank: int, num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
                 ctx: LayerContext):
        super().__init__(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), False, ctx)
        self.num_heads = num_heads // ctx.tp_size
        self.head_size = qk_nope_head_dim + v_head_dim

    #: ``model.quantization`` leaves it as loaded (the memory plan counts it so)
    quantized_with_model = False

    def pack_weights(self) -> None:
        """Kept as loaded (see the class)."""

    @property
    def per_head(self) -> torch.Tensor:
        """``[heads of this rank, qk_nope_head_dim + v_head_dim, kv_lora_rank]`` (a view of the weight)."""
        return self.weight.view(self.num_heads, self.head_size, self.weight.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError("kv_b_proj is read by the MLA attention backend, not applied as a linear layer")


class MLAAttention(nn.Module):
    """Store this step's latents, then attend the queries over each sequence's latent context."""

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, scale: float,
                 ctx: LayerContext):
        super().__init__()
        self.ctx = ctx
        self.num_heads, self.v_head_dim = num_heads, v_head_dim
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.scale = scale

    def forward(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                kv_up: torch.Tensor, attn: Any, kv_cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``q_nope``/``q_rope``: ``[T, H, dn]``/``[T, H, dr]``; ``latent``/``k_rope``: ``[T, r]``/``[T, dr]``
        → ``[T, H, v_head_dim]``."""
        backend = self.ctx.attention
        backend.store_latent(latent, k_rope, kv_cache, attn)
        return backend.attend_latent(q_nope, q_rope, latent, k_rope, kv_cache, attn, kv_up=kv_up, scale=self.scale)
