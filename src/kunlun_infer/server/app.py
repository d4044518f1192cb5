"""The FastAPI application: OpenAI routes over one :class:`EngineLoop` (or a fleet's dispatcher, its twin).

``/v1/completions`` and ``/v1/chat/completions`` (``stream=true`` answers
with server-sent events), ``/v1/models``, ``/tokenize`` and ``/detokenize``,
``/health`` and ``/metrics``.
Request bodies are parsed here rather than by FastAPI so that every refusal
— malformed JSON, a bad field, an unknown model, a full queue — has the
OpenAI error shape. Handlers have the engine prepare (tokenize and check)
each request on the event loop (cheap, read-only) and hand it to the engine
loop; a stream whose client goes
away, or a non-streaming request whose connection drops, is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kunlun_infer.chat import encode_prompt, engine_chat_template
from kunlun_infer.errors import ConfigError, RequestError
from kunlun_infer.server.engine_loop import EngineLoop, EngineUnavailableError, ReplicaFailedError, ServerBusyError
from kunlun_infer.server.generation import Generation
from kunlun_infer.server.metrics import ServerMetrics
from kunlun_infer.server.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                          TokenizeRequest, validation_error)
from kunlun_infer.server.redact import public_text
from kunlun_infer.server.responses import DONE, ChatBuilder, CompletionBuilder, TokenText, sse
from kunlun_infer.tool_calls import STYLES, ToolCallStyle, detect_style, forced_calls

log = logging.getLogger("kunlun_infer.framework")

#: completions default, as in the OpenAI API
DEFAULT_MAX_TOKENS = 16


class EventStream(StreamingResponse):
    """Server-sent events; ``on_close`` runs however the stream ends (finished, client gone, error)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


class ServerState:
    """What the routes share: the engine loop, metrics, the served model's name, chat template and tool syntax.

    ``loop``: what serves the requests when it is not an :class:`EngineLoop` over ``engine`` (a fleet's
    dispatcher, whose ``engine`` is the fleet's front: tokenizer, limits and request checks).
    """

    def __init__(self, engine: Any, *, model_name: str, max_queue: int, loop: Any = None,
                 engine_thread: bool = True) -> None:
        self.engine = engine
        server_config = getattr(getattr(engine, "config", None), "server", None)
        self.tool_call_parser = server_config.get("tool_call_parser") if server_config is not None else None
        if self.tool_call_parser is not None and self.tool_call_parser not in STYLES:
            raise ConfigError(f"server.tool_call_parser must be one of {', '.join(STYLES)} or null (detect it from "
                              f"the chat template), got {self.tool_call_parser!r}")
        self.model_name = model_name
        self.metrics = ServerMetrics(lambda: self.loop.stats, lambda: self.loop.num_queued)
        self.loop = EngineLoop(engine, max_queue=max_queue, metrics=self.metrics, thread=engine_thread) \
            if loop is None else loop
        self.token_text = TokenText(engine.tokenizer)
        self.created = int(time.time())
        self._chat_template: Any = None

    def chat_template(self) -> Any:
        if self._chat_template is None:
            self._chat_template = engine_chat_template(self.engine)
        return self._chat_template

    def tool_style(self) -> ToolCallStyle:
        """The model's tool-call syntax: ``server.tool_call_parser``, else the one its chat template teaches."""
        name = self.tool_call_parser or detect_style(self.chat_template().source)
        if name is None:
            raise ApiError("tools: this model's chat template shows no tool-call syntax, so calls could not be "
                           f"read back; start the server with server.tool_call_parser= one of {', '.join(STYLES)}",
                           param="tools")
        return STYLES[name]

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           status=404, param="model", code="model_not_found")


