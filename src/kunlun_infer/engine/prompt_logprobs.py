"""Prompt logprobs: which rows of a step's flat batch score the prompt, and their logprobs.

A sequence asking for ``prompt_logprobs`` has every prompt row it computes
(whichever prefill chunk it falls in) sent through the LM head as well: the
hidden state at prompt position ``q`` gives the distribution of the token at
``q + 1``, so a chunk covering positions ``[start, start + n)`` scores the
prompt tokens ``start + 1 .. min(start + n, num_prompt_tokens - 1)``. The
last prompt position is the row that samples the first generated token and
is not a prompt logprob. The scored rows of a step go through
``log_softmax``, a ``gather`` of the actual tokens and a ``topk``
:data:`SCORE_ROWS` rows at a time, so that a long prompt's float32
log-probabilities over the vocabulary are never all held at once beside its
logits (2048 rows of a 151936-token vocabulary: 1.2 GB, against 155 MB a
slice).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

import torch

from kunlun_infer.engine.sequence import Sequence

#: scored rows whose log-probabilities are worked out at a time (see the top)
SCORE_ROWS = 256


@dataclasses.dataclass(frozen=True)
class PromptSpan:
    """Batch row ``row`` scores the prompt tokens at positions ``first .. first + count - 1``."""

    row: int
    first: int
    count: int


def prompt_spans(seqs: Seq[Sequence], starts: Seq[int], num_new_tokens: Seq[int]) -> list[PromptSpan]:
    """The prompt tokens each asking sequence scores in this step (rows with none are left out)."""
    spans = []
    for row, (seq, start, n) in enumerate(zip(seqs, starts, num_new_tokens)):
        if seq.params.prompt_logprobs is None:
            continue
        end = min(start + n, seq.num_prompt_tokens - 1)
        if end > start:
            spans.append(PromptSpan(row, start + 1, end - start))
    return spans


def span_indices(spans: list[PromptSpan], row_starts: torch.Tensor) -> torch.Tensor:
    """Flat-batch indices (int64) of the hidden states that score ``spans``, in span order.

    ``row_starts[r]``: where batch row ``r``'s new tokens start in the flat batch.
    """
    if not spans:
        return torch.zeros(0, dtype=torch.int64)
    counts = torch.tensor([s.count for s in spans], dtype=torch.int64)
    # row r's first scoring hidden state is its own first new token: row_starts[r]
    offsets = row_starts.index_select(0, torch.tensor([s.row for s in spans], dtype=torch.int64))
    total = int(counts.sum())
    span_of = torch.repeat_interleave(torch.arange(len(spans)), counts, output_size=total)
    first_of_span = torch.cumsum(counts, 0) - counts
    return offsets.index_select(0, span_of) + torch.arange(total) - first_of_span.index_select(0, span_of)


@dataclasses.dataclass
class ScoredPrompt:
    """``logprobs[k]`` is ``{token_id: logprob}`` for the prompt token of ``seq`` at position ``first + k``."""

    seq: Sequence
    first: int
    logprobs: list[dict[int, float]]


def gather_prompt_logprobs(logits: torch.Tensor, seqs: Seq[Sequence], spans: list[PromptSpan]) -> list[ScoredPrompt]:
    """The prompt tokens each span scored, with their logprobs, span by span.

    ``logits`` holds the rows of ``spans`` end to end. Each dict has the
    actual prompt token and the row's ``prompt_logprobs`` most likely ones.
    """
    if not spans:
        return []
    targets = [t for s in spans for t in seqs[s.row].token_ids[s.first:s.first + s.count]]
    target_ids = torch.tensor(targets, dtype=torch.int64, device=logits.device)
    widths = [int(seqs[s.row].params.prompt_logprobs) for s in spans]  # type: ignore[arg-type]
    width = max(widths)
    chosen: list[float] = []
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    for start in range(0, len(targets), SCORE_ROWS):
        logprobs = torch.log_softmax(logits[start:start + SCORE_ROWS].float(), dim=-1)
        chosen += logprobs.gather(1, target_ids[start:start + SCORE_ROWS].unsqueeze(1)).squeeze(1).tolist()
        values, ids = logprobs.topk(width, dim=-1) if width else (logprobs[:, :0], logprobs[:, :0])
        top_values += values.tolist()
        top_ids += ids.tolist()
    result = []
    k = 0
    for span, n in zip(spans, widths):
        entries = []
        for j in range(k, k + span.count):
            entry = dict(zip(top_ids[j][:n], top_values[j][:n]))
            entry[targets[j]] = chosen[j]
            entries.append(entry)
        result.append(ScoredPrompt(seqs[span.row], span.first, entries))
        k += span.count
    return result
