"""The plugin conformance suite: what any capability plugin must do, checked against the references.

Functions raise :class:`ConformanceError` (an ``AssertionError``) with a
message naming the capability, op, dtype and tolerance at fault. The same
checks are packaged as pytest tests in :mod:`kunlun_infer.testing.suite`,
with options and fixtures from :mod:`kunlun_infer.testing.pytest_plugin`.
"""

from kunlun_infer.testing.attention import check_attention_backend
from kunlun_infer.testing.comm import check_collectives, run_collectives
from kunlun_infer.testing.compare import ConformanceError, assert_matches
from kunlun_infer.testing.device import check_device, check_device_lifecycle
from kunlun_infer.testing.harness import build_runtime, plugin_manager
from kunlun_infer.testing.memory import (
    check_allocations,
    check_memory,
    check_out_of_memory,
    check_reuse_and_empty_cache,
)
from kunlun_infer.testing.ops import check_op, check_ops
from kunlun_infer.testing.streams import check_streams

__all__ = [
    "ConformanceError", "assert_matches", "build_runtime", "check_allocations", "check_attention_backend",
    "check_collectives",
    "check_device", "check_device_lifecycle", "check_memory", "check_op", "check_ops", "check_out_of_memory",
    "check_reuse_and_empty_cache", "check_streams", "plugin_manager", "run_collectives",
]
