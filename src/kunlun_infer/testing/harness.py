"""Build the runtime under test from Hydra overrides, optionally registering plugin modules first.

``modules`` are import paths of plugin modules registered by code (for a
plugin that is not installed as a distribution yet); everything else comes
from the installed entry points, exactly as in a real run.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from kunlun_infer.runtime import PluginManager, Runtime, compose_config


def plugin_manager(modules: Sequence[str] = ()) -> PluginManager:
    """The installed plugins plus ``modules`` (import paths) registered by code."""
    manager = PluginManager.load()
    for path in modules:
        manager.register(importlib.import_module(path), source="api")
    return manager


def build_runtime(overrides: Sequence[str] = (), modules: Sequence[str] = (), *, local_rank: int = 0) -> Runtime:
    """Compose ``overrides`` and build the runtime they describe."""
    manager = plugin_manager(modules)
    cfg = compose_config(list(overrides), plugin_manager=manager)
    return Runtime.from_config(cfg, local_rank=local_rank, plugin_manager=manager)
