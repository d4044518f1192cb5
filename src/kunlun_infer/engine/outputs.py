"""What a request gets back: :class:`RequestOutput` snapshots and their timing metrics.

The engine hands out a fresh snapshot each time a request progresses, so an
application may keep old outputs while generation continues. ``text`` only
ever grows between snapshots of one request (partial UTF-8 characters and
possible beginnings of a stop string are held back), and ``delta_text`` is
what it grew by in that step — exactly what a streaming client prints.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.monotonic`` seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean seconds between generated tokens after the first (``None`` with fewer than two)."""
        if self.num_generated_tokens < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival until the request was first scheduled."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    """The state of one request after a step.

    ``token_ids``: every token generated so far (a stop token that ended the
    request is included). ``text``: their detokenized text, without a stop
    string that ended it. ``logprobs``: when asked, one ``{token_id:
    logprob}`` dict per generated token, holding the chosen token and the
    ``logprobs`` most likely ones. ``prompt_logprobs``: when asked, one entry
    per prompt token, aligned with ``prompt_token_ids``: ``None`` for the
    first, then ``{token_id: logprob}`` with the actual prompt token and the
    ``prompt_logprobs`` most likely ones, given the tokens before it.
    ``finish_reason`` is ``None`` while
    running, then ``"stop"``, ``"length"`` or ``"abort"``. ``index`` says
    which of a request's ``n`` samples this is (each has its own outputs).
    ``error`` is ``None`` unless a failed step ended the request (then
    ``finish_reason`` is ``"abort"``): it says what failed, naming the
    plugin, hook and layer at fault.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    delta_text: str = ""
    num_cached_tokens: int = 0
    index: int = 0
    error: str | None = None
