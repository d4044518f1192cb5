"""Plugins registered by code (``register=my_pkg.plugin``), for a chip whose plugin is not installed yet.

The bring-up tools accept the import path of a plugin module, the way the
conformance suite's ``--kunlun-register`` does, so a plugin can be doctored,
planned and benchmarked before it is packaged. A module that does not fit
(import error, hook-API mismatch) is recorded like a broken entry point:
``doctor`` reports it at stage 2, the other tools refuse with its error.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from kunlun_infer.commands.base import Param
from kunlun_infer.errors import PluginError
from kunlun_infer.runtime.manager import LoadError

REGISTER_PARAM = Param("register", "import path of a plugin module to register by code, for a plugin not "
                                   "installed yet (repeatable)", multiple=True)


def register_modules(manager: Any, modules: Sequence[str], *, strict: bool) -> None:
    """Register each module on ``manager``; a failure raises (``strict``) or joins ``manager.load_errors``."""
    for path in modules:
        try:
            try:
                module = importlib.import_module(path)
            except Exception as exc:
                raise PluginError(f"plugin module '{path}' failed to import: {type(exc).__name__}: {exc}",
                                  plugin=path, hook="import") from exc
            manager.register(module, source="api", entry_point=path)
        except PluginError as error:
            if strict:
                raise
            manager.load_errors.append(LoadError(path, path, None, None, error))
