"""The conformance tests, as pytest tests any capability plugin's own test run can collect.

Run them against the plugins chosen by Hydra overrides::

    pytest --pyargs kunlun_infer.testing.suite --kunlun-plugin "device=simchip memory=simchip"

or import them into a test module of your own (``from kunlun_infer.testing.suite import *``)
and pass ``--kunlun-plugin`` (or set ``KUNLUN_INFER_CONFORMANCE``). Without
either, the built-in CPU plugins are tested. An op the ops plugin does not
provide is reported as skipped: runs use the reference for it; so is the
attention backend of an ops plugin that has none (runs use the reference
backend over its ``store_kv`` and ``paged_attention``).
"""

from __future__ import annotations

import pytest

from kunlun_infer.ops import OP_SPECS, TOLERANCES
from kunlun_infer.ops.attention import AttentionSpec, MLAAttentionBackend
from kunlun_infer.runtime import compose_config
from kunlun_infer.testing.attention import DEFAULT_MLA_SHAPES, DEFAULT_SHAPES, check_backend, mla_specs
from kunlun_infer.testing.comm import check_collectives, run_collectives
from kunlun_infer.testing.device import check_device, check_device_lifecycle
from kunlun_infer.testing.harness import plugin_manager
from kunlun_infer.testing.memory import check_allocations, check_out_of_memory, check_reuse_and_empty_cache
from kunlun_infer.testing.ops import check_op
from kunlun_infer.testing.streams import check_readback, check_streams

__all__ = [
    "test_attention_backend_matches_reference", "test_mla_attention_backend_matches_reference",
    "test_collectives_exact", "test_device_conformance", "test_device_lifecycle", "test_memory_allocations",
    "test_memory_out_of_memory", "test_memory_reuse_and_empty_cache", "test_op_matches_reference",
    "test_streams_ordering_and_events", "test_streams_readback_of_overlapped_steps",
]


def test_device_conformance(kunlun_runtime):
    check_device(kunlun_runtime.device)


def test_device_lifecycle(kunlun_overrides, kunlun_plugin_modules):
    manager = plugin_manager(kunlun_plugin_modules)
    cfg = compose_config(kunlun_overrides, plugin_manager=manager)
    _, factory = manager.factory("device", cfg.device.name)
    check_device_lifecycle(factory(config=cfg.device, local_rank=0))


def test_memory_allocations(kunlun_runtime):
    check_allocations(kunlun_runtime.memory)


def test_memory_reuse_and_empty_cache(kunlun_runtime):
    check_reuse_and_empty_cache(kunlun_runtime.memory)


def test_memory_out_of_memory(kunlun_runtime):
    check_out_of_memory(kunlun_runtime.memory, kunlun_runtime.device)


def _device_for(kunlun_runtime, dtype):
    """The runtime's device, or the test skipped when the device does not support ``dtype``."""
    device = kunlun_runtime.device
    if dtype not in device.supported_dtypes():
        pytest.skip(f"device '{device.name}' does not support {dtype}")
    return device


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("op", list(OP_SPECS))
def test_op_matches_reference(kunlun_runtime, op, dtype):
    provider = kunlun_runtime.ops
    if not provider.supports(op):
        pytest.skip(f"ops plugin '{kunlun_runtime.plugin_for('ops')}' does not provide {op}; runs use the reference")
    device = _device_for(kunlun_runtime, dtype)
    for seed in range(OP_SPECS[op].variants):
        check_op(provider, op, dtype, device.torch_device, seed=seed)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", DEFAULT_SHAPES, ids=lambda s: "q{}-kv{}-d{}".format(*s))
def test_attention_backend_matches_reference(kunlun_runtime, shape, dtype):
    device = _device_for(kunlun_runtime, dtype)
    spec = AttentionSpec(num_heads=shape[0], num_kv_heads=shape[1], head_dim=shape[2], dtype=dtype)
    backend = kunlun_runtime.ops.attention_backend(spec)
    if backend is None:
        pytest.skip(f"ops plugin '{kunlun_runtime.plugin_for('ops')}' has no attention backend for this shape; "
                    f"runs use the reference backend over its store_kv and paged_attention")
    check_backend(backend, spec, device.torch_device)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", DEFAULT_MLA_SHAPES, ids=lambda s: "h{}-nope{}-rope{}-latent{}-v{}".format(*s))
def test_mla_attention_backend_matches_reference(kunlun_runtime, shape, dtype):
    device = _device_for(kunlun_runtime, dtype)
    (spec,) = mla_specs([shape], dtype)
    backend = kunlun_runtime.ops.attention_backend(spec)
    if not isinstance(backend, MLAAttentionBackend):
        pytest.skip(f"ops plugin '{kunlun_runtime.plugin_for('ops')}' has no MLA attention backend; runs use the "
                    f"framework's reference MLA backend")
    check_backend(backend, spec, device.torch_device)


def test_streams_ordering_and_events(kunlun_runtime):
    check_streams(kunlun_runtime.streams)


def test_streams_readback_of_overlapped_steps(kunlun_runtime):
    check_readback(kunlun_runtime.streams, kunlun_runtime.device.torch_device)


def test_collectives_exact(kunlun_runtime, kunlun_overrides, kunlun_plugin_modules):
    if kunlun_runtime.config.comm.name == "single":  # one process: the identities of a world of one
        kunlun_runtime.init_comm(rank=0, world_size=1)
        run_collectives(kunlun_runtime.comm, kunlun_runtime.device.torch_device, 0, 1)
    else:
        check_collectives(kunlun_overrides, world_size=2, modules=kunlun_plugin_modules)


