"""Why a sequence ends: stop tokens, stop strings, ``min_tokens`` and ``max_tokens``, decided in one place.

:func:`stop_reason` is asked once per generated token, after the token was
appended to the sequence and its text decoded; the engine then finishes the
sequence with the reason it gives. The only other place that knows these
rules is the sampler, which masks the stop tokens while a row is short of
``min_tokens`` so that they cannot be drawn at all.
"""

from __future__ import annotations

from kunlun_infer.engine.detokenizer import IncrementalDetokenizer
from kunlun_infer.engine.outputs import FinishReason
from kunlun_infer.engine.sequence import Sequence


def stop_reason(seq: Sequence, text: IncrementalDetokenizer | None) -> FinishReason | None:
    """``"stop"``, ``"length"`` or ``None`` (generation goes on) for ``seq`` after its latest token.

    The first ``min_tokens`` generated tokens end nothing but ``max_tokens``:
    no stop token ends them, and no stop string is looked for in their text
    (it is kept). After them, a stop token (``stop_token_ids``, and the
    model's EOS unless ``ignore_eos``) ends the sequence with the token kept
    in ``token_ids``; a stop string in text not streamed yet ends it with the
    text cut before it (``text`` does the cutting). Reaching ``max_tokens``
    ends it with ``"length"`` unless a stop ended it at the same token. When
    the sequence ends, the text still held back for an incomplete character
    is decoded first, so a stop string in it counts too.
    """
    params = seq.params
    num_generated = seq.num_generated_tokens
    may_stop = num_generated > params.min_tokens
    reason: FinishReason | None = None
    if may_stop and seq.token_ids[-1] in seq.stop_token_ids:
        reason = "stop"
    elif num_generated >= params.max_tokens:
        reason = "length"
    if text is not None:
        if reason is not None:
            text.flush()
        if may_stop and text.cut_at_stop_string():
            reason = "stop"
    return reason
