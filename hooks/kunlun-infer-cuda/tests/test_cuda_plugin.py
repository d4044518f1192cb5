"""Registration and configuration need no GPU; opening the device here fails with a clear line."""

import pytest

from kunlun_infer.errors import ConfigError, PluginError
from kunlun_infer.runtime import PluginManager, Runtime, compose_config

CUDA_RUN = ["device=cuda", "memory=cuda", "ops=cuda", "streams=cuda", "comm=nccl"]


@pytest.fixture(scope="module")
def manager():
    return PluginManager.load()


def test_entry_point_registers_every_capability(manager):
    plugin = manager.plugins["cuda"]
    assert plugin.distribution == "kunlun-infer-cuda"
    assert plugin.options("comm") == ["nccl"]
    for capability in ("device", "memory", "ops", "streams"):
        assert plugin.options(capability) == ["cuda"]


def test_options_compose_and_are_typed(manager):
    cfg = compose_config([*CUDA_RUN, "device.index=1", "device.allow_tf32=true", "comm.accumulate_dtype=float32"],
                         plugin_manager=manager)
    assert cfg.device.index == 1 and cfg.device.allow_tf32 is True and cfg.comm.name == "nccl"
    with pytest.raises(ConfigError, match="device.allow_tf32"):
        compose_config(["device=cuda", "device.allow_tf32=sometimes"], plugin_manager=manager)


def test_factories_build_without_touching_the_gpu(manager):
    cfg = compose_config(CUDA_RUN, plugin_manager=manager)
    _, make_device = manager.factory("device", "cuda")
    device = make_device(config=cfg.device, local_rank=2)
    assert device.index == 2 and not device.is_open
    _, make_ops = manager.factory("ops", "cuda")
    assert make_ops(config=cfg.ops, device=device).supports("paged_attention")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this host has a GPU")
def test_runtime_on_a_host_without_gpu_fails_naming_plugin_and_layer(manager):
    cfg = compose_config(CUDA_RUN, plugin_manager=manager)
    with pytest.raises(PluginError) as info:
        Runtime.from_config(cfg, plugin_manager=manager)
    assert info.value.plugin == "cuda" and info.value.layer == "hardware"
    assert "no NVIDIA device is visible" in str(info.value)


def test_its_stack_names_the_triton_that_serves_its_kernels(manager, monkeypatch):
    import importlib.metadata

    from kunlun_infer_cuda import plugin

    stack = manager.plugins["cuda"].info.stack
    try:
        assert stack["triton"] == importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        assert stack["triton"] == "not installed"

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", absent)
    assert plugin.kunlun_infer_plugin_info().stack["triton"] == "not installed"
