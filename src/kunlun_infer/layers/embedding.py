"""Token embedding and LM head, split by vocabulary rows across tensor-parallel ranks.

Rank ``r`` holds rows ``r*n : (r+1)*n`` with ``n = ceil(vocab / tp_size)``
(the last shard zero-padded). The embedding looks up the ids it owns and the
ranks' partial results are summed; the LM head computes its slice of the
logits and the slices are gathered, so every rank ends with the full
vocabulary. With tied embeddings the LM head reuses the embedding's weight.

Under ``model.quantization=int8`` (``layers.quantization``) the LM head is
quantized and multiplied by ``ops.int8_linear`` (``model.quantize_head``), and
the table is held as int8 rows with one float32 scale each, rows scaled back
after the lookup (``model.quantize_embedding``); a tied head then reuses the
embedding's int8 rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kunlun_infer.layers.context import LayerContext
from kunlun_infer.layers.weights import WeightSpec, copy_weight, read_part, shares_storage
from kunlun_infer.ops.reference import quantize_int8


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
        #: the table as int8 rows and their float32 scales, once quantized (``model.quantize_embedding``)
        self.qweight: nn.Parameter | None = None
        self.qscale: nn.Parameter | None = None

    def weight_specs(self) -> list[WeightSpec]:
        return [WeightSpec("weight", None, (self.vocab_size, self.hidden_size))]

    def load_weight(self, param: str, shard: Any, source: Any) -> None:
        copy_weight(self.weight.data[:self.num_local_rows], read_part(source, 0, self.row_start, self.num_local_rows))
        self.weight.data[self.num_local_rows:].zero_()

    def pack_weights(self) -> None:
        """Quantize the table to int8 rows once, after loading, when ``model.quantize_embedding`` asks for it."""
        quantization = self.ctx.quantization
        if quantization is None or not quantization.embedding:
            return
        qweight, scale = quantize_int8(self.weight.data)
        self.qweight = nn.Parameter(qweight, requires_grad=False)
        self.qscale = nn.Parameter(scale, requires_grad=False)
        self.weight = None

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of this rank's table, in the model's dtype."""
        if self.qweight is None:
            return self.ctx.ops.embedding(ids, self.weight)
        rows = self.ctx.ops.embedding(ids, self.qweight).to(torch.float32)
        return (rows * self.qscale.index_select(0, ids.reshape(-1)).view(*ids.shape, 1)).to(self.ctx.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return self.lookup(ids)
        owned = (ids >= self.row_start) & (ids < self.row_start + self.num_local_rows)
        local_ids = torch.where(owned, ids - self.row_start, torch.zeros_like(ids))
        out = self.lookup(local_ids)
        out = out.masked_fill(~owned.unsqueeze(-1), 0)
        return self.ctx.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states to float32 logits over the full vocabulary; optionally tied to an embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: LayerContext,
                 tied_to: VocabParallelEmbedding | None = None):
        super().__init__(vocab_size, hidden_size, ctx, shared_weight=None if tied_to is None else tied_to.weight)
        self.tied = tied_to is not None
        self.__dict__["tied_embedding"] = tied_to  # a reference, not a submodule (it is the model's own)
        self.packed_weight: Any = None
        self.quantized = ctx.quantization is not None and ctx.quantization.head

    def weight_specs(self) -> list[WeightSpec]:
        return [] if self.tied else super().weight_specs()

    def pack_weights(self) -> None:
        """Pack the (possibly shared) table once for ``ops.linear`` and drop an own copy if repacked; or, with
        ``model.quantize_head``, quantize it (a quantized tied embedding's int8 rows serve as they are)."""
        if self.quantized:
            tied = self.tied_embedding
            quantized = (tied.qweight.data, tied.qscale.data) if self.tied and tied.qweight is not None \
                else quantize_int8(self.weight.data)
            self.packed_weight = self.ctx.ops.pack_int8_linear_weight(*quantized)
            self.weight = None
            return
        self.packed_weight = self.ctx.ops.pack_linear_weight(self.weight)
        if not self.tied and not shares_storage(self.packed_weight, self.weight):
            self.weight = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            logits = self.ctx.ops.int8_linear(hidden, self.packed_weight, None)
        else:
            logits = self.ctx.ops.linear(hidden, self.packed_weight, None)
        logits = self.ctx.all_gather(logits, dim=-1)
        return logits[..., :self.vocab_size].float()
