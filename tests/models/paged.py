"""A minimal paged-KV driver for model tests: blocks per sequence, flat batches, metadata.

It plays the part of the engine's block manager and model runner just enough
to feed a :class:`~kunlun_infer.models.CausalLM` prefill chunks and decode
steps for several sequences at once, with non-contiguous blocks, and return
each sequence's logits for its new tokens.
"""

from __future__ import annotations

import types

import torch

from kunlun_infer.layers import AttentionMetadata
from kunlun_infer.ops import OP_SPECS


class ReferenceRuntime:
    """Stands in for ``kunlun_infer.runtime.Runtime``: host device, reference ops, no comm."""

    def __init__(self, comm=None):
        self.device = types.SimpleNamespace(torch_device=torch.device("cpu"))
        self.comm = comm
        self.resolved: list[str] = []

    def resolve_ops(self, names):
        self.resolved = list(names)
        return types.SimpleNamespace(**{n: OP_SPECS[n].reference for n in names})


class PagedKV:
    """KV caches for ``model`` plus per-sequence block tables; blocks handed out in a scrambled order."""

    def __init__(self, model, num_blocks: int = 96, block_size: int = 4, dtype: torch.dtype | None = None):
        dtype = dtype or model.ctx.dtype
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.model, self.block_size = model, block_size
        self.caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                       for _ in range(model.num_layers)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run new tokens of several sequences (``{seq_id: token ids}``) as one flat batch.

        Returns ``{seq_id: [len(tokens), vocab] float32 logits}``.
        """
        ids, positions, slots, qsl = [], [], [], [0]
        for sid, tokens in chunks.items():
            start = self.lens.get(sid, 0)
            blocks = self.blocks.setdefault(sid, [])
            for pos in range(start, start + len(tokens)):
                if pos // self.block_size >= len(blocks):
                    blocks.append(self.free.pop())
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
                positions.append(pos)
            ids += tokens
            self.lens[sid] = start + len(tokens)
            qsl.append(qsl[-1] + len(tokens))
        width = max(len(self.blocks[s]) for s in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.int32)
        for i, sid in enumerate(chunks):
            tables[i, :len(self.blocks[sid])] = torch.tensor(self.blocks[sid], dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=tables,
            seq_lens=torch.tensor([self.lens[s] for s in chunks], dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32))
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                                meta, self.caches)
            logits = self.model.compute_logits(hidden)
        return {sid: logits[qsl[i]:qsl[i + 1]] for i, sid in enumerate(chunks)}


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """``transformers`` logits of one sequence, float32 ``[len, vocab]``."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def max_relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest absolute difference, relative to the largest reference magnitude."""
    return float((ours.float() - reference.float()).abs().max() / reference.float().abs().max())
