"""The ``draft`` proposer: a small model sharing the tokenizer writes the drafts, through its own paged cache.

The draft model runs on the same runtime as the target, with a KV cache of
its own in the same block geometry: a sequence's block table indexes both
caches, so the draft needs no block bookkeeping of its own (the engine sizes
the blocks for both caches together). For each sequence the proposer
remembers which tokens the draft cache holds; every step it first catches
up on the tokens it has not seen (the prompt the first time, then the tokens
the target kept), then writes the drafts one token at a time, all sequences
in one batch per token. A greedy request gets the draft model's argmax; a
sampled one a draw from the draft model's distribution (same temperature and
filters), which :func:`kunlun_infer.engine.speculative.verify` corrects
exactly. When the target takes tokens back, or a sequence loses its blocks
(preemption), what the draft cache held for it is recomputed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from kunlun_infer.engine.model_runner import ModelRunner, build_step_inputs
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.sampler import Sampler, draw_row
from kunlun_infer.engine.sequence import Sequence
from kunlun_infer.engine.step_graph import step_graphs
from kunlun_infer.errors import ConfigError
from kunlun_infer.models import load_model, load_model_config


@dataclasses.dataclass
class _View:
    """A sequence as the draft model's step sees it: the draft cache's progress, the shared block table."""

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    params: Any
    num_prompt_tokens: int

    def __len__(self) -> int:
        return len(self.token_ids)


class _NoPromptLogprobs:
    prompt_logprobs = None


@dataclasses.dataclass
class _Known:
    """What the draft cache holds for one sequence: KV of ``tokens``, in the blocks ``blocks`` began with."""

    tokens: list[int]
    blocks: list[int]


class DraftModelProposer:
    """Drafts from a small model (see module docstring). Build with :meth:`load`."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, block_size: int) -> None:
        self.runner = runner
        self.sampler = sampler
        self.block_size = block_size
        self._known: dict[int, _Known] = {}

    @classmethod
    def load(cls, path: str | Path, *, runtime: Any, dtype: torch.dtype, max_model_len: int, block_size: int,
             vocab_size: int, seed: int) -> DraftModelProposer:
        """The draft model in ``path``, checked against the target's vocabulary; its cache is not allocated yet."""
        config = load_model_config(Path(path))
        if int(config.vocab_size) != int(vocab_size):
            raise ConfigError(f"speculative.draft_model={path} has a vocabulary of {config.vocab_size} tokens, the "
                              f"model {vocab_size}: a draft model must share the model's tokenizer")
        if config.max_context_len < max_model_len:
            raise ConfigError(f"speculative.draft_model={path} reaches {config.max_context_len} tokens, fewer than "
                              f"model.max_model_len={max_model_len}; lower model.max_model_len")
        model = load_model(path, runtime=runtime, dtype=dtype, max_model_len=max_model_len)
        device = runtime.device.torch_device
        sampler = Sampler.for_runtime(runtime, torch.Generator(device=device).manual_seed(seed))
        runner = ModelRunner(model, device=device, block_size=block_size, sampler=sampler, memory=runtime.memory)
        # one rank (see load_proposer): its one-token drafting steps may replay captures
        runner.graphs = step_graphs(runtime, model, max_model_len=max_model_len, block_size=block_size)
        return cls(runner, sampler, block_size)

    @property
    def bytes_per_block(self) -> int:
        return self.runner.layout.bytes_per_block

    def weight_nbytes(self) -> int:
        return int(self.runner.model.weight_nbytes())

    def allocate(self, num_blocks: int) -> None:
        """The draft cache, in the target's number of blocks."""
        self.runner.resize_kv_cache(num_blocks)

    def close(self) -> None:
        self.runner.release_kv_cache()
        self._known.clear()

    def forget(self, seq: Sequence) -> None:
        self._known.pop(seq.seq_id, None)

    # ------------------------------------------------------------------ proposing

    def _views(self, seqs: list[Sequence]) -> list[_View]:
        views = []
        for seq in seqs:
            known = self._known.get(seq.seq_id)
            valid = 0
            if known is not None and seq.block_table[:len(known.blocks)] == known.blocks:
                valid = min(len(known.tokens), len(seq.token_ids))
                while valid and seq.token_ids[:valid] != known.tokens[:valid]:  # tokens the target took back
                    valid -= 1
            # at least the last token goes through the draft model: its logits give the first draft
            valid = min(valid, len(seq.token_ids) - 1)
            views.append(_View(seq.seq_id, list(seq.token_ids), valid, seq.block_table, _NoPromptLogprobs,
                               seq.num_prompt_tokens))
        return views

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        views = self._views(seqs)
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for _ in range(max(num_tokens)):
            active = [i for i in active if len(drafts[i]) < num_tokens[i]]
            if not active:
                break
            batch = [views[i] for i in active]
            counts = [len(v.token_ids) - v.num_computed_tokens for v in batch]
            inputs = build_step_inputs(batch, counts, self.block_size, self.runner.device)  # type: ignore[arg-type]
            logits = self.runner.compute(inputs)
            for j, i in enumerate(active):
                view, seq = views[i], seqs[i]
                view.num_computed_tokens = len(view.token_ids)
                token, dist = self._draw(logits[j:j + 1], seq.params, seq.generator)
                drafts[i].append(token)
                if dist is not None:
                    probs[i].append(dist)
                view.token_ids.append(token)
        for i, seq in enumerate(seqs):
            view = views[i]
            # the draft cache holds every token but the last draft
            self._known[seq.seq_id] = _Known(view.token_ids[:view.num_computed_tokens],
                                             list(seq.block_table[:-(-view.num_computed_tokens // self.block_size)]))
        return [(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]

    def _draw(self, logits: torch.Tensor, params: SamplingParams,
              generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
        if params.greedy:
            return int(self.sampler.greedy(logits)), None
        dist = self.sampler.distribution(logits, [params])[0]
        token = draw_row(dist, generator if generator is not None else self.sampler.generator)
        return token, dist
