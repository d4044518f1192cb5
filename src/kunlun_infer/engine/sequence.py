"""One request's token stream as the scheduler and block manager see it.

A sequence holds its tokens (prompt, then generated), how many of them
already have K/V in the cache (``num_computed_tokens``), and the KV blocks
that hold them. Prefill, a prefill chunk, a decode step and a recompute after
preemption are all the same thing here: compute the tokens from
``num_computed_tokens`` on; when that reaches the end, sample the next one.

The samples of an ``n > 1`` request are sequences of their own; how they
share the prompt is ``engine/sample_group.py``'s business. Here a sequence
only says how many batch slots it holds (``num_slots``: its own, plus one
for each sequence still to be forked off it) and which random stream it
draws from (``generator``).
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from kunlun_infer.engine.params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    #: a sample of an ``n > 1`` request waiting to be forked off the sample computing the prompt
    PENDING_FORK = "pending_fork"


class Sequence:
    """A request's tokens, progress and KV blocks.

    ``seq_id`` is given by the engine and grows with arrival order; the
    scheduler uses it for first-come-first-served order and to pick the
    newest sequence to preempt.
    """

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), *, index: int = 0,
                 generator: torch.Generator | None = None) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        #: which of the request's ``n`` samples this is
        self.index = index
        #: the request's own random stream for this sample (``None``: the engine's shared one)
        self.generator = generator
        #: batch slots held in ``scheduler.max_num_seqs``: this sequence's, plus those to be forked off it
        self.num_slots = 1
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        #: KV block ids holding this sequence's tokens, in order
        self.block_table: list[int] = []
        #: chain hashes of this sequence's full blocks registered so far (prefix caching)
        self.block_hashes: list[int] = []
        #: prompt tokens found in the prefix cache when first scheduled
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        #: the structured-output state of this sample (``engine.structured.Constraint``), if it asked for one
        self.constraint: Any = None
        self.stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids))

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={len(self)}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)}, {self.status.value})")

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Add a sampled token (whether it ends the sequence is decided in ``engine/stopping.py``)."""
        self.token_ids.append(token_id)
