"""Fixtures for tensor-parallel tests: tiny model folders and engine overrides shared by the whole package.

Spawning ranks means starting interpreters that import torch (seconds each on
a busy 2-core machine), so engines are shared per module where tests allow.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.tiny_models import build_tiny_model, engine_overrides
from tests.torch_threads import one_thread  # noqa: F401 - autouse: one torch thread per test


@pytest.fixture(scope="package")
def tiny_model(tmp_path_factory):
    """``tiny_model(arch) -> Path``: one cached folder per architecture (llama, qwen2 with one KV head, qwen3)."""
    made: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in made:
            made[arch] = build_tiny_model(tmp_path_factory.mktemp(f"tp-{arch}"), arch)
        return made[arch]

    return get


def overrides(tensor_size: int = 1, **keys) -> list[str]:
    """Engine overrides for the tiny models with ``parallel.tensor_size``; ``keys`` as in ``engine_overrides``."""
    return engine_overrides(**keys) + [f"parallel.tensor_size={tensor_size}"]
