"""The framework's conformance suite against every Kunlun capability; skipped without torch_xmlir."""

import importlib.util

import pytest

from kunlun_infer.testing.suite import *  # noqa: F401,F403 - the suite's tests are collected here

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch_xmlir") is None,
                                reason="needs a Kunlun XPU and the vendor's torch_xmlir")


@pytest.fixture(scope="module")
def kunlun_overrides():
    return ["device=kunlun", "memory=kunlun", "ops=kunlun", "streams=kunlun", "comm=bkcl"]
