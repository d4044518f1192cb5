"""Fixtures for model tests: the real CPU runtime and cached tiny HF model folders."""

from __future__ import annotations

import pytest
import torch

from tests.models.hf_factory import build_hf_model


@pytest.fixture(scope="package")
def runtime():
    """The default composed runtime (cpu device, torch ops)."""
    from kunlun_infer.runtime import Runtime, compose_config

    rt = Runtime.from_config(compose_config([]))
    yield rt
    rt.close()


@pytest.fixture(scope="package")
def hf_folder(tmp_path_factory):
    """``hf_folder(arch, dtype=float32, **overrides) -> (folder, transformers model)``, cached per arguments."""
    made = {}

    def get(arch: str = "llama", dtype: torch.dtype = torch.float32, **overrides):
        key = repr((arch, dtype, sorted(overrides.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(arch)
            made[key] = (folder, build_hf_model(folder, arch, dtype=dtype, **overrides))
        return made[key]

    return get
