"""One request's token stream as the scheduler and block manager see it.

A sequence holds its tokens (prompt, then generated), how many of them
already have K/V in the cache (``num_computed_tokens``), and the KV blocks
that hold them. Prefill, a prefill chunk, a decode step and a recompute after
preemption are all the same thing here: compute the tokens from
``num_computed_tokens`` on; when that reaches the end, sample the next one.

A request for ``n`` samples is one sequence whose ``forks`` (the other
``n - 1`` samples, ``PENDING_FORK``) wait for its prompt: when the prompt's
logits are sampled, the scheduler forks them off it, sharing its KV blocks.
"""

from __future__ import annotations

import enum

from kunlun_infer.engine.params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    #: a sample of an ``n > 1`` request waiting for its parent's prompt to be computed
    PENDING_FORK = "pending_fork"


class Sequence:
    """A request's tokens, progress and KV blocks.

    ``seq_id`` is given by the engine and grows with arrival order; the
    scheduler uses it for first-come-first-served order and to pick the
    newest sequence to preempt.
    """

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), index: int = 0) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        #: which of the request's ``n`` samples this is
        self.index = index
        #: samples to fork off this sequence once its prompt is computed (see module docstring)
        self.forks: list[Sequence] = []
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

    def add_fork(self, child: Sequence) -> None:
        """Make ``child`` (same prompt and params) wait to be forked off this sequence."""
        child.status = SequenceStatus.PENDING_FORK
        self.forks.append(child)

    def append_token(self, token_id: int) -> None:
        """Add a sampled token (whether it ends the sequence is decided in ``engine/stopping.py``)."""
        self.token_ids.append(token_id)
