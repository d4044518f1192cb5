"""Continuous batching: which sequences run this step, and how many tokens each.

Two queues. ``running`` sequences go first, oldest first: each gets its
decode token or its next prefill chunk. Then ``waiting`` sequences join,
first come first served, while there is room in ``max_num_seqs``, in the
step's token budget (``max_num_batched_tokens``) and in the KV cache; a
prompt longer than what is left of the budget is cut into chunks, so prefill
chunks and decodes share one step. When a running sequence cannot get a KV
block, the newest running sequence is preempted: its blocks are freed and it
goes back to the front of ``waiting``, to be recomputed when it resumes
(its cached prefix blocks often make that cheap).

With pipeline stages several batches are in flight at once: a sequence
whose step has not come back (``busy``) is neither scheduled nor preempted,
and each batch takes at most its share of the sequences (``max_seqs``).

A sequence is admitted only with room for all the batch slots it holds
(``Sequence.num_slots``): those of the sequences to be forked off it later
(the samples of an ``n > 1`` request, see ``engine/sample_group.py``). A
:meth:`Scheduler.fork` puts such a sequence into ``running`` on its
parent's computed blocks, in one of the parent's slots.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from collections.abc import Callable, Set

from kunlun_infer.engine.block_manager import BlockManager
from kunlun_infer.engine.sequence import Sequence, SequenceStatus


@dataclasses.dataclass
class ScheduledBatch:
    """One step's work: ``seqs[i]`` computes ``num_new_tokens[i]`` tokens from its ``num_computed_tokens``."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class Scheduler:
    """Decides each step's batch and keeps the running/waiting queues."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        #: kept sorted by ``seq_id`` (arrival order)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0
        self.prefix_cache_query_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        """Whether the first waiting sequence has a batch slot to take (KV blocks aside)."""
        return bool(self.waiting) and self._num_slots_taken() + self.waiting[0].num_slots <= self.max_num_seqs

    # ------------------------------------------------------------------ scheduling

    def schedule(self, busy: Set[int] = frozenset(), max_seqs: int | None = None) -> ScheduledBatch:
        """Pick this step's sequences and token counts, allocating their KV blocks.

        ``busy``: ids of sequences whose last step is still running (a
        pipeline's batches in flight): they are neither scheduled nor
        preempted. ``max_seqs``: at most this many sequences in the batch.
        """
        batch = ScheduledBatch([], [])
        budget = self.max_num_batched_tokens
        max_seqs = self.max_num_seqs if max_seqs is None else max_seqs
        preemptions_before = self.num_preemptions
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.seq_id in busy:
                continue  # preempted earlier in this loop, or still in flight
            if budget <= 0 or len(batch) >= max_seqs:
                break
            num_new = min(seq.num_uncomputed_tokens, budget) if self.chunked_prefill else seq.num_uncomputed_tokens
            if self._reserve_or_preempt(seq, num_new, busy):
                self._add_to_batch(batch, seq, num_new)
                budget -= num_new
        if self.num_preemptions == preemptions_before:  # no room was short: let newcomers in
            self._admit_waiting(batch, budget, max_seqs)
        return batch

    def schedule_behind(self, busy: Set[int], admit: Callable[[Sequence], bool]) -> ScheduledBatch | None:
        """The step to launch while the one before is still on the device (``engine/overlap.py``): as
        :meth:`schedule`, but it never preempts (a sequence in flight cannot be recomputed yet), so ``None``
        when a running sequence finds no free KV block (the blocks it took stay with their sequences), or when
        nothing is to run. ``busy``: running sequences left out (those the step in flight ends); waiting
        sequences join first come first served while ``admit`` accepts them."""
        bm, size, chunked = self.block_manager, self.block_manager.block_size, self.chunked_prefill
        seqs: list[Sequence] = []
        counts: list[int] = []
        budget, prefill, max_seqs = self.max_num_batched_tokens, 0, self.max_num_seqs
        for seq in self.running:  # (as _add_to_batch, inline: this runs for every sequence of every step)
            if seq.seq_id in busy:
                continue
            if budget <= 0 or len(seqs) >= max_seqs:
                break
            computed = seq.num_computed_tokens
            num_new = len(seq.token_ids) - computed
            if chunked and num_new > budget:
                num_new = budget
            if computed + num_new > len(seq.block_table) * size:  # (a decode mostly has room)
                if not bm.can_allocate(seq, num_new):
                    return None
                bm.allocate(seq, num_new)
            seqs.append(seq)
            counts.append(num_new)
            if computed < seq.num_prompt_tokens:
                prefill += num_new
            budget -= num_new
        batch = ScheduledBatch(seqs, counts, prefill, sum(counts) - prefill)
        self._admit_waiting(batch, budget, admit=admit)
        return batch if batch.seqs else None

    def _reserve_or_preempt(self, seq: Sequence, num_new: int, busy: Set[int] = frozenset()) -> bool:
        """Allocate blocks for ``seq``, preempting newer sequences; False if ``seq`` itself was preempted
        (or only sequences in flight could make room: ``seq`` waits for them)."""
        while not self.block_manager.can_allocate(seq, num_new):
            victim = next((s for s in reversed(self.running) if s.seq_id not in busy), None)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, num_new)
        return True

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, max_seqs: int | None = None,
                       admit: Callable[[Sequence], bool] | None = None) -> None:
        bm = self.block_manager
        max_seqs = self.max_num_seqs if max_seqs is None else max_seqs
        while self.waiting and budget > 0 and len(batch) < max_seqs:
            seq = self.waiting[0]
            if self._num_slots_taken() + seq.num_slots > self.max_num_seqs or (admit is not None and not admit(seq)):
                break
            prefix = bm.match_prefix(seq)
            num_new = len(seq) - len(prefix) * bm.block_size
            if num_new > budget:
                if not self.chunked_prefill:
                    break
                num_new = budget
            if not bm.can_allocate(seq, num_new, prefix):
                break
            self.waiting.popleft()
            bm.take_prefix(seq, prefix)
            bm.allocate(seq, num_new)
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_cache_hit_tokens += seq.num_computed_tokens
            self.prefix_cache_query_tokens += len(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.seq_id)
            self._add_to_batch(batch, seq, num_new)
            budget -= num_new

    def _num_slots_taken(self) -> int:
        """Running sequences plus the sequences still to be forked off them."""
        return sum(seq.num_slots for seq in self.running)

    @staticmethod
    def _add_to_batch(batch: ScheduledBatch, seq: Sequence, num_new: int) -> None:
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        if seq.num_computed_tokens >= seq.num_prompt_tokens:  # a decode (with any speculative drafts)
            batch.num_decode_tokens += num_new
        else:
            batch.num_prefill_tokens += num_new

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ------------------------------------------------------------------ after the model ran

    def update(self, batch: ScheduledBatch) -> None:
        """Record the step's computed tokens (the sampled ones are appended, and judged, by the engine)."""
        self.advance(batch)
        for seq in batch.seqs:
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.commit(seq)

    def advance(self, batch: ScheduledBatch) -> None:
        """Count the step's tokens as computed, without registering their blocks in the prefix cache (a launched
        step, whose input tokens may not be known on the host yet: ``engine/overlap.py`` commits them later)."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            if seq.status is SequenceStatus.RUNNING:  # not aborted while the step ran
                seq.num_computed_tokens += num_new

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run ``child`` (a fresh sequence of ``parent``'s prompt) from ``parent``'s full computed blocks.

        It takes one of the slots ``parent`` held for it (``num_slots``).
        """
        self.block_manager.fork(parent, child)
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = SequenceStatus.RUNNING
        parent.num_slots -= 1
        bisect.insort(self.running, child, key=lambda s: s.seq_id)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (``"stop"``, ``"length"`` or ``"abort"``) and return its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
