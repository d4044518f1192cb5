"""A minimal paged-KV driver for model tests: blocks per sequence, flat batches, metadata.

It plays the part of the engine's block manager and model runner just enough
to feed a :class:`~kunlun_infer.models.CausalLM` prefill chunks and decode
steps for several sequences at once, with non-contiguous blocks, and return
each sequence's logits for its new tokens. Like the engine, it describes each
step neutrally and leaves the cache's layout to the model's attention backend.
"""

from __future__ import annotations

import types

import torch

from kunlun_infer.ops import OP_SPECS
from kunlun_infer.ops.attention_step import AttentionStep


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
    """KV caches for ``model`` in its attention backend's layout, plus per-sequence block tables.

    Blocks are handed out in a scrambled order; the caches are only ever
    touched by the model's attention backend.
    """

    def __init__(self, model, num_blocks: int = 96, block_size: int = 4):
        self.model, self.block_size = model, block_size
        tensors = model.attention.kv_cache_tensors(num_blocks, block_size)
        self.caches = [tuple(torch.zeros(t.shape, dtype=t.dtype) for t in tensors) for _ in range(model.num_layers)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run new tokens of several sequences (``{seq_id: token ids}``) as one flat batch.

        Returns ``{seq_id: [len(tokens), vocab] float32 logits}``.
        """
        ids, positions, slots, context_lens = [], [], [], []
        for sid, tokens in chunks.items():
            start = self.lens.get(sid, 0)
            blocks = self.blocks.setdefault(sid, [])
            for pos in range(start, start + len(tokens)):
                if pos // self.block_size >= len(blocks):
                    blocks.append(self.free.pop())
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
                positions.append(pos)
            ids += tokens
            context_lens.append(start)
            self.lens[sid] = start + len(tokens)
        step = AttentionStep(self.block_size, [len(t) for t in chunks.values()], context_lens,
                             [list(self.blocks[s]) for s in chunks], slots)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                                self.model.attention.build_metadata(step), self.caches)
            logits = self.model.compute_logits(hidden)
        qsl = step.query_start_loc
        return {sid: logits[qsl[i]:qsl[i + 1]] for i, sid in enumerate(chunks)}


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    """``transformers`` logits of one sequence, float32 ``[len, vocab]``."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def max_relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest absolute difference, relative to the largest reference magnitude."""
    return float((ours.float() - reference.float()).abs().max() / reference.float().abs().max())
