"""A request's ``n`` samples: the prompt computed once, then ``n`` sequences that each go their own way.

The engine keeps one :class:`SampleGroup` per request (``n = 1`` included).
At first the scheduler sees only the group's *leader* (sample 0): it holds a
batch slot for every sample (``Sequence.num_slots``), so the group is
admitted whole, and it computes the prompt. The other samples wait
(``PENDING_FORK``). When the leader's prompt logits are sampled, each
waiting sample draws its first token from those same logits with its own
generator (:meth:`SampleGroup.co_samples` names them to the model runner)
and is forked off the leader (:meth:`Scheduler.fork`): it takes the leader's
full prompt blocks by reference and recomputes only the partly filled last
one. From then on every sample is an ordinary sequence: it decodes, is
preempted and resumed, and stops on its own. The group is finished when its
last sample is; an abort ends them all. The samples share the prompt's
``prompt_logprobs``, scored once.

Sample ``i`` of a seeded request draws from its own stream: sample 0 from
``seed`` itself (so ``n = 1`` and sample 0 of ``n > 1`` agree), the others
from seeds spread from it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kunlun_infer.engine.detokenizer import Decoder
from kunlun_infer.engine.outputs import RequestOutput
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.request_state import RequestState
from kunlun_infer.engine.scheduler import Scheduler
from kunlun_infer.engine.sequence import Sequence, SequenceStatus

#: odd 64-bit constant (the golden ratio's) spreading the seeds of a request's samples apart
_SEED_STRIDE = 0x9E3779B97F4A7C15


class SampleGroup:
    """Every sample of one request and the engine's record of each (:class:`RequestState`)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 seq_ids: Iterator[int], *, eos_token_ids: tuple[int, ...], decoder: Decoder | None,
                 device: torch.device, final_only: bool = False) -> None:
        self.request_id = request_id
        #: outputs only when a sample finishes (no snapshot per token)
        self.final_only = final_only
        #: one entry per prompt token, filled as prompt chunks are computed (when asked)
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None)
        #: every sample, in index order
        self.samples: list[RequestState] = []
        for index in range(params.n):
            seq = Sequence(next(seq_ids), request_id, prompt_token_ids, params, eos_token_ids, index=index,
                           generator=_sample_generator(params.seed, index, device))
            self.samples.append(RequestState(seq, prompt, decoder, self.prompt_logprobs))
        self.leader.num_slots = params.n
        #: samples waiting for the leader's prompt, forked off it when its logits are sampled
        self.pending = [state.seq for state in self.samples[1:]]
        for seq in self.pending:
            seq.status = SequenceStatus.PENDING_FORK
        self._num_unfinished = params.n

    @property
    def leader(self) -> Sequence:
        """The sample that computes the prompt; the one to hand to the scheduler."""
        return self.samples[0].seq

    @property
    def finished(self) -> bool:
        return self._num_unfinished == 0

    def co_samples(self, seq: Sequence) -> list[Sequence]:
        """The samples that draw a token from ``seq``'s logits along with it: the waiting ones, from the leader's."""
        return self.pending if seq is self.leader else []

    def mark_scheduled(self, now: float) -> None:
        """The group's prompt is being computed: none of its samples is queued any more."""
        for state in self.samples:
            state.mark_scheduled(now)

    def add_prompt_logprobs(self, first: int, entries: list[dict[int, float]]) -> None:
        """Record the logprobs of prompt tokens ``first ..``; positions already known (a recompute) stay."""
        known = self.prompt_logprobs
        if known is None:
            return
        for position, entry in enumerate(entries, first):
            if known[position] is None:
                known[position] = entry

    def add_token(self, seq: Sequence, token_id: int, logprobs: dict[int, float] | None, now: float,
                  scheduler: Scheduler) -> RequestOutput | None:
        """Record a token drawn for sample ``seq``, finish it if it stops there; the sample's new output
        (``None`` for a final-only request whose sample goes on).

        The leader's first token forks the waiting samples off it first,
        while it still holds its prompt blocks (it may stop at once).
        """
        if seq is self.leader and self.pending:
            for sample in self.pending:
                scheduler.fork(seq, sample)
            self.pending = []
        state = self.samples[seq.index]
        reason = state.add_token(token_id, logprobs, now)
        if reason is not None:
            scheduler.finish(seq, reason)
            self._num_unfinished -= 1
        elif self.final_only:
            state.pass_over()
            return None
        return state.output(now)

    def abort(self, scheduler: Scheduler, now: float, error: str | None = None) -> list[RequestOutput]:
        """End every unfinished sample with ``"abort"`` (and ``error``), freeing its blocks; their outputs."""
        outputs = []
        for state in self.samples:
            if state.seq.is_finished:
                continue
            scheduler.finish(state.seq, "abort")
            state.error = error
            outputs.append(state.output(now))
        self.pending = []
        self._num_unfinished = 0
        return outputs


def _sample_generator(seed: int | None, index: int, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed((seed + index * _SEED_STRIDE) % 2**63)
