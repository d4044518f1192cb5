"""CLI commands, one module each: ``plugins``, ``config``, and any module exposing ``COMMAND``.

Commands are found by module name and imported only when used, so a command
whose dependencies are missing fails alone, with a clear message.
"""

from __future__ import annotations

import importlib
import pkgutil

from kunlun_infer.commands.base import Command, Flag, Invocation, Param, UsageError, parse_tokens

_NOT_COMMANDS = {"base"}

__all__ = ["Command", "Flag", "Invocation", "Param", "UsageError", "command_names", "load_command", "parse_tokens"]


def command_names() -> list[str]:
    """Names of every command module."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__)
                  if not m.name.startswith("_") and m.name not in _NOT_COMMANDS)


def load_command(name: str) -> Command:
    """The :class:`Command` of module ``name``; :class:`UsageError` if there is none."""
    if name not in command_names():
        raise UsageError(f"unknown command '{name}'; commands: {', '.join(command_names())}")
    module = importlib.import_module(f"{__name__}.{name}")
    command = getattr(module, "COMMAND", None)
    if not isinstance(command, Command):
        raise UsageError(f"module kunlun_infer.commands.{name} defines no COMMAND")
    return command
