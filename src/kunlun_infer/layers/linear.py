"""Linear layers, replicated or split across tensor-parallel ranks.

Each rank keeps only its part of a weight and loads it from the full
checkpoint tensor by slicing (rows for column-parallel, columns for
row-parallel). After loading, :meth:`LinearBase.pack_weights` hands the weight
once to ``ops.pack_linear_weight`` so a plugin may re-layout it; every forward
then calls ``ops.linear`` with the packed weight. Under ``model.quantization=int8``
the weight is quantized instead (``layers.quantization``) and multiplied by
``ops.int8_linear``.

- :class:`ReplicatedLinear` — every rank holds the whole weight.
- :class:`ColumnParallelLinear` — output features split; no collective.
- :class:`MergedColumnParallelLinear` — several column-parallel outputs in one
  matmul (``gate_proj`` + ``up_proj``), shard ids ``0, 1, …``.
- :class:`QKVParallelLinear` — q, k, v projections in one matmul, shard ids
  ``"q"``, ``"k"``, ``"v"``; query heads split, KV heads split when they
  divide among the ranks, replicated (one head per rank) otherwise.
- :class:`RowParallelLinear` — input features split; partial outputs summed
  with an all-reduce; the bias is added once. When the streams plugin has a
  separate comm stream and the batch is large (a prefill), the rows are cut
  into chunks and each chunk's all-reduce overlaps the next chunk's matmul.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from kunlun_infer.layers.context import LayerContext, divide
from kunlun_infer.layers.weights import WeightSpec, copy_weight, read_part, shares_storage
from kunlun_infer.ops.reference import quantize_int8


@dataclasses.dataclass(frozen=True)
class _Part:
    """Where one checkpoint tensor lands: ``size`` slices along ``dim``, from ``source_start`` to ``target_start``."""

    full_shape: tuple[int, int]
    dim: int
    target_start: int
    source_start: int
    size: int


class LinearBase(nn.Module):
    """A ``[out, in]`` weight (this rank's part) and optional bias, loaded from named checkpoint parts."""

    def __init__(self, local_out: int, local_in: int, bias: bool, ctx: LayerContext, parts: dict[Any, _Part]):
        super().__init__()
        self.ctx = ctx
        self.parts = parts
        self.weight = ctx.empty(local_out, local_in)
        self.bias = ctx.empty(local_out) if bias else None
        self.packed_weight: Any = None

    def weight_specs(self) -> list[WeightSpec]:
        """The checkpoint tensors this layer reads, with their full (unsplit) shapes."""
        specs = []
        for shard, part in self.parts.items():
            specs.append(WeightSpec("weight", shard, part.full_shape))
            if self.bias is not None:
                specs.append(WeightSpec("bias", shard, (part.full_shape[0],)))
        return specs

    def load_weight(self, param: str, shard: Any, source: Any) -> None:
        """Copy this rank's part of checkpoint tensor ``source`` into ``param`` (``weight``/``bias``)."""
        part = self.parts[shard]
        if param == "weight":
            target = self.weight.data.narrow(part.dim, part.target_start, part.size)
            loaded = read_part(source, part.dim, part.source_start, part.size)
        elif part.dim == 1:  # row-parallel: the bias is not split
            target, loaded = self.bias.data, source[:]
        else:
            target = self.bias.data.narrow(0, part.target_start, part.size)
            loaded = read_part(source, 0, part.source_start, part.size)
        copy_weight(target, loaded)

    def pack_weights(self) -> None:
        """Hand the loaded weight to ``ops.pack_linear_weight`` once (drop the original if repacked), or
        quantize it and hand it to ``ops.pack_int8_linear_weight`` under ``model.quantization=int8``."""
        if self.ctx.quantization is not None:
            self.packed_weight = self.ctx.ops.pack_int8_linear_weight(*quantize_int8(self.weight.data))
            self.weight = None
            return
        self.packed_weight = self.ctx.ops.pack_linear_weight(self.weight)
        if not shares_storage(self.packed_weight, self.weight):
            self.weight = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` through the op that serves this layer's (packed) weight."""
        if self.ctx.quantization is not None:
            return self.ctx.ops.int8_linear(x, self.packed_weight, bias)
        return self.ctx.ops.linear(x, self.packed_weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: LayerContext):
        part = _Part((output_size, input_size), 0, 0, 0, output_size)
        super().__init__(output_size, input_size, bias, ctx, {None: part})


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice of the output."""

    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: LayerContext):
        local = divide(output_size, ctx.tp_size, "output features")
        part = _Part((output_size, input_size), 0, 0, ctx.tp_rank * local, local)
        super().__init__(local, input_size, bias, ctx, {None: part})


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections of one input, concatenated (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, ctx: LayerContext):
        parts, offset = {}, 0
        for i, size in enumerate(output_sizes):
            local = divide(size, ctx.tp_size, f"output features of part {i}")
            parts[i] = _Part((size, input_size), 0, offset, ctx.tp_rank * local, local)
            offset += local
        super().__init__(offset, input_size, bias, ctx, parts)


def heads_per_rank(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """``(query heads, key/value heads)`` one of ``tp_size`` ranks holds.

    With fewer KV heads than ranks, each rank keeps a copy of the one KV head
    its queries use.
    """
    local_heads = divide(num_heads, tp_size, "attention heads")
    if num_kv_heads >= tp_size:
        return local_heads, divide(num_kv_heads, tp_size, "key/value heads")
    if tp_size % num_kv_heads:
        raise ValueError(f"tensor-parallel size {tp_size} neither divides nor is a multiple of the "
                         f"{num_kv_heads} key/value heads")
    return local_heads, 1


class QKVParallelLinear(LinearBase):
    """Query, key and value projections in one matmul, split by heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 ctx: LayerContext):
        tp, rank = ctx.tp_size, ctx.tp_rank
        local_heads, local_kv_heads = heads_per_rank(num_heads, num_kv_heads, tp)
        if num_kv_heads >= tp:
            kv_head_start = rank * local_kv_heads
        else:  # one replicated KV head per group of tp // num_kv_heads ranks
            kv_head_start = rank // (tp // num_kv_heads)
        q_size, kv_size = local_heads * head_dim, local_kv_heads * head_dim
        parts = {
            "q": _Part((num_heads * head_dim, hidden_size), 0, 0, rank * q_size, q_size),
            "k": _Part((num_kv_heads * head_dim, hidden_size), 0, q_size, kv_head_start * head_dim, kv_size),
            "v": _Part((num_kv_heads * head_dim, hidden_size), 0, q_size + kv_size, kv_head_start * head_dim,
                       kv_size),
        }
        super().__init__(q_size + 2 * kv_size, hidden_size, bias, ctx, parts)
        self.num_heads, self.num_kv_heads = local_heads, local_kv_heads
        self.q_size, self.kv_size = q_size, kv_size


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial products are summed by an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: LayerContext):
        local = divide(input_size, ctx.tp_size, "input features")
        part = _Part((output_size, input_size), 1, 0, ctx.tp_rank * local, local)
        super().__init__(output_size, local, bias, ctx, {None: part})

    #: rows per chunk below which overlapping the all-reduce is not worth the extra launches
    overlap_min_rows: int = 32
    overlap_max_chunks: int = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.ctx.tp_rank == 0 else None
        num_chunks = min(self.overlap_max_chunks, x.shape[0] // self.overlap_min_rows)
        if self.ctx.streams is not None and num_chunks >= 2:
            return self.ctx.all_reduce_pipelined(lambda rows: self.matmul(rows, bias),
                                                 x, num_chunks)
        return self.ctx.all_reduce(self.matmul(x, bias))
