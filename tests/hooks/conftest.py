"""Fixtures for the hooks packages' integration tests: a tiny random Llama and its transformers references.

The separately installable plugins under ``hooks/`` must be installed
(``pip install ./hooks/*``, as .ci/run does, or ``pip install -e hooks/<pkg> --no-deps``); a test
module that needs one skips with the install command when it is missing.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.engine.tiny_models import build_tiny_model, engine_overrides
from tests.torch_threads import one_thread  # noqa: F401 - autouse: one torch thread per test

SIMCHIP = ["device=simchip", "memory=simchip", "ops=simchip", "streams=simchip"]
PROMPT_LENGTHS = [1, 15, 16, 17, 40, 150]
MAX_TOKENS = 8


def require_package(module: str, folder: str) -> None:
    """Skip the calling module unless the hooks package is installed."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: pip install -e hooks/{folder} --no-deps",
                    allow_module_level=True)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("hooks-llama"), "llama")


@pytest.fixture(scope="session")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="session")
def references(llama_dir, prompts):
    """transformers' greedy continuations of each prompt alone (the oracle)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=256)
            refs.append(out[0, len(p):].tolist())
    return refs


def overrides(*extra: str) -> list[str]:
    """A small engine plus ``extra`` overrides."""
    return [*engine_overrides(), *extra]
