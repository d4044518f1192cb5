"""The engine's record of one sample of a request: its sequence, text, logprobs and timings.

The scheduler only sees the :class:`Sequence`; everything a user gets back
(streamed text, logprobs, metrics) is kept here and turned into a fresh
:class:`RequestOutput` snapshot whenever the sample progresses. The samples
of one request are kept together by ``engine/sample_group.py``.
"""

from __future__ import annotations

import time

from kunlun_infer.engine.detokenizer import Decoder, IncrementalDetokenizer
from kunlun_infer.engine.outputs import FinishReason, RequestMetrics, RequestOutput
from kunlun_infer.engine.sequence import Sequence
from kunlun_infer.engine.stopping import stop_reason


class RequestState:
    """Everything the engine tracks about one sample besides its place in the queues.

    ``prompt_logprobs`` is the request's list (shared by its samples), or
    ``None`` when not asked for.
    """

    def __init__(self, seq: Sequence, prompt: str | None, decoder: Decoder | None,
                 prompt_logprobs: list[dict[int, float] | None] | None = None) -> None:
        self.seq = seq
        self.prompt = prompt
        self.prompt_token_ids = seq.token_ids[:seq.num_prompt_tokens]
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.detokenizer = (IncrementalDetokenizer(decoder, seq.token_ids, tuple(seq.params.stop))
                            if decoder is not None else None)
        self.logprobs: list[dict[int, float]] | None = [] if seq.params.logprobs is not None else None
        self.prompt_logprobs = prompt_logprobs
        #: why a failed step ended this request (``None`` otherwise)
        self.error: str | None = None

    def mark_scheduled(self, now: float) -> None:
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = now

    def add_token(self, token_id: int, logprobs: dict[int, float] | None, now: float) -> FinishReason | None:
        """Append a token sampled for the sequence; why it ends the sequence (``None``: it goes on)."""
        self.seq.append_token(token_id)
        m = self.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.num_generated_tokens += 1
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        if self.detokenizer is not None:
            self.detokenizer.add_tokens([token_id])
        return stop_reason(self.seq, self.detokenizer)

    def pass_over(self) -> None:
        """Move past this step's text without building an output (a final-only request): the text counts as
        handed out as in a streamed one, so stop strings are looked for in the same text either way (one
        within ``min_tokens`` stays text)."""
        if self.detokenizer is not None:
            self.detokenizer.emit()

    def output(self, now: float) -> RequestOutput:
        """A snapshot for the user; on the final one the held-back text is released."""
        seq = self.seq
        finished = seq.is_finished
        if finished and self.metrics.finished_time is None:
            self.metrics.finished_time = now
        delta, text = "", ""
        if self.detokenizer is not None:
            delta = self.detokenizer.emit(final=finished)
            text = self.detokenizer.text[:self.detokenizer.num_emitted]
        return RequestOutput(
            request_id=seq.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=seq.generated_token_ids,
            text=text,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,  # type: ignore[arg-type]
            metrics=_copy_metrics(self.metrics),
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            delta_text=delta,
            num_cached_tokens=seq.num_cached_tokens,
            index=seq.index,
            error=self.error,
        )


def _copy_metrics(m: RequestMetrics) -> RequestMetrics:
    return RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time,
                          m.finished_time, m.num_generated_tokens)
