"""Overlapped steps: the host prepares the next step while the device runs this one.

On a device whose kernels run after their launch returns (``Streams.asynchronous``,
hook API 1.7: a GPU), a synchronous step leaves the device idle while the
host schedules, builds inputs and records tokens: at batch 1 on a fast GPU
that is a third of the step. With ``scheduler.overlap_steps`` the engine
instead:

1. launches a step and keeps it in flight: the tokens it draws stay on the
   device and are copied back without blocking; each sequence it samples
   holds a placeholder (:data:`PLACEHOLDER`) where its token will go, and
   every sequence's computed-token count moves on;
2. at the next step, schedules the next one at once (:meth:`Scheduler.schedule_behind`,
   which never preempts): the sequences in flight for one more token (the
   placeholder) or their next prompt chunk, and newly admitted prompts,
   first come first served; it launches that step straight away, the input
   token of each sequence holding a placeholder taken on the device from
   the step in flight's tokens;
3. only then waits for the step in flight's tokens (not for the step just
   queued behind it), puts them in place of the placeholders and records
   them as any step does: stop tokens and strings, outputs, finished
   requests, and the prefix cache's blocks of now known tokens.

So a steady stream of new requests overlaps too: their prompt chunks ride
in the step launched behind the one in flight. A sequence that stopped in
step 1 still computed one more token in step 2, which is dropped (its
blocks are freed at once: the device runs the queued step before any later
one that reuses them). Sequences that reach ``max_tokens`` in step 1 are
known on the host and left out of step 2.

Only sequences that :func:`overlappable` accepts go into a launched step: a
request asking for logprobs (of its tokens or its prompt), penalties or
structured output, or one whose ``n > 1`` samples are still to be forked off
its prompt, makes the engine take the step in flight back first and run the
step as before (and launch again once no such request is scheduled). So does
a KV-block shortage that would need a preemption. Seeded sampling draws the
same tokens either way; so does greedy decoding. A failure in either step
ends the requests of both.
"""

from __future__ import annotations

from kunlun_infer.engine.sequence import Sequence

#: stands in a sequence's ``token_ids`` for a token drawn by a step still in flight (never a real token id)
PLACEHOLDER = -1


def overlap_enabled(setting: str, asynchronous: bool) -> bool:
    """``scheduler.overlap_steps``: ``auto`` follows the streams plugin's ``asynchronous``."""
    return setting == "on" or (setting == "auto" and asynchronous)


def overlappable(seq: Sequence) -> bool:
    """Whether a step of ``seq`` can run without its latest token on the host: it draws alone (no samples are
    still to be forked off it), from the device's logits only (no penalties over its history, no grammar), and
    wants no logprobs back, of its tokens or of its prompt."""
    params = seq.params
    return (seq.num_slots == 1 and params.logprobs is None and params.prompt_logprobs is None
            and not params.has_penalties and params.structured is None and seq.constraint is None)


def drop_placeholders(seq: Sequence) -> None:
    """Take the tokens of steps still in flight off the end of ``seq`` (it is ending now)."""
    tokens = seq.token_ids
    while len(tokens) > seq.num_prompt_tokens and tokens[-1] == PLACEHOLDER:
        tokens.pop()
