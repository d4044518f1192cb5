"""OpenAI response and stream-chunk bodies built from :class:`RequestOutput` objects.

Completions are ``text_completion`` objects; chat completions are
``chat.completion`` objects and ``chat.completion.chunk`` stream chunks whose
first chunk per choice carries the ``assistant`` role. With tools, each
choice's text goes through a :class:`~kunlun_infer.tool_calls.ToolCallParser`:
calls come back as ``tool_calls`` (streamed as the call's id and name, then
pieces of ``function.arguments``) and the choice finishes with
``"tool_calls"``. Streams are
server-sent events: ``data: <json>\\n\\n`` per chunk, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from kunlun_infer.engine.outputs import RequestOutput
from kunlun_infer.tool_calls import ToolCallDelta, ToolCallParser, ToolCallStyle, parse_tool_calls

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event holding ``payload`` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class TokenText:
    """Text of single tokens for logprobs: decoded, special tokens shown.

    A token holding part of a UTF-8 character decodes to U+FFFD, which would
    make different tokens look alike; its vocabulary entry is used instead.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            return self.tokenizer.id_to_token(token_id) or text
        return text

    def of(self, token_ids: list[int]) -> str:
        """The text of a token sequence, special tokens shown (an echoed prompt given as token ids)."""
        if self.tokenizer is None:
            return "".join(self(t) for t in token_ids)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)


def completion_logprobs(token_ids: list[int], entries: list[dict[int, float] | None], text_offset: int,
                        token_text: TokenText, top: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for ``token_ids`` and their ``{token_id: logprob}`` entries
    (``None`` for a prompt's first token, which nothing comes before), the first at ``text_offset``."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for token_id, entry in zip(token_ids, entries):
        text = token_text(token_id)
        tokens.append(text)
        token_logprobs.append(None if entry is None else entry.get(token_id))
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:top] if entry is not None else []
        top_logprobs.append({token_text(t): lp for t, lp in best} if top and entry is not None else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + then[key] for key in first}


def chat_logprobs(output: RequestOutput, start: int, token_text: TokenText, top: int) -> dict[str, Any] | None:
    """The chat ``logprobs`` object (``{"content": [...]}``) for tokens ``start:`` of ``output``."""
    if output.logprobs is None:
        return None

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entry in zip(output.token_ids[start:], output.logprobs[start:]):
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        content.append({**item(token_id, entry[token_id]), "top_logprobs": [item(t, lp) for t, lp in best]})
    return {"content": content}


def finish_reason(output: RequestOutput) -> str | None:
    return output.finish_reason if output.finished else None


class CompletionBuilder:
    """Bodies of one ``/v1/completions`` answer (whole, or as stream chunks).

    With ``echo`` each choice's text starts with its prompt's (the string
    sent, or the token ids decoded), in the first chunk of a stream, and
    where logprobs were asked its logprobs start with the prompt tokens'
    (the engine's ``prompt_logprobs``; ``None`` for the first token).
    """

    def __init__(self, model: str, token_text: TokenText, top_logprobs: int, *, echo: bool = False) -> None:
        self.id, self.created, self.model = new_id("cmpl"), int(time.time()), model
        self.token_text, self.top, self.echo = token_text, top_logprobs, echo
        self._sent_tokens: dict[int, int] = {}
        self._sent_chars: dict[int, int] = {}

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}

    def _echoed(self, output: RequestOutput) -> tuple[str, dict[str, Any] | None]:
        """The prompt's text and, where asked, its logprobs object."""
        text = output.prompt if output.prompt is not None else self.token_text.of(output.prompt_token_ids)
        if output.prompt_logprobs is None:
            return text, None
        return text, completion_logprobs(output.prompt_token_ids, output.prompt_logprobs, 0, self.token_text,
                                         self.top)

    def _choice(self, index: int, output: RequestOutput, start: int, chars: int, text: str,
                first: bool) -> dict[str, Any]:
        """The choice for ``text`` and tokens ``start:`` of ``output`` (at ``chars`` of the choice's text), the
        prompt's before them where it is echoed and this is the ``first`` the client gets of the choice."""
        prompt, prompt_logprobs = self._echoed(output) if self.echo and first else ("", None)
        logprobs = None
        if output.logprobs is not None:
            logprobs = completion_logprobs(output.token_ids[start:], output.logprobs[start:], chars + len(prompt),
                                           self.token_text, self.top)
            if prompt_logprobs is not None:
                logprobs = _joined(prompt_logprobs, logprobs)
        return {"index": index, "text": prompt + text, "logprobs": logprobs, "finish_reason": finish_reason(output)}

    def chunk(self, index: int, output: RequestOutput) -> dict[str, Any] | None:
        """The stream chunk for an output's new text, or ``None`` when there is nothing to send yet."""
        first = index not in self._sent_chars
        if not output.delta_text and not output.finished and not (self.echo and first):
            return None
        start, chars = self._sent_tokens.get(index, 0), self._sent_chars.get(index, 0)
        choice = self._choice(index, output, start, chars, output.delta_text, first)
        self._sent_tokens[index] = len(output.token_ids)
        self._sent_chars[index] = chars + len(choice["text"])
        return self._envelope([choice])

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope([]), "usage": usage}

    def response(self, finals: dict[int, RequestOutput], usage: dict[str, int]) -> dict[str, Any]:
        choices = [self._choice(i, o, 0, 0, o.text, True) for i, o in sorted(finals.items())]
        return {**self._envelope(choices), "usage": usage}


