"""Config checks and error translation: every bad config becomes one clear :class:`ConfigError` line.

Hydra and OmegaConf report problems as multi-line messages about their own
internals; a user needs the group, key or value at fault and what is allowed.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from kunlun_infer.errors import ConfigError

TARGET_KEY = "_target_"
_TARGET_MESSAGE = ("configs never carry '_target_': implementations are chosen by registered name "
                   "(e.g. device=cpu); remove '_target_'")


def _override_key(override: str) -> str:
    key = override.split("=", 1)[0].strip()
    return key.lstrip("+~").split("@", 1)[0]


def _override_value(override: str) -> str | None:
    return override.split("=", 1)[1] if "=" in override else None


def refuse_target_overrides(overrides: Sequence[str]) -> None:
    """Refuse overrides that name ``_target_`` in their key or value."""
    for override in overrides:
        if TARGET_KEY in override:
            raise ConfigError(f"{override}: {_TARGET_MESSAGE}")


def refuse_targets(node: Any, path: str = "") -> None:
    """Refuse ``_target_`` anywhere in a config, including one built by hand rather than composed."""
    if isinstance(node, (DictConfig, dict)):
        items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else node.items()
        for key, value in items:
            full_key = f"{path}.{key}" if path else str(key)
            if key == TARGET_KEY:
                raise ConfigError(f"{full_key}: {_TARGET_MESSAGE}")
            refuse_targets(value, full_key)
    elif isinstance(node, (ListConfig, list, tuple)) and not (isinstance(node, ListConfig) and node._is_none()):
        for index, item in enumerate(node):
            refuse_targets(item, f"{path}[{index}]")


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_type_name(a) for a in inner) + " or null"
    return getattr(hint, "__name__", str(hint))


def _field_hints(object_type: Any) -> dict[str, Any]:
    if not (isinstance(object_type, type) and dataclasses.is_dataclass(object_type)):
        return {}
    try:
        return typing.get_type_hints(object_type)
    except Exception:  # a plugin schema with unresolvable annotations: fall back to the raw ones
        return {f.name: f.type for f in dataclasses.fields(object_type)}


def _parent_path(full_key: str) -> str:
    return full_key.rsplit(".", 1)[0] if "." in full_key else ""


def _value_for(full_key: str, overrides: Sequence[str]) -> str | None:
    for override in reversed(overrides):
        if _override_key(override) == full_key:
            return _override_value(override)
    return None


def translate_error(exc: BaseException, overrides: Sequence[str], manager: Any = None) -> ConfigError:
    """One-line :class:`ConfigError` for an exception raised while composing."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    if isinstance(exc, MissingConfigException) and exc.options is not None and exc.missing_cfg_file:
        group, _, option = str(exc.missing_cfg_file).rpartition("/")
        available = [o for o in exc.options if not o.startswith("_")]
        message = (f"{group}={option}: no such option in group '{group}'; available: "
                   f"{', '.join(available) or 'none'}")
        broken = getattr(manager, "load_errors", None) or []
        if broken:
            message += "; plugins that failed to load: " + "; ".join(f"{e.name} ({e.message})" for e in broken)
        return ConfigError(message)
    if isinstance(exc, OverrideParseException):
        lines = [line for line in str(exc).splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 else lines[0]
        bad = next((o for o in overrides if f"'{o}'" in lines[0]), lines[0])
        return ConfigError(f"cannot parse override {bad!r}: write key=value ({detail})")
    cause = exc if isinstance(exc, (ValidationError, ConfigKeyError, ConfigAttributeError)) else exc.__cause__
    full_key = getattr(cause, "full_key", None)
    if full_key and isinstance(cause, ValidationError):
        hints = _field_hints(getattr(cause, "object_type", None))
        key = full_key.rsplit(".", 1)[-1]
        value = _value_for(full_key, overrides)
        expected = f"expected {_type_name(hints[key])}" if key in hints else _first_line(cause)
        shown = f"={value}" if value is not None else ""
        return ConfigError(f"{full_key}{shown}: bad value ({_first_line(cause)}); {expected}")
    if full_key and isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        return _unknown_key(full_key, getattr(cause, "object_type", None))
    return ConfigError(f"invalid config: {_first_line(exc)}")


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, with the next one when the first only introduces it."""
    lines = [line.strip() for line in str(getattr(exc, "msg", None) or exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def _unknown_key(full_key: str, object_type: Any) -> ConfigError:
    parent = _parent_path(full_key)
    known = sorted(_field_hints(object_type)) if object_type is not None else []
    where = f"in '{parent}'" if parent else "at the top level"
    listing = f"; known keys {where}: {', '.join(known)}" if known else ""
    return ConfigError(f"{full_key}: unknown key '{full_key.rsplit('.', 1)[-1]}' {where}{listing}")


def check_composed(cfg: DictConfig) -> None:
    """Refuse ``_target_``, keys outside the schema (``+key=`` additions) and unset required values."""
    _walk(cfg, "")
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        key = missing[0]
        group = key.split(".", 1)[0]
        raise ConfigError(f"{key} is not set; choose an option of group '{group}' (e.g. {group}=<name>) "
                          f"or set {key}=<value>")


def _walk(node: Any, path: str) -> None:
    if isinstance(node, DictConfig):
        object_type = OmegaConf.get_type(node)
        hints = _field_hints(object_type)
        for key in node.keys():
            full_key = f"{path}.{key}" if path else str(key)
            if key == TARGET_KEY:
                raise ConfigError(f"{full_key}: {_TARGET_MESSAGE}")
            if hints and key not in hints:
                raise _unknown_key(full_key, object_type)
            if not OmegaConf.is_missing(node, key):
                _walk(node._get_node(key), full_key)
    elif isinstance(node, ListConfig) and not node._is_none():
        for index, item in enumerate(node):
            _walk(item, f"{path}[{index}]")
