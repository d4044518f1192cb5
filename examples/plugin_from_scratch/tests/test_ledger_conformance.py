"""The framework's conformance suite against memory=ledger, plus what the ledger itself promises."""

import pytest
import torch

from kunlun_infer import DeviceOutOfMemoryError
from kunlun_infer.testing import build_runtime
from kunlun_infer.testing.suite import (  # noqa: F401 - collected here
    test_memory_allocations,
    test_memory_out_of_memory,
    test_memory_reuse_and_empty_cache,
)


@pytest.fixture(scope="module")
def kunlun_overrides():
    return ["memory=ledger"]


def test_the_limit_is_enforced_with_numbers():
    with build_runtime(["memory=ledger", "memory.limit=4096"]) as runtime:
        a = runtime.memory.allocate((512,), torch.float32)  # 2048 bytes
        with pytest.raises(DeviceOutOfMemoryError) as info:
            runtime.memory.allocate((1024,), torch.float32)  # 4096 more
        assert (info.value.requested, info.value.free, info.value.capacity) == (4096, 2048, 4096)
        runtime.memory.free(a)
