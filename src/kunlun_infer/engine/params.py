"""What a request asks for: :class:`SamplingParams`, checked before anything is scheduled.

Every field is validated when the object is built; a bad value raises
:class:`kunlun_infer.errors.RequestError` naming the field and the allowed
range, so the engine never sees it. Checks that need the model (vocabulary
size, ``max_model_len``) live in :func:`validate_prompt`, which the engine
calls from ``add_request``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from kunlun_infer.engine.structured_output import StructuredOutput
from kunlun_infer.errors import RequestError

#: most alternatives a request may ask logprobs for, per generated token
MAX_LOGPROBS = 20
#: what ``logprobs`` are taken of: the model's own distribution, or the one the sampler draws from
LOGPROBS_MODES = ("raw", "processed")
#: temperatures below this sample greedily: dividing logits by them would overflow to infinities
GREEDY_BELOW = 1e-5
#: the largest magnitude of a ``logit_bias`` value (the OpenAI API's range)
MAX_LOGIT_BIAS = 100.0


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature=0`` (or below ``1e-5``) is greedy; ``top_k=0`` and ``top_p=1`` switch those
    filters off. ``seed`` gives the request its own random generator, so the
    same seed gives the same tokens whatever else runs in the batch.
    ``stop`` strings end generation and are cut from the text;
    ``stop_token_ids`` (and the model's EOS unless ``ignore_eos``) end it
    with the token kept in ``token_ids``. ``logprobs=N`` returns, for each
    generated token, the log-probability of that token and of the N most
    likely ones (``0`` = the chosen token only). ``prompt_logprobs=N`` does
    the same for the prompt: for every prompt token after the first, its
    log-probability given the tokens before it and the N most likely ones
    (those requests compute their whole prompt, bypassing the prefix cache,
    and need float32 logits over the vocabulary for every prompt token a
    step computes).

    Penalties reshape the logits before temperature: ``repetition_penalty``
    (as in ``transformers``: the logit of every token already seen, prompt
    or output, is divided by it when positive and multiplied by it when
    negative; 1 = off), ``presence_penalty`` and ``frequency_penalty`` (as
    in the OpenAI API: subtracted once per token present in the output, and
    once per occurrence). ``min_p`` drops tokens less likely than ``min_p``
    times the most likely one (0 = off). ``logit_bias`` maps token ids to
    numbers in [-100, 100] added to those tokens' logits after the
    penalties (as in the OpenAI API: -100 all but bans a token, 100 all but
    forces it). Until ``min_tokens`` tokens are
    generated, EOS and ``stop_token_ids`` cannot be drawn and ``stop``
    strings end nothing (their text is kept). ``n`` draws that many samples
    of the prompt; they share its KV cache.

    ``structured`` (a :class:`StructuredOutput`, or a dict of its fields
    such as ``{"json": schema}`` or ``{"regex": "[0-9]+"}``) constrains the
    text to a language: every step only tokens that keep it inside can be
    drawn, and it ends with a stop token once the language is complete (so
    it does not combine with ``ignore_eos`` or ``min_tokens``).
    ``logprobs_mode``: ``"raw"`` (default) reports the model's distribution
    (``log_softmax`` of its logits); ``"processed"`` the one after penalties,
    ``logit_bias``, the ``min_tokens`` mask and the structured-output mask (before
    temperature and the top-k/top-p/min-p filters).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    structured: StructuredOutput | None = None
    logprobs_mode: str = "raw"
    logit_bias: Mapping[int, float] | None = None

    def __post_init__(self) -> None:
        self.structured = StructuredOutput.coerce(self.structured)
        self.stop = _as_tuple("stop", self.stop, one=str)
        self.stop_token_ids = _as_tuple("stop_token_ids", self.stop_token_ids, one=int)
        self.logit_bias = _as_bias(self.logit_bias)
        self._validate()

    def _validate(self) -> None:
        _require_int("max_tokens", self.max_tokens, low=1)
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or math.isnan(self.temperature) or not 0 <= self.temperature < math.inf:
            raise RequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}",
                               field="temperature")
        _require_int("top_k", self.top_k, low=0, note=" (0 = off)")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) \
                or math.isnan(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", field="top_p")
        if self.seed is not None:
            _require_int("seed", self.seed, low=0, high=2**63 - 1)
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}", field="ignore_eos")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop must be a list of non-empty strings, got {s!r}", field="stop")
        for t in self.stop_token_ids:
            _require_int("stop_token_ids", t, low=0)
        if self.logprobs is not None:
            _require_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _require_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        _require_int("n", self.n, low=1)
        _require_number("repetition_penalty", self.repetition_penalty, "> 0 (1 = off)", lambda v: v > 0)
        for name in ("presence_penalty", "frequency_penalty"):
            _require_number(name, getattr(self, name), "in [-2, 2] (0 = off)", lambda v: -2 <= v <= 2)
        _require_number("min_p", self.min_p, "in [0, 1] (0 = off)", lambda v: 0 <= v <= 1)
        _require_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens, note=" (at most max_tokens)")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise RequestError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got "
                               f"{self.logprobs_mode!r}", field="logprobs_mode")
        if self.structured is not None:
            clash = "ignore_eos" if self.ignore_eos else "min_tokens" if self.min_tokens else None
            if clash:
                raise RequestError(f"{clash} cannot be combined with structured output: the grammar decides "
                                   f"where the text ends (with a stop token); leave {clash} out", field=clash)

    @property
    def has_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty reshapes the logits."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax (temperatures below ``GREEDY_BELOW`` count as 0)."""
        return self.temperature < GREEDY_BELOW


