"""Tool calls in a model's own syntax: how to force them (structured output) and how to read them back.

A chat model trained for tools writes a call in the syntax its chat template
teaches. Two styles are known, chosen by ``server.tool_call_parser`` or
detected from the template (:func:`detect_style`):

- ``hermes`` (Hermes, Qwen 2/2.5/3): each call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, free
  text may come before it, parallel calls follow one another.
- ``llama3_json`` (Llama 3.1+): the whole message is the call
  ``{"name": ..., "parameters": {...}}`` (after an optional
  ``<|python_tag|>``); parallel calls are joined by ``"; "``.

:func:`forced_calls` turns ``tool_choice`` ``required`` or a named function
into a :class:`~kunlun_infer.engine.structured_output.TaggedSequence`, so the
arguments always parse against the function's schema. :class:`ToolCallParser`
reads a message as it streams: text outside calls comes out as content, a
call as soon as its name is known, then its arguments piece by piece — the
raw JSON text the model wrote. The non-streaming answer is the same parser
fed the whole text, so both agree.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from kunlun_infer.engine.structured_output import StructuredOutput, TaggedJSON, TaggedSequence


@dataclasses.dataclass(frozen=True)
class ToolCallStyle:
    """How one family of chat models writes tool calls."""

    name: str
    #: text before / after each call's JSON object, as the model writes it when forced
    begin: str
    end: str
    #: between parallel calls, when forced
    separator: str
    #: the key of the call object holding the arguments
    arguments_key: str
    #: the tag that opens a call in free text (``None``: the message itself is the call)
    open_tag: str | None = None
    close_tag: str | None = None
    #: a marker that may come before the calls and is dropped
    prefix: str | None = None


STYLES: dict[str, ToolCallStyle] = {
    "hermes": ToolCallStyle("hermes", begin="<tool_call>\n", end="\n</tool_call>", separator="\n",
                            arguments_key="arguments", open_tag="<tool_call>", close_tag="</tool_call>"),
    "llama3_json": ToolCallStyle("llama3_json", begin="", end="", separator="; ", arguments_key="parameters",
                                 prefix="<|python_tag|>"),
}


def detect_style(template_source: str) -> str | None:
    """The tool-call style a chat template teaches, or ``None`` when it shows none."""
    if "<tool_call>" in template_source:
        return "hermes"
    if "<|python_tag|>" in template_source or ("ipython" in template_source and '"parameters"' in template_source):
        return "llama3_json"
    return None


def forced_calls(style: ToolCallStyle, tools: Sequence[Mapping[str, Any]], *, parallel: bool) -> StructuredOutput:
    """Structured output that admits only well-formed calls of ``tools`` (each ``{"type": "function", ...}``).

    One call unless ``parallel``; each call's arguments valid against its
    function's ``parameters`` schema (any object when it has none).
    """
    tags = []
    for tool in tools:
        function = tool["function"]
        schema = {"type": "object", "properties": {
            "name": {"enum": [function["name"]]},
            style.arguments_key: function.get("parameters") or {"type": "object"},
        }, "required": ["name", style.arguments_key]}
        tags.append(TaggedJSON(style.begin, schema, style.end))
    return StructuredOutput(tagged=TaggedSequence(tuple(tags), style.separator, None if parallel else 1))


@dataclasses.dataclass
class ToolCall:
    """One call read from a message: ``arguments`` is the JSON text the model wrote."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class ToolCallDelta:
    """What a message gained: content text, and per call its header (first time) and more arguments text."""

    content: str = ""
    #: ``{"index", "id"?, "name"?, "arguments"}`` per call that progressed, in order
    calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def add_call(self, index: int, **fields: Any) -> None:
        if self.calls and self.calls[-1]["index"] == index:
            entry = self.calls[-1]
            entry["arguments"] = entry.get("arguments", "") + fields.pop("arguments", "")
            entry.update(fields)
        else:
            self.calls.append({"index": index, "arguments": "", **fields})


