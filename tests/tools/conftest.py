"""Fixtures for the bring-up tools: one torch thread, a cached tiny model, the CLI run in-process."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kunlun_infer.tools.tiny_model import write_tiny_model
from tests.torch_threads import one_thread  # noqa: F401 - autouse: one torch thread per test


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama folder (config.json, model.safetensors, tokenizer.json)."""
    return write_tiny_model(tmp_path_factory.mktemp("tools") / "tiny")


class CliResult:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    def json(self):
        return json.loads(self.out)


@pytest.fixture
def cli():
    """``cli("plan", "model.path=…") -> CliResult``: the kunlun-infer CLI, in this process."""
    from kunlun_infer.cli import main

    def run(*argv: str) -> CliResult:
        out, err = io.StringIO(), io.StringIO()
        code = main([str(a) for a in argv], stdout=out, stderr=err)
        return CliResult(code, out.getvalue(), err.getvalue())

    return run
