"""Fixtures for engine tests: cached tiny model folders, their transformers twins, engines that close."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.tiny_models import build_tiny_model, engine_overrides
from tests.platforms import platform  # noqa: F401 - the plugin sets parity tests run on
from tests.torch_threads import one_thread  # noqa: F401 - autouse: one torch thread per test


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(arch) -> Path``: one cached folder per architecture for the whole session."""
    made: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in made:
            made[arch] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def hf_model():
    """``hf_model(folder)``: the transformers model saved there (cached), in eval mode."""
    import transformers as tf

    loaded: dict[Path, torch.nn.Module] = {}

    def get(folder: Path):
        if folder not in loaded:
            loaded[folder] = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        return loaded[folder]

    return get


@pytest.fixture
def make_llm():
    """``make_llm(folder, **keys) -> LLM``; every LLM made is closed after the test."""
    from kunlun_infer import LLM

    made = []

    def make(folder: Path, **keys):
        llm = LLM(model=str(folder), overrides=engine_overrides(**keys))
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()