class _CallScanner:
    """Reads one JSON call object as it arrives and knows, at any point, its name and its arguments so far."""

    def __init__(self, arguments_key: str) -> None:
        self.arguments_key = arguments_key
        self.text = ""
        self.done = False
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect = "open"  # open, key, colon, value, comma (at the object's own level)
        self._key: str | None = None
        self._key_start = 0
        self._value_start: int | None = None
        self._value_kind = ""  # container, string or scalar
        #: key -> (start, end) of its value in ``text`` (end None while the value is being written)
        self.spans: dict[str, tuple[int, int | None]] = {}

    def feed(self, chunk: str) -> int:
        """Consume ``chunk`` up to the end of the object; how many characters were used."""
        for used, ch in enumerate(chunk):
            if self.done:
                return used
            position = len(self.text)
            self.text += ch
            self._step(ch, position)
        return len(chunk)

    def _step(self, ch: str, i: int) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                if self._depth == 1 and self._expect == "key_string":
                    self._key = json.loads(self.text[self._key_start:i + 1])
                    self._expect = "colon"
                elif self._depth == 1 and self._value_kind == "string":
                    self._end_value(i + 1)
            return
        if self._expect == "open":
            if ch == "{":
                self._depth, self._expect = 1, "key"
            return
        if self._depth == 1 and self._value_kind == "scalar" and (ch in ",}" or ch.isspace()):
            self._end_value(i)
        if ch.isspace():
            return
        if self._depth == 1 and self._expect == "key":
            if ch == '"':
                self._in_string, self._key_start, self._expect = True, i, "key_string"
            elif ch == "}":
                self._close()
            return
        if self._depth == 1 and self._expect == "colon":
            if ch == ":":
                self._expect = "value"
            return
        if self._depth == 1 and self._expect == "value":
            self._value_start = i
            self.spans[self._key or ""] = (i, None)
            self._expect = "in_value"
            if ch in "{[":
                self._value_kind, self._depth = "container", 2
            elif ch == '"':
                self._value_kind, self._in_string = "string", True
            else:
                self._value_kind = "scalar"
            return
        if self._depth == 1 and self._expect == "comma":
            if ch == ",":
                self._expect = "key"
            elif ch == "}":
                self._close()
            return
        if self._depth >= 2:
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._end_value(i + 1)

    def _end_value(self, end: int) -> None:
        start = self._value_start if self._value_start is not None else end
        self.spans[self._key or ""] = (start, end)
        self._value_start, self._value_kind, self._expect = None, "", "comma"
        if self.text[end:end + 1] == "}" and self._depth == 1:  # a scalar ended by the closing brace
            self._close()

    def _close(self) -> None:
        self._depth, self.done = 0, True

    @property
    def name(self) -> str | None:
        """The call's name once its string is complete."""
        span = self.spans.get("name")
        if span is None or span[1] is None:
            return None
        value = json.loads(self.text[span[0]:span[1]])
        return value if isinstance(value, str) else None

    def arguments_so_far(self) -> str:
        """The arguments' JSON text written so far (a scalar only once it is complete)."""
        span = self.spans.get(self.arguments_key)
        if span is None:
            return ""
        start, end = span
        if end is None:
            return "" if self._value_kind == "scalar" else self.text[start:]
        return self.text[start:end]

    def parsed(self) -> tuple[str, str] | None:
        """``(name, arguments text)`` when the object is complete and well formed, else ``None``."""
        try:
            value = json.loads(self.text)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or \
                not isinstance(value.get(self.arguments_key), dict):
            return None
        return value["name"], self.arguments_so_far()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """Splits one assistant message, fed piece by piece, into content and tool calls (see module docstring)."""

    def __init__(self, style: ToolCallStyle, *, parallel: bool = True) -> None:
        self.style = style
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self.content = ""
        self._pending = ""  # text not yet decided on
        self._held_space = ""  # whitespace that is content unless a call follows it
        self._scanner: _CallScanner | None = None
        self._call_text = ""  # the current call's raw text, tag included (given back as content if malformed)
        self._announced = False
        self._sent_arguments = 0
        self._mode = "undecided" if style.open_tag is None else "text"

    # ------------------------------------------------------------------ feeding

    def feed(self, text: str) -> ToolCallDelta:
        """The delta ``text`` adds to the message (held-back text comes out when it is decided)."""
        delta = ToolCallDelta()
        self._pending += text
        self._advance(delta, final=False)
        return delta

    def finish(self) -> ToolCallDelta:
        """The rest of the message: held text, and a call cut short (kept if it was announced)."""
        delta = ToolCallDelta()
        self._advance(delta, final=True)
        if self._scanner is not None:
            self._end_call(delta, complete=False)
            if self.style.close_tag and self.style.close_tag.startswith(self._pending):
                self._pending = ""  # the cut-off beginning of the close tag
        if self._mode == "undecided" or self._pending:
            self._emit_content(delta, self._pending)
            self._pending = ""
        if not self.calls and self._held_space:
            delta.content += self._held_space
            self.content += self._held_space
        self._held_space = ""
        return delta

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def _advance(self, delta: ToolCallDelta, *, final: bool) -> None:
        while self._pending:
            before = (self._pending, self._mode, self._scanner)
            if self._scanner is not None:
                self._feed_call(delta)
            elif self._mode == "undecided":
                self._decide(final)
            elif self._mode == "text":
                self._scan_text(delta, final)
            elif self._mode == "json":
                self._between_json_calls(delta)
            else:  # "content": this message holds no calls
                self._emit_content(delta, self._pending)
                self._pending = ""
            if (self._pending, self._mode, self._scanner) == before:
                return  # waiting for more text

    def _decide(self, final: bool) -> None:
        """llama3_json: a message that starts with a call object (after a marker) is calls, else content."""
        text = self._pending.lstrip()
        prefix = self.style.prefix or ""
        if prefix and text.startswith(prefix):
            text = text[len(prefix):].lstrip()
        elif prefix and prefix.startswith(text) and not final:
            return  # maybe the marker, maybe not
        if not text and not final:
            return
        if text.startswith("{"):
            self._mode, self._pending = "json", text
        else:
            self._mode = "content"

    def _scan_text(self, delta: ToolCallDelta, final: bool) -> None:
        tag = self.style.open_tag or ""
        at = self._pending.find(tag)
        if at >= 0:
            self._emit_content(delta, self._pending[:at])
            self._pending = self._pending[at + len(tag):]
            self._start_call(tag)
            return
        keep = 0 if final else _partial_suffix(self._pending, tag)
        self._emit_content(delta, self._pending[:len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]

    def _between_json_calls(self, delta: ToolCallDelta) -> None:
        stripped = self._pending.lstrip().lstrip(";").lstrip()
        if not stripped:
            self._pending = ""
            return
        if stripped.startswith("{"):
            self._pending = stripped
            self._start_call("")
        else:  # text after the calls: content
            self._mode = "content"
            self._pending = stripped

    def _start_call(self, tag: str) -> None:
        self._held_space = ""
        self._scanner = _CallScanner(self.style.arguments_key)
        self._call_text = tag
        self._announced = False
        self._sent_arguments = 0

    def _feed_call(self, delta: ToolCallDelta) -> None:
        scanner = self._scanner
        assert scanner is not None
        close = self.style.close_tag
        if close is not None:
            at = self._pending.find(close)
            body = self._pending if at < 0 else self._pending[:at]
            if at < 0:  # the close tag may be arriving: keep its possible beginning back
                body = body[:len(body) - _partial_suffix(body, close)]
            used = scanner.feed(body)
            self._call_text += body[:used]
            if used < len(body):  # past the object: everything up to the close tag belongs to the call
                self._call_text += body[used:]
            self._pending = self._pending[len(body):]
            self._stream_call(delta)
            if at >= 0 and self._pending.startswith(close):
                self._call_text += close
                self._pending = self._pending[len(close):]
                self._end_call(delta, complete=True)
            return
        used = scanner.feed(self._pending)
        self._call_text += self._pending[:used]
        self._pending = self._pending[used:]
        self._stream_call(delta)
        if scanner.done:
            self._end_call(delta, complete=True)

    def _stream_call(self, delta: ToolCallDelta) -> None:
        scanner = self._scanner
        if scanner is None or (not self.parallel and len(self.calls) >= 1):
            return
        index = len(self.calls)
        if not self._announced:
            name = scanner.name
            if name is None:
                return
            self._announced = True
            self._call_id = new_call_id()
            delta.add_call(index, id=self._call_id, type="function", name=name)
        arguments = scanner.arguments_so_far()
        if len(arguments) > self._sent_arguments:
            delta.add_call(index, arguments=arguments[self._sent_arguments:])
            self._sent_arguments = len(arguments)

    def _end_call(self, delta: ToolCallDelta, *, complete: bool) -> None:
        scanner, self._scanner = self._scanner, None
        assert scanner is not None
        if self.style.open_tag is None:
            self._mode = "json"
        if not self.parallel and self.calls:
            return  # one call was asked for: later ones are dropped
        parsed = scanner.parsed() if complete else None
        if self._announced:
            name = scanner.name or ""
            arguments = parsed[1] if parsed else scanner.arguments_so_far()
            self.calls.append(ToolCall(self._call_id, name, arguments))
        elif parsed is not None:  # an object that named itself only at the end
            call = ToolCall(new_call_id(), parsed[0], parsed[1])
            self.calls.append(call)
            delta.add_call(len(self.calls) - 1, id=call.id, type="function", name=call.name,
                           arguments=call.arguments)
        else:  # not a call after all: its text is content
            self._emit_content(delta, self._call_text)
            if self.style.open_tag is None:
                self._mode = "content"

    def _emit_content(self, delta: ToolCallDelta, text: str) -> None:
        if not text:
            return
        if not text.strip():
            self._held_space += text
            return
        text, self._held_space = self._held_space + text, ""
        stripped = text.rstrip()
        self._held_space = text[len(stripped):]
        delta.content += stripped
        self.content += stripped


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a beginning of ``tag`` (0 when none)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def parse_tool_calls(style: ToolCallStyle, text: str, *, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """A whole message: ``(content or None, calls)``, exactly what streaming it would give."""
    parser = ToolCallParser(style, parallel=parallel)
    parser.feed(text)
    parser.finish()
    return (parser.content or None), parser.calls
