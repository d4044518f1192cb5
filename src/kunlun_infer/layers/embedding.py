"""Token embedding and LM head, split by vocabulary rows across tensor-parallel ranks.

Rank ``r`` holds rows ``r*n : (r+1)*n`` with ``n = ceil(vocab / tp_size)``
(the last shard zero-padded). The embedding looks up the ids it owns and the
ranks' partial results are summed; the LM head computes its slice of the
logits and the slices are gathered, so every rank ends with the full
vocabulary. With tied embeddings the LM head reuses the embedding's weight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kunlun_infer.layers.context import LayerContext
from kunlun_infer.layers.weights import WeightSpec, copy_weight, read_part, shares_storage


class VocabParallelEmbedding(nn.Module):
    """``[vocab, hidden]`` embedding table, split by rows."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: LayerContext,
                 shared_weight: nn.Parameter | None = None):
        super().__init__()
        self.ctx = ctx
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.rows_per_rank = -(-vocab_size // ctx.tp_size)
        self.row_start = ctx.tp_rank * self.rows_per_rank
        self.num_local_rows = max(0, min(self.rows_per_rank, vocab_size - self.row_start))
        self.weight = shared_weight if shared_weight is not None else ctx.empty(self.rows_per_rank, hidden_size)

    def weight_specs(self) -> list[WeightSpec]:
        return [WeightSpec("weight", None, (self.vocab_size, self.hidden_size))]

    def load_weight(self, param: str, shard: Any, source: Any) -> None:
        copy_weight(self.weight.data[:self.num_local_rows], read_part(source, 0, self.row_start, self.num_local_rows))
        self.weight.data[self.num_local_rows:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return self.ctx.ops.embedding(ids, self.weight)
        owned = (ids >= self.row_start) & (ids < self.row_start + self.num_local_rows)
        local_ids = torch.where(owned, ids - self.row_start, torch.zeros_like(ids))
        out = self.ctx.ops.embedding(local_ids, self.weight)
        out = out.masked_fill(~owned.unsqueeze(-1), 0)
        return self.ctx.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states to float32 logits over the full vocabulary; optionally tied to an embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: LayerContext,
                 tied_to: VocabParallelEmbedding | None = None):
        super().__init__(vocab_size, hidden_size, ctx, shared_weight=None if tied_to is None else tied_to.weight)
        self.tied = tied_to is not None
        self.packed_weight: Any = None

    def weight_specs(self) -> list[WeightSpec]:
        return [] if self.tied else super().weight_specs()

    def pack_weights(self) -> None:
        """Pack the (possibly shared) table once for ``ops.linear``; drop an own copy if repacked."""
        self.packed_weight = self.ctx.ops.pack_linear_weight(self.weight)
        if not self.tied and not shares_storage(self.packed_weight, self.weight):
            self.weight = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.ctx.ops.linear(hidden, self.packed_weight, None)
        logits = self.ctx.all_gather(logits, dim=-1)
        return logits[..., :self.vocab_size].float()