def _tool_call_deltas(delta: ToolCallDelta) -> list[dict[str, Any]]:
    """OpenAI's ``delta.tool_calls``: a call's first piece names it, later ones add ``function.arguments``."""
    calls = []
    for call in delta.calls:
        function = {"arguments": call["arguments"]}
        entry: dict[str, Any] = {"index": call["index"]}
        if "id" in call:
            entry.update(id=call["id"], type="function")
            function = {"name": call["name"], **function}
        entry["function"] = function
        calls.append(entry)
    return calls


class ChatBuilder:
    """Bodies of one ``/v1/chat/completions`` answer (whole, or as stream chunks).

    ``tool_style``: the tool-call syntax to read each choice with (``None``:
    plain content); ``parallel_tool_calls=False`` keeps the first call only.
    """

    def __init__(self, model: str, token_text: TokenText, top_logprobs: int,
                 tool_style: ToolCallStyle | None = None, parallel_tool_calls: bool = True) -> None:
        self.id, self.created, self.model = new_id("chatcmpl"), int(time.time()), model
        self.token_text, self.top = token_text, top_logprobs
        self.tool_style, self.parallel_tool_calls = tool_style, parallel_tool_calls
        self._sent_tokens: dict[int, int] = {}
        self._parsers: dict[int, ToolCallParser] = {}

    def _finish_reason(self, output: RequestOutput, called: bool) -> str | None:
        reason = finish_reason(output)
        return "tool_calls" if called and reason == "stop" else reason

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def role_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        """The first chunk of each choice: the assistant role, no content yet."""
        return [self._envelope("chat.completion.chunk", [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None}])
                for i in range(num_choices)]

    def chunk(self, index: int, output: RequestOutput) -> dict[str, Any] | None:
        if not output.delta_text and not output.finished:
            return None
        delta: dict[str, Any] = {"content": output.delta_text} if output.delta_text else {}
        called = False
        if self.tool_style is not None:
            parser = self._parsers.setdefault(index, ToolCallParser(self.tool_style,
                                                                    parallel=self.parallel_tool_calls))
            parsed = parser.feed(output.delta_text)
            if output.finished:
                rest = parser.finish()
                parsed.content += rest.content
                for call in rest.calls:
                    parsed.add_call(**call)
            if not parsed and not output.finished:
                return None  # held back: maybe the start of a call
            delta = {"content": parsed.content} if parsed.content else {}
            if parsed.calls:
                delta["tool_calls"] = _tool_call_deltas(parsed)
            called = parser.has_calls
        start = self._sent_tokens.get(index, 0)
        self._sent_tokens[index] = len(output.token_ids)
        return self._envelope("chat.completion.chunk", [{
            "index": index, "delta": delta, "logprobs": chat_logprobs(output, start, self.token_text, self.top),
            "finish_reason": self._finish_reason(output, called)}])

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk", []), "usage": usage}

    def message(self, output: RequestOutput) -> tuple[dict[str, Any], bool]:
        """The choice's ``message`` and whether it calls tools."""
        if self.tool_style is None:
            return {"role": "assistant", "content": output.text}, False
        content, calls = parse_tool_calls(self.tool_style, output.text, parallel=self.parallel_tool_calls)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        return message, bool(calls)

    def response(self, finals: dict[int, RequestOutput], usage: dict[str, int]) -> dict[str, Any]:
        choices = []
        for i, output in sorted(finals.items()):
            message, called = self.message(output)
            choices.append({"index": i, "message": message, "logprobs": chat_logprobs(output, 0, self.token_text,
                                                                                     self.top),
                            "finish_reason": self._finish_reason(output, called)})
        return {**self._envelope("chat.completion", choices), "usage": usage}
