"""The OpenAI request bodies the server accepts, and how they become :class:`SamplingParams`.

Bodies are parsed with pydantic; a field the API defines but this server
does not act on is accepted only at its neutral value (``store=false``,
``best_of`` equal to ``n`` …), so a client never silently gets something other than
what it asked for, and an unknown field is refused by name. Beyond the
OpenAI fields, the usual engine extensions are accepted: ``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``logprobs_mode``, and structured output through
``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``
(both endpoints also take OpenAI's ``response_format`` ``json_object`` and
``json_schema``). Every refusal is an :class:`ApiError` carrying the HTTP
status and the OpenAI error body ``{"error": {"message", "type", "param",
"code"}}``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.structured_output import StructuredOutput
from kunlun_infer.errors import KunlunInferError, RequestError
from kunlun_infer.fim import fim_prompt
from kunlun_infer.server.redact import public_text


class ApiError(KunlunInferError):
    """A request the server refuses: HTTP ``status`` and the OpenAI error fields."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The OpenAI error body, its message without paths of the server's filesystem."""
        return {"error": {"message": public_text(str(self)), "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def from_request_error(cls, exc: RequestError, *, structured_field: str | None = None) -> ApiError:
        """A 400 naming the field; an error of the engine's ``structured`` field names the body field that set it."""
        if structured_field and exc.field == "structured":
            return cls(str(exc).replace("structured", structured_field, 1), param=structured_field)
        return cls(str(exc), param=exc.field)


def structured_from(field: str, fields: dict[str, Any]) -> StructuredOutput:
    """A :class:`StructuredOutput`, its shape errors named after the body ``field``."""
    try:
        return StructuredOutput(**fields)
    except RequestError as exc:
        raise ApiError.from_request_error(exc, structured_field=field) from None


def response_format_output(response_format: dict[str, Any] | None) -> StructuredOutput | None:
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return structured_from("response_format", {"json_object": True})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
            raise ApiError("response_format.json_schema must be an object with a 'name' and a 'schema'",
                           param="response_format.json_schema")
        schema = spec.get("schema", {"type": "object"})
        return structured_from("response_format", {"json": schema})
    raise ApiError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {json.dumps(kind)}",
                   param="response_format.type")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # engine extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    logprobs_mode: Literal["raw", "processed"] = "raw"
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: dict[str, Any] | None = None
    #: sent by clients at values this server meets (check_neutral): ``metadata``, the client's own tags that OpenAI
    #: keeps beside a stored completion, is taken and left unused
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def check_neutral(self) -> None:
        """Refuse OpenAI fields this server only supports at their neutral value (each endpoint has its own)."""
        if self.store:
            raise ApiError("store=true is not supported: this server keeps no completions; leave it out or false",
                           param="store")
        if self.service_tier not in (None, "auto", "default"):
            raise ApiError(f"service_tier {json.dumps(self.service_tier)} is not supported: this server has one "
                           f"tier; leave it out or send 'auto' or 'default'", param="service_tier")

    def token_biases(self) -> dict[int, float] | None:
        """``logit_bias`` with its keys (token ids, strings in JSON) as integers; the values are checked by
        :class:`SamplingParams`."""
        if not self.logit_bias:
            return None
        bad = next((key for key in self.logit_bias if not (key.isascii() and key.isdecimal())), None)
        if bad is not None:
            raise ApiError(f"logit_bias keys must be token ids (non-negative integers), got {json.dumps(bad)}",
                           param="logit_bias")
        return {int(key): value for key, value in self.logit_bias.items()}

    def structured_output(self) -> tuple[StructuredOutput | None, str | None]:
        """The constraint the body asks for and the field that asked (``guided_*`` or ``response_format``), or
        ``(None, None)``."""
        guided, field = self.guided_output()
        from_format = response_format_output(self.response_format)
        if from_format is None:
            return guided, field
        if guided is not None:
            raise ApiError(f"set either response_format or {field}, not both", param=field)
        return from_format, "response_format"

    def guided_output(self) -> tuple[StructuredOutput | None, str | None]:
        """The constraint of the ``guided_*`` field the body sets, and that field, or ``(None, None)``."""
        asked = {name: value for name, value in (("guided_json", self.guided_json), ("guided_regex", self.guided_regex),
                                                 ("guided_choice", self.guided_choice),
                                                 ("guided_grammar", self.guided_grammar)) if value is not None}
        if len(asked) > 1:
            raise ApiError(f"set at most one of {', '.join(asked)}", param=list(asked)[1])
        if not asked:
            return None, None
        (field, value), = asked.items()
        kind = field.removeprefix("guided_")
        return structured_from(field, {kind: value}), field

    def sampling_params(self, *, max_tokens: int, logprobs: int | None,
                        structured: tuple[StructuredOutput | None, str | None] | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters; :class:`ApiError` naming the field for a bad value.

        ``structured``: the constraint and the body field that set it, when the
        caller decided it (tool calls); else the body's own.
        """
        self.check_neutral()
        structured, field = self.structured_output() if structured is None else structured
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=0 if self.top_k == -1 else self.top_k,
                seed=self.seed, ignore_eos=self.ignore_eos,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or ()),
                stop_token_ids=list(self.stop_token_ids or ()), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                n=self.n,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, min_p=self.min_p, min_tokens=self.min_tokens,
                structured=structured, logprobs_mode=self.logprobs_mode, logit_bias=self.token_biases())
        except RequestError as exc:
            raise ApiError.from_request_error(exc, structured_field=field) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    #: 0 only with ``echo``: the prompt alone, scored (its logprobs), nothing generated
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_neutral(self) -> None:
        super().check_neutral()
        if self.max_tokens == 0 and not self.echo:
            raise ApiError("max_tokens must be at least 1 (0 only with echo=true, to score the prompt alone)",
                           param="max_tokens")
        if self.max_tokens == 0 and self.min_tokens:
            raise ApiError(f"min_tokens ({self.min_tokens}) must be at most max_tokens (0)", param="min_tokens")
        if self.suffix and self.echo:
            raise ApiError("echo and suffix cannot go together: an infilled prompt is not the text sent; drop one",
                           param="echo")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(f"best_of must equal n ({self.n}) on this server", param="best_of")

    def prompts(self, tokenizer: Any = None) -> list[str | list[int]]:
        """One entry per prompt: text or token ids; with a ``suffix``, each text prompt as the prefix of a
        fill-in-the-middle prompt for ``tokenizer``'s model (:mod:`kunlun_infer.fim`)."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif not p:
            raise ApiError("prompt must not be an empty list", param="prompt")
        elif all(isinstance(t, int) for t in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = [x if isinstance(x, str) else list(x) for x in p]  # type: ignore[union-attr]
        if not self.suffix:
            return prompts
        if not all(isinstance(x, str) for x in prompts):
            raise ApiError("suffix needs text prompts (the text before the hole), not token ids", param="suffix")
        try:
            return [fim_prompt(tokenizer, x, self.suffix) for x in prompts]  # type: ignore[arg-type]
        except RequestError as exc:
            raise ApiError.from_request_error(exc) from None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; fields besides ``role`` and ``content`` (``name``, ``tool_calls`` …) go to the template."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: text parts joined, tool-call arguments as objects.

        OpenAI sends a call's ``arguments`` as JSON text; templates write them
        with ``tojson`` (as ``transformers`` documents), so they get the object.
        """
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        else:
            message["content"] = self.content
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [_call_for_template(call) for call in calls]
        return message


def _call_for_template(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class FunctionDefinition(BaseModel):
    """A function the model may call: OpenAI's ``tools[].function``."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function: the model must call it."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    modalities: list[str] | None = None

    def check_neutral(self) -> None:
        super().check_neutral()
        if self.top_logprobs and not self.logprobs:
            raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.modalities is not None and self.modalities != ["text"]:
            raise ApiError(f"modalities {json.dumps(self.modalities)} is not supported: this server answers in "
                           f"text; leave it out or send [\"text\"]", param="modalities")

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools as plain dicts (what templates and the forced format take)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]

    def tool_mode(self) -> tuple[str, list[dict[str, Any]]]:
        """``(mode, tools to call)``: ``none``, ``auto`` (free), or ``forced`` with the functions it may call.

        Like OpenAI: no ``tool_choice`` means ``auto`` with tools, ``none``
        without; ``required`` or a named function need tools.
        """
        tools = self.tool_dicts()
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if tools else "none")
        if choice == "none" or (choice == "auto" and not tools):
            return "none", []
        if not tools:
            raise ApiError(f"tool_choice {json.dumps(choice if isinstance(choice, str) else choice.model_dump())} "
                           f"needs tools", param="tool_choice")
        if choice == "auto":
            return "auto", tools
        if choice == "required":
            return "forced", tools
        named = [tool for tool in tools if tool["function"]["name"] == choice.function.name]
        if not named:
            raise ApiError(f"tool_choice names the function '{choice.function.name}', which is not among the "
                           f"tools ({', '.join(t['function']['name'] for t in tools)})", param="tool_choice")
        return "forced", named[:1]

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a ``prompt``, or chat ``messages`` rendered by the model's template first."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError("send either prompt or messages", param="prompt")
        if self.messages is not None and not self.messages:
            raise ApiError("messages must hold at least one message", param="messages")


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


_UNION_HINTS = {"prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
                "stop": "a string or a list of strings",
                "content": "a string or a list of {'type': 'text', 'text': ...} parts",
                "tool_choice": "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"}


_TYPE_TAGS = ("str", "int", "float", "bool")


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS)


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """``('messages', 0, 'content', 'str')`` -> ``'messages[0].content'`` (pydantic's union tags dropped)."""
    param = ""
    for part in loc:
        if _is_union_tag(part):
            break
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    return param or None


def validation_error(exc: ValidationError) -> ApiError:
    """The first problem of a pydantic error as an OpenAI 400, naming the field."""
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return ApiError(f"the request body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}",
                        param="body")
    if first["type"] == "model_type" and not first["loc"]:
        return ApiError("the request body must be a JSON object", param="body")
    param = _param_of(tuple(first["loc"]))
    if first["type"] == "extra_forbidden":
        return ApiError(f"unrecognized request argument: {param}", param=param)
    if first["type"] == "missing":
        return ApiError(f"{param} is required", param=param)
    field = (param or "").rsplit(".", 1)[-1].split("[")[0]
    if field in _UNION_HINTS and any(_is_union_tag(part) for part in first["loc"]):
        return ApiError(f"{param} must be {_UNION_HINTS[field]}", param=param)
    return ApiError(f"{param}: {first['msg']} (got {first.get('input')!r})", param=param)
