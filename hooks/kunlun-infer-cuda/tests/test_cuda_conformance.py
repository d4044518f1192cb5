"""The framework's conformance suite against every CUDA capability; skipped without a GPU."""

import pytest
import torch

from kunlun_infer.testing.suite import *  # noqa: F401,F403 - the suite's tests are collected here

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
WORLD = 2 if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else 1


@pytest.fixture(scope="module")
def kunlun_overrides():
    # collectives need one GPU per rank; with a single GPU the suite runs them on a group of one
    return ["device=cuda", "memory=cuda", "ops=cuda", "streams=cuda", "comm=nccl" if WORLD > 1 else "comm=single"]
