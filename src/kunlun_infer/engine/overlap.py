"""Overlapped decode steps: the host prepares the next step while the device runs this one.

On a device whose kernels run after their launch returns (``Streams.asynchronous``,
hook API 1.7: a GPU), a synchronous step leaves the device idle while the
host schedules, builds inputs and records tokens: at batch 1 on a fast GPU
that is a third of the step. With ``scheduler.overlap_steps`` the engine
instead:

1. launches a decode step and keeps it in flight: its drawn tokens stay on
   the device and are copied back without blocking; each sequence holds a
   placeholder (:data:`PLACEHOLDER`) where its token will go, and its
   computed-token count moves on;
2. at the next step, schedules the same sequences for one more token
   (:meth:`Scheduler.schedule_decodes`, which never preempts) and launches
   that step at once, its input tokens taken on the device from the step in
   flight's tokens;
3. only then waits for the step in flight's tokens (not for the step just
   queued behind it), puts them in place of the placeholders and records
   them as any step does: stop tokens and strings, outputs, finished
   requests.

A sequence that stopped in step 1 still computed one more token in step 2,
which is dropped (its blocks are freed at once: the device runs the queued
step before any later one that reuses them). Sequences that reach
``max_tokens`` in step 1 are known on the host and left out of step 2.

Only plain decodes overlap: a sequence asking for logprobs, penalties or
structured output, a step with prompt tokens, drafts or co-samples, or
another request waiting to be admitted makes the engine take the step in
flight back first and run the step as before (and launch the next decode
step again). Seeded sampling draws the same tokens either way; so does
greedy decoding. A failure in either step ends the requests of both.
"""

from __future__ import annotations

from kunlun_infer.engine.scheduler import ScheduledBatch
from kunlun_infer.engine.sequence import Sequence

#: stands in a sequence's ``token_ids`` for a token drawn by a step still in flight (never a real token id)
PLACEHOLDER = -1


def overlap_enabled(setting: str, asynchronous: bool) -> bool:
    """``scheduler.overlap_steps``: ``auto`` follows the streams plugin's ``asynchronous``."""
    return setting == "on" or (setting == "auto" and asynchronous)


def launchable(seq: Sequence) -> bool:
    """Whether a decode of ``seq`` can run without its latest token on the host: it draws alone, from the
    device's logits only (no penalties over its history, no grammar), and wants no logprobs back."""
    params = seq.params
    return (params.logprobs is None and not params.has_penalties and params.structured is None
            and seq.constraint is None)


def is_plain_decode(batch: ScheduledBatch) -> bool:
    """One new token per sequence, none of them a prompt's."""
    return batch.num_prefill_tokens == 0 and all(n == 1 for n in batch.num_new_tokens)


def drop_placeholders(seq: Sequence) -> None:
    """Take the tokens of steps still in flight off the end of ``seq`` (it is ending now)."""
    tokens = seq.token_ids
    while len(tokens) > seq.num_prompt_tokens and tokens[-1] == PLACEHOLDER:
        tokens.pop()
