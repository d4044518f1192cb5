"""The framework's conformance suite, run against every simchip capability (collectives over gloo)."""

import pytest

from kunlun_infer.testing.suite import *  # noqa: F401,F403 - the suite's tests are collected here

SIMCHIP = ["device=simchip", "memory=simchip", "ops=simchip", "streams=simchip", "comm=gloo",
           "device.capacity=256MiB"]


@pytest.fixture(scope="module")
def kunlun_overrides():
    return SIMCHIP