def _as_tuple(field: str, value: object, *, one: type) -> tuple:
    """A list field as a tuple: ``None`` is empty, a lone ``one`` is a list of one; anything else is refused."""
    if value is None:
        return ()
    if isinstance(value, one) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, (list, tuple, set, frozenset, range)):
        raise RequestError(f"{field} must be a list of {one.__name__}, got {value!r}", field=field)
    return tuple(value)


def _as_bias(value: object) -> dict[int, float] | None:
    """``logit_bias`` as a dict of token ids to floats (``None`` when empty); anything else is refused."""
    if value is None:
        return None
    allowed = f"token ids (integers >= 0) to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
    if not isinstance(value, Mapping):
        raise RequestError(f"logit_bias must map {allowed}, got {value!r}", field="logit_bias")
    for token, bias in value.items():
        if not isinstance(token, int) or isinstance(token, bool) or token < 0 \
                or not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias) \
                or abs(bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias must map {allowed}, got {token!r}: {bias!r}", field="logit_bias")
    return {int(token): float(bias) for token, bias in value.items()} or None


def _require_int(field: str, value: object, *, low: int, high: int | None = None, note: str = "") -> None:
    allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        raise RequestError(f"{field} must be an integer {allowed}{note}, got {value!r}", field=field)


def _require_number(field: str, value: object, allowed: str, ok: Callable[[float], bool]) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or not ok(value):
        raise RequestError(f"{field} must be a finite number {allowed}, got {value!r}", field=field)


def validate_prompt(prompt_token_ids: Sequence[int], params: SamplingParams, *, vocab_size: int,
                    max_model_len: int, max_kv_tokens: int | None = None) -> None:
    """Refuse a prompt the model cannot serve: empty, out-of-vocabulary ids, or too long.

    ``max_kv_tokens`` is what the whole KV cache holds; a request that could
    not fit even running alone is refused rather than preempted forever.
    """
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestError("prompt must contain at least one token, got an empty prompt", field="prompt")
    bad = next((i for i, t in enumerate(prompt_token_ids) if not isinstance(t, int) or isinstance(t, bool)
                or not 0 <= t < vocab_size), None)
    if bad is not None:  # an index, since the bad id itself may be None
        raise RequestError(f"prompt token ids must be integers in [0, {vocab_size - 1}], got "
                           f"{prompt_token_ids[bad]!r} at position {bad}", field="prompt")
    if n + params.max_tokens > max_model_len:
        raise RequestError(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) must be <= model.max_model_len "
            f"({max_model_len}); shorten the prompt or lower max_tokens", field="max_tokens")
    if max_kv_tokens is not None and n + params.max_tokens > max_kv_tokens:
        raise RequestError(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) must be <= the KV cache's capacity "
            f"({max_kv_tokens} tokens); lower max_tokens or raise cache.num_blocks", field="max_tokens")
    bad_stop = next((t for t in params.stop_token_ids if t >= vocab_size), None)
    if bad_stop is not None:
        raise RequestError(f"stop_token_ids must be in [0, {vocab_size - 1}], got {bad_stop}",
                           field="stop_token_ids")
    bad_bias = next((t for t in params.logit_bias or () if t >= vocab_size), None)
    if bad_bias is not None:
        raise RequestError(f"logit_bias token ids must be in [0, {vocab_size - 1}], got {bad_bias}",
                           field="logit_bias")
