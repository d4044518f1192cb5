"""Run one scheduled step through the model: build the flat batch, forward, sample.

Every sequence's new tokens are laid end to end in one flat batch; the
per-token tensors (positions, KV slots, which row belongs to which sequence)
are computed with a handful of tensor ops from per-sequence numbers, not a
loop over tokens. Only sequences whose known tokens are all computed after
this step (a finished prompt, a decode) send their last hidden state through
the LM head and the sampler; a prompt chunk in the middle just fills the
cache. A request asking for ``prompt_logprobs`` also sends the rows that
score its prompt through the LM head, chunk by chunk (see
``engine/prompt_logprobs.py``). A sampled row can be drawn from by more
sequences than its own (``co_samples``: the samples of an ``n > 1`` request
drawing their first token from its prompt, see ``engine/sample_group.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from kunlun_infer.engine.kv_cache import KVCaches
from kunlun_infer.engine.prompt_logprobs import (PromptSpan, ScoredPrompt, gather_prompt_logprobs, prompt_spans,
                                                span_indices)
from kunlun_infer.engine.sampler import Sampler
from kunlun_infer.engine.scheduler import ScheduledBatch
from kunlun_infer.engine.sequence import Sequence


@dataclasses.dataclass
class StepInputs:
    """The model's inputs for one step, on the device, and which batch rows are sampled."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: object  # layers.attention.AttentionMetadata
    logits_indices: torch.Tensor
    sample_rows: list[int]
    #: rows scoring prompt tokens for ``prompt_logprobs``; their logits follow the sampled rows' in order
    prompt_spans: list[PromptSpan] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SampledToken:
    """A token drawn for ``seq`` in this step and, when it asked for them, the logprobs of that draw."""

    seq: Sequence
    token_id: int
    logprobs: dict[int, float] | None


@dataclasses.dataclass
class StepResult:
    """What a step produced for each sequence: the tokens drawn, and the prompt logprobs scored."""

    #: in batch order, a sequence's co-samples right after it
    sampled: list[SampledToken] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[ScoredPrompt] = dataclasses.field(default_factory=list)


def build_step_inputs(seqs: list[Sequence], num_new_tokens: list[int], block_size: int,
                      device: torch.device) -> StepInputs:
    """The flat batch for ``seqs`` computing ``num_new_tokens`` tokens each (host work, then one copy)."""
    from kunlun_infer.layers.attention import AttentionMetadata

    starts = [s.num_computed_tokens for s in seqs]
    input_ids: list[int] = []
    for seq, start, n in zip(seqs, starts, num_new_tokens):
        input_ids.extend(seq.token_ids[start:start + n])
    num_tokens = len(input_ids)
    new = torch.tensor(num_new_tokens, dtype=torch.int64)
    start_t = torch.tensor(starts, dtype=torch.int64)
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    torch.cumsum(new, 0, out=query_start_loc[1:])
    seq_lens = start_t + new
    row_of_token = torch.repeat_interleave(torch.arange(len(seqs)), new, output_size=num_tokens)
    positions = torch.arange(num_tokens) + (start_t - query_start_loc[:-1]).index_select(0, row_of_token)
    width = max(len(s.block_table) for s in seqs)
    block_tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                                dtype=torch.int32)
    blocks = block_tables[row_of_token, positions // block_size].to(torch.int64)
    slot_mapping = blocks * block_size + positions % block_size
    sample_rows = [i for i, s in enumerate(seqs) if starts[i] + num_new_tokens[i] == len(s)]
    logits_indices = query_start_loc[1:].index_select(0, torch.tensor(sample_rows, dtype=torch.int64)) - 1
    spans = prompt_spans(seqs, starts, num_new_tokens)
    if spans:
        logits_indices = torch.cat([logits_indices, span_indices(spans, query_start_loc)])
    attn = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_tables=block_tables.to(device),
        seq_lens=seq_lens.to(torch.int32).to(device),
        query_start_loc=query_start_loc.to(torch.int32).to(device),
        max_query_len=max(num_new_tokens),
        max_seq_len=max(s + n for s, n in zip(starts, num_new_tokens)),
        is_decode_only=num_tokens == len(seqs),
    )
    return StepInputs(torch.tensor(input_ids, dtype=torch.int64).to(device), positions.to(device), attn,
                      logits_indices.to(device), sample_rows, spans)


class ModelRunner:
    """Owns the model, its KV caches and the sampler; turns a scheduled batch into sampled tokens."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device, block_size: int, sampler: Sampler) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.sampler = sampler
        self.kv_caches: KVCaches = []

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, co_samples: Mapping[int, list[Sequence]] | None = None) -> StepResult:
        """Forward the batch and sample every sequence whose known tokens are now all computed.

        ``co_samples[seq_id]``: sequences that draw a token from the logits of
        the sequence with that id, when it is sampled, besides itself. Each
        draw uses the drawing sequence's params, history and ``generator``.
        """
        inputs = build_step_inputs(batch.seqs, batch.num_new_tokens, self.block_size, self.device)
        logits = self.compute(inputs)
        if logits is None:
            return StepResult()
        rows = inputs.sample_rows
        result = StepResult(prompt_logprobs=gather_prompt_logprobs(logits[len(rows):], batch.seqs,
                                                                   inputs.prompt_spans))
        if not rows:
            return result
        draws: list[Sequence] = []
        logits_rows: list[int] = []
        for j, i in enumerate(rows):
            seq = batch.seqs[i]
            drawing = [seq, *(co_samples or {}).get(seq.seq_id, ())]
            draws += drawing
            logits_rows += [j] * len(drawing)
        logits = logits[:len(rows)]
        if len(draws) > len(rows):
            logits = logits.index_select(0, torch.tensor(logits_rows, device=logits.device))
        out = self.sampler(logits, [s.params for s in draws], [s.generator for s in draws], draws)
        result.sampled = [SampledToken(*draw) for draw in zip(draws, out.token_ids, out.logprobs)]
        return result

    def compute(self, inputs: StepInputs) -> torch.Tensor | None:
        """Forward the flat batch; the logits of the rows in ``logits_indices`` (``None`` when there are none).

        Tensor-parallel ranks other than 0 call this alone (they do not sample).
        """
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn, self.kv_caches)
        if inputs.logits_indices.numel() == 0:
            return None
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
