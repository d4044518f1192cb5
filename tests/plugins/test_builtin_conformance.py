"""The conformance suite on the built-in CPU plugins (what CI runs for them).

The suite's tests are imported as they are (a third-party plugin's own test
run can do the same); then the options the default config does not choose.
"""

from __future__ import annotations

import pytest
import torch

from kunlun_infer.testing import build_runtime, check_collectives, check_memory, check_ops, check_streams
from kunlun_infer.testing.suite import *  # noqa: F401,F403 - the suite, on the built-in plugins


@pytest.mark.parametrize("memory", ["caching", "simple"])
def test_memory_options_conform(memory):
    with build_runtime([f"memory={memory}"]) as rt:
        check_memory(rt.memory, rt.device)


def test_torch_ops_cover_and_conform_in_every_dtype():
    with build_runtime(["ops=torch"]) as rt:
        checked = check_ops(rt.ops, rt.device)
    assert {op for op, _ in checked} >= {"rms_norm", "paged_attention", "linear", "store_kv"}
    assert len({dtype for _, dtype in checked}) == 3


def test_sync_streams_conform():
    with build_runtime(["streams=sync"]) as rt:
        check_streams(rt.streams)
        assert not rt.streams.overlaps


def test_a_streams_plugin_saying_asynchronous_in_anything_but_a_bool_fails_the_readback_check():
    from kunlun_infer.plugins.cpu_streams import SyncStreams
    from kunlun_infer.testing.compare import ConformanceError
    from kunlun_infer.testing.streams import check_readback

    class Vague(SyncStreams):
        @property
        def asynchronous(self):
            return "sometimes"

    check_readback(SyncStreams(), torch.device("cpu"))
    with pytest.raises(ConformanceError, match="asynchronous must be a bool"):
        check_readback(Vague(), torch.device("cpu"))


def test_gloo_collectives_exact_across_two_processes():
    check_collectives(["comm=gloo"], world_size=2)
