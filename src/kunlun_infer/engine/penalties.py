"""Repetition, presence and frequency penalties over the tokens each sequence has seen.

Repetition (``transformers``' definition): a token seen in the prompt or the
output has its logit divided by the penalty if positive, multiplied if
negative. Presence and frequency (OpenAI's): ``logit -= presence *
(count > 0) + frequency * count`` over the output tokens.

Only the tokens a penalized row has seen are touched: they are gathered,
penalized and put back (a pass over the whole vocabulary per term cost
~1.5 ms each at 32 rows of a 150k vocabulary). Which tokens those are, and
how often each came in the output, a :class:`Tally` per sequence keeps up to
date a step at a time: reading a whole history again every step (a list of
Python ints made a tensor, then sorted for its distinct values) cost 13 ms a
step at 32 rows of 4000 tokens, more as the contexts grow. The sampler keeps
the tallies by sequence, and a tally drops with its sequence.
"""

from __future__ import annotations

import array
import collections
from collections.abc import MutableMapping, Sequence
from typing import Any, Protocol

import torch

from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.ops.upload import upload


class TokenHistory(Protocol):
    """What the sampler reads of a sequence: its tokens so far and which of them are the prompt."""

    token_ids: list[int]
    num_prompt_tokens: int
    #: tokens that end the sequence (masked while ``min_tokens`` is not reached)
    stop_token_ids: frozenset[int]
    #: the structured-output state (``engine.structured.Constraint``) or ``None``
    constraint: Any


class Tally:
    """The distinct tokens one sequence has seen (the prompt's too, when ``with_prompt``) and how often each
    came in its output, in the order first seen.

    :meth:`follow` reads only the tokens added since the last call. A history
    that got shorter, or whose last counted token changed (tokens taken back
    and others put in their place), is counted again from its start.
    """

    __slots__ = ("_counts", "_ids", "_last", "_length", "_num_prompt", "_slots", "size", "with_prompt")

    def __init__(self, with_prompt: bool) -> None:
        self.with_prompt = with_prompt
        self._reset(-1)

    def _reset(self, num_prompt: int) -> None:
        #: distinct tokens so far
        self.size = 0
        self._slots: dict[int, int] = {}
        # fixed-size arrays (replaced, never resized, when full): the tensors torch.frombuffer makes of them
        # hold their buffers, and an array that is exported cannot resize
        self._ids = array.array("q", bytes(8 * 64))
        self._counts = array.array("f", bytes(4 * 64))
        self._length, self._last, self._num_prompt = 0, None, num_prompt

    def follow(self, history: TokenHistory) -> None:
        """Count the tokens ``history`` gained since the last call."""
        tokens, num_prompt = history.token_ids, history.num_prompt_tokens
        if (num_prompt != self._num_prompt or len(tokens) < self._length
                or (self._length and tokens[self._length - 1] != self._last)):
            self._reset(num_prompt)
        start = self._length
        if start < num_prompt:
            if self.with_prompt:
                self._add(tokens[start:num_prompt], counted=False)
            start = num_prompt
        self._add(tokens[start:], counted=True)
        self._length = len(tokens)
        self._last = tokens[-1] if tokens else None

    def _add(self, tokens: list[int], counted: bool) -> None:
        """Take in ``tokens`` (their occurrences counted when ``counted``), by dict and Counter, whose loops run
        in C: a prompt of thousands of tokens is counted in about a millisecond."""
        slots, size = self._slots, self.size
        new = [token for token in dict.fromkeys(tokens) if token not in slots]
        if new:
            end = size + len(new)
            if end > len(self._ids):
                capacity = max(end, 2 * len(self._ids))
                ids, counts = array.array("q", bytes(8 * capacity)), array.array("f", bytes(4 * capacity))
                ids[:size], counts[:size] = self._ids[:size], self._counts[:size]
                self._ids, self._counts = ids, counts
            self._ids[size:end] = array.array("q", new)
            slots.update(zip(new, range(size, end)))
            self.size = end
        if counted:
            counts = self._counts
            for token, count in collections.Counter(tokens).items():
                counts[slots[token]] += count

    def ids(self) -> torch.Tensor:
        """The distinct tokens, int64 (a view of the tally's storage: copy it before the next :meth:`follow`)."""
        return torch.frombuffer(self._ids, dtype=torch.int64, count=self.size)

    def counts(self) -> torch.Tensor:
        """How often each of :meth:`ids` came in the output, float32 (a view, as :meth:`ids`)."""
        return torch.frombuffer(self._counts, dtype=torch.float32, count=self.size)


def tally_of(history: TokenHistory, with_prompt: bool, tallies: MutableMapping[Any, Tally] | None) -> Tally:
    """``history``'s tally in ``tallies`` (a new one where it has none, or one that takes the prompt in where
    this call would not, or the other way round), brought up to date. A history that cannot key the mapping
    (unhashable, or not weakly referable for a ``WeakKeyDictionary``) gets a tally of its own for this call."""
    tally = None
    if tallies is not None:
        try:
            tally = tallies.get(history)
        except TypeError:
            tallies = None
    if tally is None or tally.with_prompt != with_prompt:
        tally = Tally(with_prompt)
        if tallies is not None:
            try:
                tallies[history] = tally
            except TypeError:
                pass
    tally.follow(history)
    return tally


def apply_penalties(logits: torch.Tensor, histories: Sequence[TokenHistory], params: Sequence[SamplingParams],
                    tallies: MutableMapping[Any, Tally] | None = None, *, in_place: bool = False) -> torch.Tensor:
    """Logits with each row's repetition, presence and frequency penalties applied: a new tensor, or with
    ``in_place`` ``logits`` itself where it is contiguous (a copy of 128 rows of a 151936-token vocabulary is 78
    MB, whose fresh pages cost a CPU more than the penalties).

    ``tallies`` keeps each history's :class:`Tally` from one call to the next
    (the sampler passes a ``WeakKeyDictionary``); without it every call counts
    the histories from their start.
    """
    device, vocab = logits.device, logits.shape[-1]
    out = logits if in_place and logits.is_contiguous() else logits.clone(memory_format=torch.contiguous_format)
    rows = []
    for i, p in enumerate(params):
        if p.has_penalties:
            tally = tally_of(histories[i], p.repetition_penalty != 1, tallies)
            if tally.size:
                rows.append((i, tally))
    if not rows:
        return out
    lengths = torch.tensor([tally.size for _, tally in rows], dtype=torch.int64)
    at = upload(torch.cat([tally.ids() + i * vocab for i, tally in rows]), device)
    counts = upload(torch.cat([tally.counts() for _, tally in rows]).to(logits.dtype), device)

    def per_row(name: str) -> torch.Tensor:
        values = torch.tensor([float(getattr(params[i], name)) for i, _ in rows], dtype=logits.dtype)
        return upload(torch.repeat_interleave(values, lengths), device)

    values = out.view(-1).index_select(0, at)
    penalty = per_row("repetition_penalty")
    values = torch.where(values > 0, values / penalty, values * penalty)
    values = values - per_row("frequency_penalty") * counts - per_row("presence_penalty") * (counts > 0)
    out.view(-1).index_copy_(0, at, values)
    return out
