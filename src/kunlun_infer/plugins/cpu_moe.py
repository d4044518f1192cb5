"""``fused_moe`` on the host: tokens grouped by expert, two GEMMs per expert that has any.

The reference visits every expert and picks its tokens with a mask; here
(:func:`kunlun_infer.ops.moe.grouped_fused_moe`) the ``T * k`` (token,
expert) pairs are sorted by expert once, the token rows gathered in that
order, and each *active* expert multiplies its contiguous block of rows —
its gate and up projections in one GEMM, ``silu_and_mul``, its down
projection in another — through the same kernels as ``linear``
(:mod:`kunlun_infer.plugins.cpu_gemm`: each expert's weights packed once, at
load, for the native GEMM, which streams a weight once for all of that
expert's rows). The results are scattered back and combined by the routing
weights in float32, as the reference does. Experts no token chose are never
touched: at batch 1 with top-8 of 128 experts, 8 experts' weights are read.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kunlun_infer.ops import reference
from kunlun_infer.ops.moe import grouped_fused_moe


class PackedExperts(NamedTuple):
    """Every expert's ``w13`` (``[2I, H]``) and ``w2`` (``[H, I]``) as the ``linear`` kernels take them."""

    w13: tuple[Any, ...]
    w2: tuple[Any, ...]
    hidden_size: int

    @property
    def num_experts(self) -> int:
        return len(self.w13)


def pack_moe_weights(w13: torch.Tensor, w2: torch.Tensor, pack_linear_weight: Any) -> PackedExperts:
    """Each expert's two weights handed to ``pack_linear_weight`` (the ``cpu`` table's) once."""
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0] or w13.shape[2] != w2.shape[1] \
            or w13.shape[1] != 2 * w2.shape[2]:
        raise ValueError(f"pack_moe_weights: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} are not "
                         "[E, 2I, H] and [E, H, I]")
    return PackedExperts(w13=tuple(pack_linear_weight(w.contiguous()) for w in w13.unbind(0)),
                         w2=tuple(pack_linear_weight(w.contiguous()) for w in w2.unbind(0)),
                         hidden_size=w13.shape[2])


def fused_moe(x: torch.Tensor, packed: Any, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              linear: Any, silu_and_mul: Any) -> torch.Tensor:
    """``ops.reference.fused_moe`` with the tokens grouped by expert; ``linear``/``silu_and_mul`` the table's."""
    if not isinstance(packed, PackedExperts):  # the reference's pair (e.g. weights not on the host)
        return reference.fused_moe(x, packed, topk_weights, topk_ids)

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        return linear(silu_and_mul(linear(rows, packed.w13[expert])), packed.w2[expert])

    return grouped_fused_moe(x, topk_weights, topk_ids, packed.num_experts, packed.hidden_size, expert_mlp)
