"""Mixture-of-experts layers: a router, the experts of one layer stacked, and how they split over ranks.

The ops they run on (hook API 1.4): ``moe_route`` chooses each token's
experts and weights, ``pack_moe_weights`` prepares the stacked expert weights
once after loading, ``fused_moe`` runs the chosen experts and combines them.

- :class:`Router` — the gate: ``[E, H]`` logits weight (replicated, never
  quantized: a rounded router would route differently), optionally a
  per-expert correction bias (DeepSeek-V3), then ``moe_route``.
- :class:`FusedExperts` — every expert's gate/up (``w13``) and down (``w2``)
  projections stacked, read from the checkpoint's per-expert tensors. With
  ``expert_size=1`` experts split like a dense MLP under tensor parallelism:
  each rank holds a slice of every expert's intermediate features and the
  partial outputs are summed by an all-reduce. With ``expert_size`` equal to
  the tensor-parallel size each rank holds whole experts (``E / ranks`` of
  them); a rank takes its share of the tokens, sends each (token, expert)
  pair to the rank owning the expert (``Comm.all_to_all``: first how many
  pairs for each of the owner's experts, then the pairs' rows, sorted by
  expert), the owner runs its experts, the results come back the same way,
  are combined by the routing weights, and the ranks' token shares are
  gathered again: three all-to-alls a layer.
- :class:`SparseMoeBlock` — router, experts, and optional shared experts
  every token also goes through.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kunlun_infer.layers.context import LayerContext
from kunlun_infer.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from kunlun_infer.layers.weights import WeightSpec, copy_weight, read_part, shares_storage

#: ops a mixture-of-experts model needs besides the dense ones
MOE_OPS = ("moe_route", "pack_moe_weights", "fused_moe")
#: checkpoint names of an expert's three projections: gate, up, down (``experts.{e}.<name>.weight``)
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


class Router(nn.Module):
    """``gate``: ``[E, H]`` router logits, then ``ops.moe_route`` with the model's routing options.

    ``dtype``: the precision the logits are computed in (default: the model's; DeepSeek routes in float32).
    """

    def __init__(self, hidden_size: int, num_experts: int, ctx: LayerContext, route_options: dict[str, Any], *,
                 correction_bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.ctx, self.route_options = ctx, dict(route_options)
        self.dtype = dtype or ctx.dtype
        self.weight = ctx.empty(num_experts, hidden_size, dtype=self.dtype)
        self.e_score_correction_bias = ctx.empty(num_experts, dtype=torch.float32) if correction_bias else None
        self.packed_weight: Any = None

    def weight_specs(self) -> list[WeightSpec]:
        specs = [WeightSpec("weight", None, tuple(self.weight.shape))]
        if self.e_score_correction_bias is not None:
            specs.append(WeightSpec("e_score_correction_bias", None, tuple(self.e_score_correction_bias.shape)))
        return specs

    def load_weight(self, param: str, shard: Any, source: Any) -> None:
        copy_weight(getattr(self, param).data, source[:])

    def pack_weights(self) -> None:
        self.packed_weight = self.ctx.ops.pack_linear_weight(self.weight)
        if not shares_storage(self.packed_weight, self.weight):
            self.weight = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, H]`` → ``(weights [T, k] float32, ids [T, k] int32)``."""
        logits = self.ctx.ops.linear(x.to(self.dtype), self.packed_weight, None)
        return self.ctx.ops.moe_route(logits, correction_bias=self.e_score_correction_bias, **self.route_options)


class FusedExperts(nn.Module):
    """The routed experts of one layer; see the module docstring for how they split over ranks."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ctx: LayerContext, *,
                 names: tuple[str, str, str] = QWEN_EXPERT_NAMES):
        super().__init__()
        self.ctx, self.names = ctx, names
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.expert_parallel = ctx.ep_size > 1
        if self.expert_parallel:
            if num_experts % ctx.ep_size:
                raise ValueError(f"the {num_experts} experts do not divide among parallel.expert_size="
                                 f"{ctx.ep_size} ranks")
            self.local_experts, self.local_intermediate = num_experts // ctx.ep_size, intermediate_size
            self.first_expert, self.intermediate_start = ctx.tp_rank * self.local_experts, 0
        else:
            if intermediate_size % ctx.tp_size:
                raise ValueError(f"the experts' intermediate size ({intermediate_size}) is not divisible by the "
                                 f"tensor-parallel size {ctx.tp_size}")
            self.local_experts, self.local_intermediate = num_experts, intermediate_size // ctx.tp_size
            self.first_expert, self.intermediate_start = 0, ctx.tp_rank * self.local_intermediate
        self.w13 = ctx.empty(self.local_experts, 2 * self.local_intermediate, hidden_size)
        self.w2 = ctx.empty(self.local_experts, hidden_size, self.local_intermediate)
        self.packed_weight: Any = None

    def _expert_specs(self, experts: range) -> list[WeightSpec]:
        gate, up, down = self.names
        full_in, full_out = (self.intermediate_size, self.hidden_size), (self.hidden_size, self.intermediate_size)
        return [WeightSpec(f"{e}.{name}.weight", None, shape) for e in experts
                for name, shape in ((gate, full_in), (up, full_in), (down, full_out))]

    def weight_specs(self) -> list[WeightSpec]:
        """This rank's experts' tensors (``{e}.<name>.weight``), each with its full checkpoint shape."""
        return self._expert_specs(range(self.first_expert, self.first_expert + self.local_experts))

    def params_held_elsewhere(self) -> list[str]:
        """Checkpoint tensors of the experts other ranks hold (expert parallelism), which this rank skips."""
        mine = range(self.first_expert, self.first_expert + self.local_experts)
        return [spec.param for spec in self._expert_specs(range(self.num_experts)) if int(spec.param.split(".")[0])
                not in mine]

    def load_weight(self, param: str, shard: Any, source: Any) -> None:
        expert, name, _ = param.split(".")
        local = int(expert) - self.first_expert
        gate, up, _down = self.names
        size, start = self.local_intermediate, self.intermediate_start
        if name == gate:
            copy_weight(self.w13.data[local, :size], read_part(source, 0, start, size))
        elif name == up:
            copy_weight(self.w13.data[local, size:], read_part(source, 0, start, size))
        else:
            copy_weight(self.w2.data[local], read_part(source, 1, start, size))

    def pack_weights(self) -> None:
        """Hand the stacked weights to ``ops.pack_moe_weights`` once (the originals dropped if repacked)."""
        self.packed_weight = self.ctx.ops.pack_moe_weights(self.w13.data, self.w2.data)
        if not (isinstance(self.packed_weight, tuple) and len(self.packed_weight) == 2
                and shares_storage(self.packed_weight[0], self.w13) and shares_storage(self.packed_weight[1], self.w2)):
            self.w13 = self.w2 = None

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.expert_parallel:
            return self._expert_parallel(x, topk_weights, topk_ids)
        return self.ctx.all_reduce(self.ctx.ops.fused_moe(x, self.packed_weight, topk_weights, topk_ids))

    def _expert_parallel(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Dispatch this rank's share of the tokens to the experts' owners and combine what comes back."""
        ctx, comm, ranks = self.ctx, self.ctx.comm, self.ctx.ep_size
        share = -(-x.shape[0] // ranks)  # every rank's share padded to the same rows, for the final all-gather
        mine = slice(min(ctx.tp_rank * share, x.shape[0]), min((ctx.tp_rank + 1) * share, x.shape[0]))
        rows, ids, weights = x[mine], topk_ids[mine].to(torch.int64), topk_weights[mine]
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # by expert: each owner's pairs are contiguous
        expert_of = flat_ids.index_select(0, order)
        token_of = order // ids.shape[1]
        local = self.local_experts
        # the pairs this rank sends each owner, per the owner's expert; what every rank sends this one, alike: the
        # pairs come sorted by expert, so those counts alone say which expert each received pair is for
        per_expert = torch.bincount(expert_of, minlength=ranks * local).view(ranks, local)
        counts = comm.all_to_all(per_expert, [1] * ranks, [1] * ranks)
        send, recv = per_expert.sum(dim=1).tolist(), counts.sum(dim=1).tolist()
        received = comm.all_to_all(rows.index_select(0, token_of), send, recv)
        local_ids = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ranks), counts.reshape(-1))
        ones = torch.ones(received.shape[0], 1, dtype=torch.float32, device=x.device)
        results = ctx.ops.fused_moe(received, self.packed_weight, ones, local_ids.view(-1, 1))
        returned = comm.all_to_all(results, recv, send)
        out = torch.zeros(share, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, token_of,
                       returned.to(torch.float32) * weights.reshape(-1).to(torch.float32).index_select(0, order)[:, None])
        return comm.all_gather(out.to(x.dtype), dim=0)[:x.shape[0]]


class SharedExpertsMLP(nn.Module):
    """The dense SwiGLU MLP every token goes through besides its routed experts (``shared_experts``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, ctx: LayerContext):
        super().__init__()
        self.ctx = ctx
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, False, ctx)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ctx.ops.silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router (``gate``), routed experts (``experts``) and optional ``shared_experts``, as Hugging Face names them.

    ``moe``: the model's :class:`~kunlun_infer.models.config.MoeArchConfig`.
    """

    def __init__(self, hidden_size: int, moe: Any, ctx: LayerContext, *,
                 expert_names: tuple[str, str, str] = QWEN_EXPERT_NAMES, router_dtype: torch.dtype | None = None):
        super().__init__()
        self.gate = Router(hidden_size, moe.num_experts, ctx, moe.route_options(),
                           correction_bias=moe.correction_bias, dtype=router_dtype)
        self.experts = FusedExperts(moe.num_experts, hidden_size, moe.intermediate_size, ctx, names=expert_names)
        self.shared_experts = (SharedExpertsMLP(hidden_size, moe.shared_intermediate_size, ctx)
                               if moe.shared_intermediate_size else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
