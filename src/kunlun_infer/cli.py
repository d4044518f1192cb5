"""The ``kunlun-infer`` command line: ``kunlun-infer <command> [key=value…] [--flags]``.

Global flags (before or after the command): ``--debug`` (tracebacks and DEBUG
logs), ``--log-level LEVEL``, ``--version``, ``--help``. Errors of the
project's hierarchy print one line on stderr; exit code 2 for usage and
config errors, 1 for anything else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import TextIO

from kunlun_infer.commands import Invocation, UsageError, discover, load_command, parse_tokens
from kunlun_infer.errors import ConfigError, KunlunInferError
from kunlun_infer.hookspecs import HOOK_API_VERSION_STR
from kunlun_infer.version import __version__

PROG = "kunlun-infer"
_GLOBAL_BOOL = {"--debug", "--help", "-h", "--version"}


def _split_globals(argv: list[str]) -> tuple[dict[str, object], list[str]]:
    opts: dict[str, object] = {"debug": False, "help": False, "version": False, "log_level": None}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token in _GLOBAL_BOOL:
            opts["help" if token == "-h" else token[2:]] = True
        elif token == "--log-level" or token.startswith("--log-level="):
            if "=" in token:
                opts["log_level"] = token.split("=", 1)[1]
            elif i < len(argv):
                opts["log_level"], i = argv[i], i + 1
        else:
            rest.append(token)
    return opts, rest


def _overview() -> str:
    lines = [f"usage: {PROG} <command> [key=value…] [--flags]   (also: python -m kunlun_infer)", "", "commands:"]
    for name, command in discover().items():
        summary = (f"(unavailable: {type(command).__name__}: {command})" if isinstance(command, Exception)
                   else command.summary)
        lines.append(f"  {name:<10} {summary}")
    lines += ["", "global flags: --debug, --log-level LEVEL, --version, --help",
              f"run '{PROG} <command> --help' for a command's parameters and flags"]
    return "\n".join(lines)


@contextlib.contextmanager
def _logging_to(stream: TextIO, level: str | None, debug: bool) -> Iterator[None]:
    """The CLI is an application, so it sets up logging: one handler on stderr, removed afterwards."""
    name = "DEBUG" if debug else (level or "WARNING").upper()
    numeric = logging.getLevelName(name)
    if not isinstance(numeric, int):
        raise ConfigError(f"--log-level {level!r}: use DEBUG, INFO, WARNING or ERROR")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    previous = root.level
    root.addHandler(handler)
    root.setLevel(numeric)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Run the CLI; returns the exit code."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    opts, rest = _split_globals(list(sys.argv[1:] if argv is None else argv))
    try:
        if opts["version"]:
            print(f"{PROG} {__version__} (hook API {HOOK_API_VERSION_STR})", file=stdout)
            return 0
        if not rest:
            print(_overview(), file=stdout if opts["help"] else stderr)
            return 0 if opts["help"] else 2
        command = load_command(rest[0])
        if opts["help"]:
            print(command.usage(), file=stdout)
            return 0
        params, flags, overrides = parse_tokens(command, rest[1:])
        invocation = Invocation(command=command, overrides=overrides, params=params, flags=flags,
                                stdout=stdout, stderr=stderr)
        with _logging_to(stderr, opts["log_level"], bool(opts["debug"])):
            return int(command.run(invocation) or 0)
    except KunlunInferError as exc:
        if opts["debug"]:
            traceback.print_exc(file=stderr)
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=stderr)  # one line, always
        return 2 if isinstance(exc, (ConfigError, UsageError)) else 1
    except BrokenPipeError:  # the reader went away (`kunlun-infer plugins --json | head`)
        if stdout is sys.stdout:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - an unexpected failure still gets one line
        if opts["debug"]:
            traceback.print_exc(file=stderr)
        print(f"{PROG}: internal error: {type(exc).__name__}: {' '.join(str(exc).split())} "
              f"(run with --debug for the traceback)",
              file=stderr)
        return 1
