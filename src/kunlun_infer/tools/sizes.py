"""Byte sizes as people write them (``80GiB``, ``512MiB``, ``1.5e9``) and as the tools print them."""

from __future__ import annotations

import re

from kunlun_infer.errors import ConfigError

_UNITS = {"": 1, "b": 1,
          "k": 2**10, "kb": 10**3, "kib": 2**10,
          "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30,
          "t": 2**40, "tb": 10**12, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:[eE]\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, *, what: str = "size") -> int:
    """Bytes of ``text``: a number of bytes or a number with a unit (``GiB`` binary, ``GB`` decimal)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{what}={text!r} is not a size: write bytes (85899345920) or a number with a unit "
                          f"(80GiB, 512MiB, 80GB)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(f"{what}={text!r} must be positive")
    return value


def format_bytes(n: int | float) -> str:
    """``1536`` → ``1.50 KiB``; exact bytes below 1 KiB; negative sizes keep their sign."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{int(n)} B" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
