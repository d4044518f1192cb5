"""OpenAI response and stream-chunk bodies built from :class:`RequestOutput` objects.

Completions are ``text_completion`` objects; chat completions are
``chat.completion`` objects and ``chat.completion.chunk`` stream chunks whose
first chunk per choice carries the ``assistant`` role. Streams are
server-sent events: ``data: <json>\\n\\n`` per chunk, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from kunlun_infer.engine.outputs import RequestOutput

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


def completion_logprobs(output: RequestOutput, start: int, text_offset: int, token_text: TokenText,
                        top: int) -> dict[str, Any] | None:
    """The legacy completions ``logprobs`` object for tokens ``start:`` of ``output``."""
    if output.logprobs is None:
        return None
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for token_id, entry in zip(output.token_ids[start:], output.logprobs[start:]):
        text = token_text(token_id)
        tokens.append(text)
        token_logprobs.append(entry.get(token_id))
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        top_logprobs.append({token_text(t): lp for t, lp in best} if top else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


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
    """Bodies of one ``/v1/completions`` answer (whole, or as stream chunks)."""

    def __init__(self, model: str, token_text: TokenText, top_logprobs: int) -> None:
        self.id, self.created, self.model = new_id("cmpl"), int(time.time()), model
        self.token_text, self.top = token_text, top_logprobs
        self._sent_tokens: dict[int, int] = {}
        self._sent_chars: dict[int, int] = {}

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}

    def chunk(self, index: int, output: RequestOutput) -> dict[str, Any] | None:
        """The stream chunk for an output's new text, or ``None`` when there is nothing to send yet."""
        if not output.delta_text and not output.finished:
            return None
        start, chars = self._sent_tokens.get(index, 0), self._sent_chars.get(index, 0)
        logprobs = completion_logprobs(output, start, chars, self.token_text, self.top)
        self._sent_tokens[index] = len(output.token_ids)
        self._sent_chars[index] = chars + len(output.delta_text)
        return self._envelope([{"index": index, "text": output.delta_text, "logprobs": logprobs,
                                "finish_reason": finish_reason(output)}])

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope([]), "usage": usage}

    def response(self, finals: dict[int, RequestOutput], usage: dict[str, int]) -> dict[str, Any]:
        choices = [{"index": i, "text": o.text, "logprobs": completion_logprobs(o, 0, 0, self.token_text, self.top),
                    "finish_reason": o.finish_reason} for i, o in sorted(finals.items())]
        return {**self._envelope(choices), "usage": usage}


class ChatBuilder:
    """Bodies of one ``/v1/chat/completions`` answer (whole, or as stream chunks)."""

    def __init__(self, model: str, token_text: TokenText, top_logprobs: int) -> None:
        self.id, self.created, self.model = new_id("chatcmpl"), int(time.time()), model
        self.token_text, self.top = token_text, top_logprobs
        self._sent_tokens: dict[int, int] = {}

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
        start = self._sent_tokens.get(index, 0)
        self._sent_tokens[index] = len(output.token_ids)
        delta = {"content": output.delta_text} if output.delta_text else {}
        return self._envelope("chat.completion.chunk", [{
            "index": index, "delta": delta, "logprobs": chat_logprobs(output, start, self.token_text, self.top),
            "finish_reason": finish_reason(output)}])

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk", []), "usage": usage}

    def response(self, finals: dict[int, RequestOutput], usage: dict[str, int]) -> dict[str, Any]:
        choices = [{"index": i, "message": {"role": "assistant", "content": o.text},
                    "logprobs": chat_logprobs(o, 0, self.token_text, self.top), "finish_reason": o.finish_reason}
                   for i, o in sorted(finals.items())]
        return {**self._envelope("chat.completion", choices), "usage": usage}