def error_response(exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def as_api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestError):
        return ApiError.from_request_error(exc)
    if isinstance(exc, ServerBusyError):
        return ApiError(str(exc), status=429, type="server_overloaded", code="queue_full")
    if isinstance(exc, ReplicaFailedError):
        return ApiError(str(exc), status=502, type="server_error", code="replica_failed")
    if isinstance(exc, EngineUnavailableError):
        return ApiError(str(exc), status=503, type="server_unavailable", code="engine_unavailable")
    log.exception("request failed", exc_info=exc)
    return ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500, type="server_error")


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise validation_error(exc) from None


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(engine: Any, *, model_name: str, max_queue: int = 256, close_engine: bool = False,
              loop: Any = None, engine_thread: bool = True) -> FastAPI:
    """An app serving ``engine`` (started and stopped with the app's lifespan; closed too if ``close_engine``).

    ``loop``: a running loop of the engine's surface to serve instead (a fleet's dispatcher); whoever made it
    starts and stops it, the app only closes ``engine`` if ``close_engine``. ``engine_thread=False``: the
    app's :class:`EngineLoop` steps in the thread that calls its ``run_here`` (``server.runner.run_app``).
    """
    state = ServerState(engine, model_name=model_name, max_queue=max_queue, loop=loop, engine_thread=engine_thread)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if loop is None:
            state.loop.start()
        try:
            yield
        finally:
            if loop is None:
                await asyncio.to_thread(state.loop.shutdown)
            if close_engine:
                engine.close()

    app = FastAPI(title="kunlun-infer", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state

    def count(endpoint: str, status: int) -> None:
        with state.metrics.lock:
            state.metrics.http_requests.inc(endpoint=endpoint, status=str(status))

    async def answer(endpoint: str, handler: Callable[[], Awaitable[Response]]) -> Response:
        try:
            response = await handler()
        except Exception as exc:  # noqa: BLE001 - every failure gets the OpenAI error shape
            api_error = as_api_error(exc)
            if api_error.status == 429:
                with state.metrics.lock:
                    state.metrics.requests_rejected.inc(reason="queue_full")
            response = error_response(api_error)
        count(endpoint, response.status_code)
        return response

    async def prepare(prompts: list[Any], params: Any, field: str | None) -> list[Any]:
        """``engine.prepare_request`` for each prompt; a constraint is compiled off the event loop (the first
        one imports the grammar library), and its errors name the body field that set it."""
        try:
            if params.structured is not None:
                return await asyncio.to_thread(lambda: [engine.prepare_request(p, params) for p in prompts])
            return [engine.prepare_request(p, params) for p in prompts]
        except RequestError as exc:
            raise ApiError.from_request_error(exc, structured_field=field) from None

    async def run(request: Request, generation: Generation, builder: Any, stream: bool,
                  include_usage: bool) -> Response:
        generation.start()
        if stream:
            return EventStream(_events(generation, builder, include_usage), generation.abort_unfinished)
        collect = asyncio.ensure_future(_drain(generation))
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client went away first
                collect.cancel()
                generation.abort_unfinished()
        if collect.cancelled():
            return Response(status_code=499)
        collect.result()
        return JSONResponse(builder.response(generation.finals, generation.usage))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        async def handle() -> Response:
            req = await parse_body(request, CompletionRequest)
            state.check_model(req.model)
            max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
            # a prompt scored alone (echo, max_tokens=0) still generates its one token, which no one sees
            params = req.sampling_params(max_tokens=max(max_tokens, 1), logprobs=req.logprobs,
                                         prompt_logprobs=req.logprobs if req.echo else None)
            prepared = await prepare(req.prompts(engine.tokenizer), params, req.structured_output()[1])
            builder = CompletionBuilder(state.model_name, state.token_text, req.logprobs or 0, echo=req.echo)
            generation = Generation(state.loop, prepared, streamed=req.stream, prompt_only=max_tokens == 0)
            return await run(request, generation, builder, req.stream, req.include_usage)

        return await answer("/v1/completions", handle)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        async def handle() -> Response:
            req = await parse_body(request, ChatCompletionRequest)
            state.check_model(req.model)
            tools = req.tool_dicts()
            mode, callable_tools = req.tool_mode()
            style = state.tool_style() if mode != "none" else None
            structured = req.structured_output()
            # a named function is called once; otherwise parallel_tool_calls decides
            parallel = req.parallel_tool_calls and not (mode == "forced" and req.tool_choice != "required")
            if mode == "forced":
                if structured[0] is not None:
                    raise ApiError(f"tool_choice forces tool calls, which {structured[1]} would contradict; send "
                                   f"one of them", param="tool_choice")
                structured = (forced_calls(style, callable_tools, parallel=parallel), "tool_choice")
            text = state.chat_template().render(req.template_messages(), tools=tools or None,
                                                add_generation_prompt=req.add_generation_prompt,
                                                **(req.chat_template_kwargs or {}))
            ids = encode_prompt(engine.tokenizer, text)
            # without max_tokens the answer may fill the context, as far as the KV cache can hold it
            limit = int(state.loop.stats["max_request_tokens"])
            room = limit - len(ids)
            if room < 1:
                raise ApiError(f"messages: the conversation is {len(ids)} tokens, leaving no room to answer "
                               f"within {limit} tokens (model.max_model_len and the KV cache); shorten it",
                               param="messages")
            max_tokens = req.max_completion_tokens or req.max_tokens or room
            params = req.sampling_params(max_tokens=max_tokens, logprobs=req.logprobs_count(), structured=structured)
            (prepared,) = await prepare([ids], params, structured[1])
            builder = ChatBuilder(state.model_name, state.token_text, req.top_logprobs or 0, tool_style=style,
                                  parallel_tool_calls=parallel)
            return await run(request, Generation(state.loop, [prepared], streamed=req.stream), builder, req.stream,
                             req.include_usage)

        return await answer("/v1/chat/completions", handle)

    def tokenizer() -> Any:
        if engine.tokenizer is None:
            raise ApiError("this model has no tokenizer.json, so it has no text to tokenize or detokenize",
                           param="model")
        return engine.tokenizer

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        async def handle() -> Response:
            req = await parse_body(request, TokenizeRequest)
            state.check_model(req.model)
            req.check()
            tok = tokenizer()
            if req.messages is not None:
                text = state.chat_template().render([m.for_template() for m in req.messages],
                                                    tools=[t.model_dump(exclude_none=True) for t in req.tools or ()]
                                                    or None, add_generation_prompt=req.add_generation_prompt,
                                                    **(req.chat_template_kwargs or {}))
                ids = encode_prompt(tok, text)  # the template wrote the special tokens
            else:
                ids = list(tok.backend.encode(req.prompt, add_special_tokens=req.add_special_tokens).ids)
            body: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
            if req.return_token_strs:
                body["token_strs"] = [tok.id_to_token(i) for i in ids]
            return JSONResponse(body)

        return await answer("/tokenize", handle)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        async def handle() -> Response:
            req = await parse_body(request, DetokenizeRequest)
            state.check_model(req.model)
            tok = tokenizer()
            bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < engine.vocab_size), None)
            if bad is not None:
                raise ApiError(f"tokens[{bad}]: {req.tokens[bad]} is not a token id; ids are in "
                               f"[0, {engine.vocab_size - 1}]", param=f"tokens[{bad}]")
            return JSONResponse({"prompt": tok.decode(req.tokens, skip_special_tokens=False)})

        return await answer("/detokenize", handle)

    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "kunlun-infer",
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models() -> Response:
        count("/v1/models", 200)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        async def handle() -> Response:
            state.check_model(model)
            return JSONResponse(model_card())

        return await answer("/v1/models/{model}", handle)

    @app.get("/health")
    async def health() -> Response:
        ok = state.loop.alive
        count("/health", 200 if ok else 503)
        if ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": public_text(state.loop.failure or "shutting down")},
                            503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(await state.loop.render_metrics(state.metrics),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(str(exc.detail), status=exc.status_code, type=kind))

    return app


async def _drain(generation: Generation) -> None:
    async for _ in generation.outputs():
        pass


async def _events(generation: Generation, builder: Any, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body; an error after the stream began is sent as an error event before ``[DONE]``."""
    try:
        for chunk in getattr(builder, "role_chunks", lambda n: [])(generation.num_choices):
            yield sse(chunk)
        async for index, output in generation.outputs():
            chunk = builder.chunk(index, output)
            if chunk is not None:
                yield sse(chunk)
        if include_usage:
            yield sse(builder.usage_chunk(generation.usage))
    except Exception as exc:  # noqa: BLE001 - the status line is already sent
        yield sse(as_api_error(exc).body())
    yield DONE
