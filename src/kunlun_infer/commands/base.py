"""What a CLI command is: its ``key=value`` parameters, its ``--flags`` and its ``run``.

A command lives in its own module of :mod:`kunlun_infer.commands` and exposes
``COMMAND = Command(...)``. On the command line, ``key=value`` tokens whose key
is one of the command's :class:`Param` go to the command; every other
``key=value`` (and ``+key=…``/``~key``) is a Hydra override of the run's config.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any, TextIO

from omegaconf import DictConfig

from kunlun_infer.errors import KunlunInferError
from kunlun_infer.runtime import PluginManager, compose_config


class UsageError(KunlunInferError):
    """The command line itself is malformed (unknown flag, bad parameter value)."""


@dataclasses.dataclass(frozen=True)
class Param:
    """A ``name=value`` parameter of a command (``generate prompt="hello"``)."""

    name: str
    help: str
    type: Callable[[str], Any] = str
    default: Any = None
    required: bool = False
    #: may be given several times; the value is then a list
    multiple: bool = False


@dataclasses.dataclass(frozen=True)
class Flag:
    """A ``--name`` flag; boolean unless ``takes_value`` (``--out FILE`` or ``--out=FILE``)."""

    name: str
    help: str
    takes_value: bool = False
    type: Callable[[str], Any] = str
    default: Any = None


@dataclasses.dataclass
class Invocation:
    """One run of a command: its parsed parameters, flags and config overrides."""

    command: Command
    overrides: list[str]
    params: dict[str, Any]
    flags: dict[str, Any]
    stdout: TextIO = dataclasses.field(default_factory=lambda: sys.stdout)
    stderr: TextIO = dataclasses.field(default_factory=lambda: sys.stderr)
    _manager: Any = None
    _config: DictConfig | None = None

    def plugin_manager(self, *, strict: bool | None = None) -> Any:
        """The loaded plugins (one manager per invocation)."""
        if self._manager is None:
            self._manager = PluginManager.load(strict=strict)
        return self._manager

    def config(self) -> DictConfig:
        """The config composed from the overrides (cached)."""
        if self._config is None:
            self._config = compose_config(self.overrides, plugin_manager=self.plugin_manager())
        return self._config

    def print(self, *values: Any, **kwargs: Any) -> None:
        print(*values, file=self.stdout, **kwargs)


@dataclasses.dataclass(frozen=True)
class Command:
    """A CLI command. ``run(invocation) -> exit code``."""

    name: str
    summary: str
    run: Callable[[Invocation], int]
    params: tuple[Param, ...] = ()
    flags: tuple[Flag, ...] = ()
    #: False for commands that take no config overrides (e.g. ``plugins``)
    takes_overrides: bool = True
    description: str = ""

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    def flag(self, name: str) -> Flag | None:
        return next((f for f in self.flags if f.name == name), None)

    def usage(self) -> str:
        """Help text for ``kunlun-infer <name> --help``."""
        lines = [f"usage: kunlun-infer {self.name}"
                 + "".join(f" {p.name}=…" if p.required else f" [{p.name}=…]" for p in self.params)
                 + "".join(f" [--{f.name}{' VALUE' if f.takes_value else ''}]" for f in self.flags)
                 + (" [hydra overrides…]" if self.takes_overrides else ""), "", self.summary]
        if self.description:
            lines += ["", self.description.strip()]
        if self.params:
            lines += ["", "parameters:"] + [f"  {p.name}=…  {p.help}" for p in self.params]
        if self.flags:
            lines += ["", "flags:"] + [f"  --{f.name}{' VALUE' if f.takes_value else ''}  {f.help}" for f in self.flags]
        if self.takes_overrides:
            lines += ["", "Any other key=value is a Hydra override, e.g. device=cpu memory=simple "
                          "scheduler=latency scheduler.max_num_seqs=8."]
        return "\n".join(lines)


def parse_tokens(command: Command, tokens: list[str]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Split ``tokens`` into ``(params, flags, overrides)``; :class:`UsageError` on a bad token."""
    params: dict[str, Any] = {p.name: ([] if p.multiple else p.default) for p in command.params}
    flags: dict[str, Any] = {f.name: (f.default if f.takes_value else False) for f in command.flags}
    overrides: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token.startswith("--"):
            name, has_value, value = token[2:].partition("=")
            flag = command.flag(name)
            if flag is None:
                known = ", ".join(f"--{f.name}" for f in command.flags) or "none"
                raise UsageError(f"unknown flag '--{name}' for '{command.name}'; its flags: {known}")
            if not flag.takes_value:
                if has_value:
                    raise UsageError(f"flag '--{name}' takes no value")
                flags[name] = True
                continue
            if not has_value:
                if i >= len(tokens):
                    raise UsageError(f"flag '--{name}' needs a value")
                value, i = tokens[i], i + 1
            flags[name] = _convert(flag.type, value, f"--{name}")
        elif "=" in token or token.startswith(("+", "~")):
            key, _, value = token.partition("=")
            param = command.param(key)
            if param is None:
                if not command.takes_overrides:
                    raise UsageError(f"'{command.name}' takes no config overrides, got {token!r}")
                overrides.append(token)
            elif param.multiple:
                params[key].append(_convert(param.type, value, key))
            else:
                params[key] = _convert(param.type, value, key)
        else:
            raise UsageError(f"unexpected argument {token!r}: '{command.name}' takes key=value and --flags "
                             f"(see kunlun-infer {command.name} --help)")
    for p in command.params:
        if p.required and params[p.name] in (None, []):
            raise UsageError(f"'{command.name}' needs {p.name}=…: {p.help}")
    return params, flags, overrides


def _convert(kind: Callable[[str], Any], value: str, name: str) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{name}={value!r}: {exc}") from None
