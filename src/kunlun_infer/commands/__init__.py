"""CLI commands, one module each: ``plugins``, ``config``, and any module exposing ``COMMAND``.

Commands are found by module name and imported only when used, so a command
whose dependencies are missing fails alone, with a clear message.
"""

from __future__ import annotations

import importlib
import pkgutil

from kunlun_infer.commands.base import Command, Flag, Invocation, Param, UsageError, parse_tokens

_NOT_COMMANDS = {"base"}

__all__ = ["Command", "Flag", "Invocation", "Param", "UsageError", "command_names", "discover", "load_command", "parse_tokens"]


def command_names() -> list[str]:
    """Names of the modules that may hold a command (helper modules are told apart on import)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__)
                  if not m.name.startswith("_") and m.name not in _NOT_COMMANDS)


def load_command(name: str) -> Command:
    """The :class:`Command` of module ``name``; :class:`UsageError` if there is none."""
    command = _import_command(name) if name in command_names() else None
    if command is None:
        raise UsageError(f"unknown command '{name}'; commands: {', '.join(discover())}")
    return command


def discover() -> dict[str, Command | Exception]:
    """Every command by name; a command module that fails to import maps to its error."""
    found: dict[str, Command | Exception] = {}
    for name in command_names():
        try:
            command = _import_command(name)
        except Exception as exc:  # noqa: BLE001 - one broken command must not hide the others
            found[name] = exc
            continue
        if command is not None:
            found[name] = command
    return found


def _import_command(name: str) -> Command | None:
    command = getattr(importlib.import_module(f"{__name__}.{name}"), "COMMAND", None)
    return command if isinstance(command, Command) else None
