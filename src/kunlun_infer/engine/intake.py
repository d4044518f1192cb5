"""A request's way in: its prompt tokenized and the whole request checked, once.

:meth:`RequestIntake.prepare` turns a prompt (text or token ids) and its
:class:`SamplingParams` into a :class:`PreparedRequest`: the token ids, the
prompt text, and the request's own copy of the params, checked against what
the engine serves (vocabulary, ``model.max_model_len``, the KV cache's
capacity, ``scheduler.max_num_seqs``; a structured-output constraint is
compiled, so one the grammar backend cannot serve is refused here).
:meth:`LLMEngine.add_request` queues a request prepared by its own engine as
it is. Callers that must refuse a bad request before anything is queued
(``LLM.generate`` checks a whole batch first; the server answers 400 before
it streams) prepare requests with :meth:`LLMEngine.prepare_request` and hand
those over, so a prompt is never tokenized or checked twice.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from kunlun_infer.engine.params import SamplingParams, validate_prompt
from kunlun_infer.errors import RequestError

Prompt = str | list[int]


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedRequest:
    """A prompt and its params, checked by one engine's :class:`RequestIntake`; queue it there as it is.

    ``params`` hands out a copy: the checked params cannot be changed
    through it after the check.
    """

    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    _params: SamplingParams = dataclasses.field(repr=False)
    _intake: RequestIntake = dataclasses.field(repr=False)

    @property
    def params(self) -> SamplingParams:
        return copy.copy(self._params)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class RequestIntake:
    """Tokenizes and checks requests for one engine, whose limits it is given."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int
    #: tokens the whole KV cache holds: no request may need more, even running alone
    max_kv_tokens: int
    max_num_seqs: int
    #: the engine's :class:`~kunlun_infer.engine.structured.StructuredOutputs` (compiles constraints)
    structured: Any = None

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt and output together) one request may reach."""
        return min(self.max_model_len, self.max_kv_tokens)

    def prepare(self, prompt: Prompt, params: SamplingParams | None = None) -> PreparedRequest:
        """Tokenize ``prompt`` and check the request; ``RequestError`` naming the field at fault."""
        if params is None:
            params = SamplingParams()
        elif isinstance(params, SamplingParams):
            params = dataclasses.replace(params)  # checks again: fields may have been changed since it was built
        else:
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}", field="params")
        text, token_ids = self._tokenize(prompt)
        validate_prompt(token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                        max_kv_tokens=self.max_kv_tokens)
        if params.n > self.max_num_seqs:
            raise RequestError(f"n={params.n} samples must be <= scheduler.max_num_seqs ({self.max_num_seqs}), "
                               f"since they run side by side", field="n")
        if params.structured is not None:
            if self.structured is None:
                raise RequestError("structured: this engine serves no structured output", field="structured")
            self.structured.compile(params.structured)  # compiled once, cached for add_request
        return PreparedRequest(text, tuple(token_ids), params, self)

    def accept(self, prompt: Prompt | PreparedRequest, params: SamplingParams | None) -> PreparedRequest:
        """``prompt`` as a request of this intake: prepared here already (taken as it is), or prepared now."""
        if not isinstance(prompt, PreparedRequest):
            return self.prepare(prompt, params)
        if params is not None:
            raise RequestError("params: a prepared request carries its own params; pass none with it",
                               field="params")
        if prompt._intake is not self:
            raise RequestError("prompt: this request was prepared by another engine; prepare it with this "
                               "engine's prepare_request", field="prompt")
        return prompt

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt: this model has no tokenizer.json, so prompts must be lists of "
                                   "token ids", field="prompt")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise RequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                           field="prompt")
