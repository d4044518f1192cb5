"""Fixtures for hardening tests: one tiny model for the session, engines that always close.

The model is the smallest the engine serves well (hidden 32, one layer,
byte-level vocabulary of 257), so load, fuzz and lifecycle runs spend their
time in the engine's bookkeeping, not in matrix products.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.tiny_models import build_tiny_model, engine_overrides
from tests.torch_threads import one_thread  # noqa: F401  (autouse for this package)

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny random llama with a byte tokenizer, saved as safetensors."""
    return build_tiny_model(tmp_path_factory.mktemp("hardening-model"), "llama", **TINY)


@pytest.fixture
def flaky(make_distribution, only_plugins):
    """Install the ``flaky`` test plugin (:mod:`tests.hardening.fault_plugin`) through an entry point.

    No other entry-point plugin loads meanwhile.
    """
    from tests.hardening import fault_plugin

    make_distribution("kunlun-infer-flaky", "from tests.hardening.fault_plugin import *\n", entry_point="flaky")
    only_plugins("flaky")
    fault_plugin.ALLOCATORS.clear()
    fault_plugin.PROVIDERS.clear()
    return fault_plugin


def tiny_overrides(folder: Path, **keys) -> list[str]:
    """Overrides for a small engine on ``folder``; ``keys`` like ``cache__num_blocks=8`` win."""
    return engine_overrides(model__path=str(folder), **keys)
