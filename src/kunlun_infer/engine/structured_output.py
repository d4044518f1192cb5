"""What structured output a request asks for: :class:`StructuredOutput`, checked when it is built.

A request may constrain its generated text to one of: a JSON schema, any
JSON object, a regular expression, a fixed list of choices, an EBNF grammar,
or a sequence of tagged JSON segments (how tool calls are forced: each
segment is ``begin`` + JSON valid against one schema + ``end``). The engine
hands the spec to the logits processor chosen by ``structured.backend``
(see :mod:`kunlun_infer.engine.structured`), which compiles it and masks
every step's logits so only tokens that keep the text inside the language
can be drawn. Checking that a schema or a regex is *valid* is the backend's
job (it refuses with a :class:`RequestError` when the request is added);
here only the shape is checked. A spec is frozen and hashable, so compiled
grammars are cached by it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from kunlun_infer.errors import RequestError

FIELD = "structured"
#: the kinds of constraint, in the order they are named in messages
KINDS = ("json", "json_object", "regex", "choice", "grammar", "tagged")


def _schema_text(value: Any, field: str) -> str:
    """A JSON schema as JSON text (key order kept: it is the order the text will have)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RequestError(f"{field} must be a JSON schema (an object), got text that is not JSON: {exc}",
                               field=field) from None
    if isinstance(value, bool):
        value = {} if value else {"not": {}}
    if not isinstance(value, Mapping):
        raise RequestError(f"{field} must be a JSON schema (an object), got {type(value).__name__}", field=field)
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise RequestError(f"{field} must be plain JSON data: {exc}", field=field) from None


@dataclasses.dataclass(frozen=True)
class TaggedJSON:
    """One segment of a :class:`TaggedSequence`: ``begin``, a JSON value valid against ``schema``, ``end``."""

    begin: str
    schema: str
    end: str

    def __post_init__(self) -> None:
        for name in ("begin", "end"):
            if not isinstance(getattr(self, name), str):
                raise RequestError(f"{FIELD}.tagged: a tag's {name} must be a string", field=FIELD)
        object.__setattr__(self, "schema", _schema_text(self.schema, f"{FIELD}.tagged.schema"))

    @property
    def schema_dict(self) -> dict[str, Any]:
        return json.loads(self.schema)


@dataclasses.dataclass(frozen=True)
class TaggedSequence:
    """Text made of 1 to ``max_count`` (``None`` = any number) segments, each one of ``tags``, joined by ``separator``."""

    tags: tuple[TaggedJSON, ...]
    separator: str = ""
    max_count: int | None = None

    def __post_init__(self) -> None:
        tags = tuple(self.tags) if isinstance(self.tags, (list, tuple)) else None
        if not tags or not all(isinstance(t, TaggedJSON) for t in tags):
            raise RequestError(f"{FIELD}.tagged needs at least one TaggedJSON tag", field=FIELD)
        object.__setattr__(self, "tags", tags)
        if not isinstance(self.separator, str):
            raise RequestError(f"{FIELD}.tagged.separator must be a string", field=FIELD)
        if self.max_count is not None and (not isinstance(self.max_count, int) or isinstance(self.max_count, bool)
                                           or self.max_count < 1):
            raise RequestError(f"{FIELD}.tagged.max_count must be an integer >= 1 or None, got "
                               f"{self.max_count!r}", field=FIELD)


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """The language the generated text must belong to; set exactly one field.

    ``json``: a JSON schema (a dict, or its JSON text); the text is one JSON
    value valid against it. ``json_object``: any JSON object. ``regex``: the
    whole text matches the regular expression. ``choice``: the text is
    exactly one of these strings. ``grammar``: an EBNF grammar whose start
    rule is ``root`` (the GBNF-style dialect of the grammar backend).
    ``tagged``: a :class:`TaggedSequence` (tool calls). JSON is written
    compactly (``", "`` and ``": "`` as separators, no other whitespace), so
    a model cannot wander off into blank space.

    The text ends once the language allows nothing more: then only the
    request's stop tokens (the model's EOS) may be drawn.
    """

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    tagged: TaggedSequence | None = None

    def __post_init__(self) -> None:
        set_kinds = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(set_kinds) != 1:
            got = ", ".join(set_kinds) or "none"
            raise RequestError(f"{FIELD} must set exactly one of {', '.join(KINDS)}; got {got}", field=FIELD)
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json, f"{FIELD}.json"))
        if not isinstance(self.json_object, bool):
            raise RequestError(f"{FIELD}.json_object must be true or false, got {self.json_object!r}", field=FIELD)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(f"{FIELD}.{name} must be a non-empty string, got {value!r}", field=FIELD)
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, (str, bytes)) or not isinstance(choice, (list, tuple)) or not choice \
                    or not all(isinstance(c, str) and c for c in choice):
                raise RequestError(f"{FIELD}.choice must be a non-empty list of non-empty strings, got {choice!r}",
                                   field=FIELD)
            object.__setattr__(self, "choice", tuple(choice))
        if self.tagged is not None and not isinstance(self.tagged, TaggedSequence):
            raise RequestError(f"{FIELD}.tagged must be a TaggedSequence, got {type(self.tagged).__name__}",
                               field=FIELD)

    @property
    def kind(self) -> str:
        """Which field is set: ``json``, ``json_object``, ``regex``, ``choice``, ``grammar`` or ``tagged``."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema as a dict (``None`` unless ``json`` is set)."""
        return None if self.json is None else json.loads(self.json)

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutput | None:
        """``None``, a :class:`StructuredOutput`, or a dict of its fields (``{"regex": "[0-9]+"}``)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(KINDS))
            if unknown:
                raise RequestError(f"{FIELD}: unknown field(s) {', '.join(map(str, unknown))}; the fields are "
                                   f"{', '.join(KINDS)}", field=FIELD)
            return cls(**value)
        raise RequestError(f"{FIELD} must be a StructuredOutput or a dict of its fields, got {type(value).__name__}",
                           field=FIELD)
