"""The distribution's version: one place, read by ``pyproject.toml`` at build time and by the package; and how
the package and its plugins read another distribution's version."""

from __future__ import annotations

import importlib.metadata

__version__ = "0.1.0"


def distribution_version(name: str) -> str | None:
    """The installed version of distribution ``name`` without importing it (an import may be slow, or fail), or
    ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
