"""RMSNorm through the op table, with the residual add fused when one is given."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kunlun_infer.layers.context import LayerContext
from kunlun_infer.layers.weights import WeightSpec, copy_weight


class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` over the last dim; replicated on every rank."""

    def __init__(self, size: int, eps: float, ctx: LayerContext):
        super().__init__()
        self.ctx = ctx
        self.eps = eps
        self.weight = ctx.empty(size)

    def weight_specs(self) -> list[WeightSpec]:
        return [WeightSpec("weight", None, tuple(self.weight.shape))]

    def load_weight(self, param: str, shard: Any, source: Any) -> None:
        copy_weight(self.weight.data, source[:])

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return self.ctx.ops.rms_norm(x, self.weight, self.eps)
        return self.ctx.ops.add_rms_norm(x, residual, self.weight, self.eps)
