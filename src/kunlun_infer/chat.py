"""Chat messages to a prompt: the model's own Jinja chat template, rendered as ``transformers`` renders it.

A model folder carries its template in ``chat_template.jinja`` or under the
``chat_template`` key of ``tokenizer_config.json`` (a string, or a list of
named templates of which ``default`` is used). It is untrusted code, so it
runs in Jinja's immutable sandbox with the environment ``transformers``
gives it: ``trim_blocks`` and ``lstrip_blocks``, the loop-control extension,
a ``tojson`` filter that does not HTML-escape, ``raise_exception``,
``strftime_now``, and the tokenizer's named special tokens (``bos_token``,
``eos_token``, …) in the context. The rendered text is tokenized without
adding special tokens — the template writes them — so the ids equal
``AutoTokenizer.apply_chat_template(messages, add_generation_prompt=True)``.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kunlun_infer.errors import ModelLoadError, RequestError
from kunlun_infer.models.config import read_json

Message = Mapping[str, Any]
Conversation = Sequence[Message]

_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_TEMPLATE_FILE = "chat_template.jinja"


def _template_json(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, > and & for HTML, which would change the prompt
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_from_template(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _plain(value: Any) -> Any:
    """A copy of ``value`` made of plain JSON-like types only, so the sandbox sees no foreign methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value] if isinstance(value, list) else tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):  # pydantic models (e.g. server request messages)
        return _plain(value.model_dump(exclude_none=True))
    return str(value)


def _guarded_namespace() -> type:
    import jinja2.utils
    from jinja2.exceptions import SecurityError

    class GuardedNamespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses private names, so a template cannot reach interpreter internals."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # same calling convention as Jinja's Namespace
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for key in attrs:
                GuardedNamespace.check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key: str, value: Any) -> None:
            GuardedNamespace.check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def check(key: Any) -> None:
            if isinstance(key, str) and key.startswith("_"):
                raise SecurityError(f"chat templates may not set private names on a namespace, got {key!r}")

    return GuardedNamespace


def _compile(source: str) -> Any:
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _template_json
    env.globals["raise_exception"] = _raise_from_template
    env.globals["strftime_now"] = _now
    env.globals["namespace"] = _guarded_namespace()
    return env.from_string(source)


def _special_token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class ChatTemplate:
    """A compiled chat template and the special tokens its context holds. Build with :func:`load_chat_template`."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, origin: str = "") -> None:
        import jinja2

        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _compile(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ModelLoadError(f"{origin or 'chat template'}: the chat template is not valid Jinja "
                                 f"(line {exc.lineno}: {exc.message})") from exc

    def render(self, messages: Conversation, *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """The prompt text for one conversation; :class:`RequestError` (field ``messages``) if it is refused."""
        import jinja2

        chat = check_messages(messages)
        context = {**self.special_tokens, **_plain(extra)}
        try:
            return self._template.render(messages=chat, tools=_plain(tools), documents=None,
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as exc:
            raise RequestError(f"messages: the model's chat template refused the conversation: {exc}",
                               field="messages") from exc
        except Exception as exc:  # noqa: BLE001 - a template may fail any way (1/0, include without loader)
            raise RequestError(f"messages: the model's chat template failed on the conversation: "
                               f"{type(exc).__name__}: {exc}", field="messages") from exc


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Plain-data copy of a conversation; :class:`RequestError` naming the message that is malformed."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise RequestError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                           f"{type(messages).__name__}", field="messages")
    if not messages:
        raise RequestError("messages must hold at least one message, got an empty list", field="messages")
    chat = _plain(list(messages))
    for i, message in enumerate(chat):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be a dict with 'role' and 'content', got "
                               f"{type(message).__name__}", field=f"messages[{i}]")
        if not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}] needs a string 'role' (system, user, assistant, …)",
                               field=f"messages[{i}].role")
        content = message.get("content")
        if content is None and not (message["role"] == "assistant" and message.get("tool_calls")):
            raise RequestError(f"messages[{i}] ({message['role']}) has no 'content'; give it a string (it may be "
                               f"empty): only an assistant message with 'tool_calls' may leave it out",
                               field=f"messages[{i}].content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(f"messages[{i}].content must be a string or a list of content parts, got "
                               f"{type(content).__name__}", field=f"messages[{i}].content")
    return chat


def _named_templates(value: Any, origin: str) -> dict[str, str]:
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, Mapping) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ModelLoadError(f"{origin}: 'chat_template' must be a string or a list of {{'name', 'template'}} "
                         f"objects, got {type(value).__name__}")


def load_chat_template(folder: str | Path, name: str | None = None) -> ChatTemplate:
    """The chat template of a model (or tokenizer) folder.

    ``chat_template.jinja`` wins over the ``chat_template`` key of
    ``tokenizer_config.json``; of several named templates ``name`` (default
    ``"default"``) is used. A folder without one raises :class:`RequestError`
    naming the files looked at, since a chat request cannot be served.
    """
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    special = {key: text for key in _NAMED_SPECIAL if (text := _special_token_text(config.get(key))) is not None}
    template_file = folder / _TEMPLATE_FILE
    if template_file.is_file():
        return ChatTemplate(template_file.read_text(encoding="utf-8"), special, str(template_file))
    if config.get("chat_template") is None:
        raise RequestError(
            f"this model has no chat template: neither {template_file} nor a 'chat_template' key in "
            f"{config_path} exists; send a plain prompt (generate, /v1/completions) or add a template to "
            f"{config_path}", field="messages")
    templates = _named_templates(config["chat_template"], str(config_path))
    wanted = name or "default"
    if wanted not in templates:
        raise RequestError(f"{config_path} has no chat template named {wanted!r}; it has {sorted(templates)}",
                           field="chat_template")
    return ChatTemplate(templates[wanted], special, f"{config_path} (chat_template {wanted!r})")


def engine_chat_template(engine: Any, name: str | None = None) -> ChatTemplate:
    """The chat template of an engine's tokenizer folder (``model.tokenizer``, else the model folder)."""
    if engine.tokenizer is None:
        raise RequestError(f"messages: {engine.model_path} has no tokenizer.json, so chat messages cannot be "
                           f"tokenized; send token ids to generate instead", field="messages")
    return load_chat_template(engine.config.model.tokenizer or engine.model_path, name)


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered chat prompt: the template wrote the special tokens, so none are added."""
    return list(tokenizer.backend.encode(text, add_special_tokens=False).ids)


def is_conversation_list(messages: Any) -> bool:
    """True when ``messages`` is several conversations (a list of lists of messages) rather than one."""
    return (isinstance(messages, Sequence) and not isinstance(messages, (str, bytes)) and len(messages) > 0
            and all(isinstance(c, Sequence) and not isinstance(c, (str, bytes, Mapping)) for c in messages))
