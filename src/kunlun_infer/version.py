"""The distribution's version: one place, read by ``pyproject.toml`` at build time and by the package."""

__version__ = "0.1.0"
