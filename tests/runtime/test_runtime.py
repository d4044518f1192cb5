"""Runtime.from_config: composition by registered name, guarded capabilities, lifecycle."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from omegaconf import OmegaConf

from kunlun_infer import ConfigError, DeviceOutOfMemoryError, PluginError, compose_config
from kunlun_infer.capabilities import Comm, Device, MemoryAllocator, OpsProvider, Streams
from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.plugins.cpu_memory import CachingAllocator
from kunlun_infer.runtime import PluginManager, Runtime, unwrap


class FlakyAllocator(CachingAllocator):
    """Fails on demand, the way a driver would."""

    name = "flaky"

    def allocate(self, shape, dtype):
        if tuple(shape) == (13,):
            raise RuntimeError("driver error 700: illegal address")
        if tuple(shape) == (14,):
            raise DeviceOutOfMemoryError("no room", requested=14, free=0)
        return super().allocate(shape, dtype)


class FlakyPlugin:
    @hookimpl
    def kunlun_infer_plugin_info(self):
        return PluginInfo(name="flaky", version="0.0.1", capabilities=("memory",))

    @hookimpl
    def kunlun_infer_memory_factories(self):
        return {"flaky": lambda *, config, device: FlakyAllocator(device=device),
                "exploding": self._explode}

    @staticmethod
    def _explode(*, config, device):
        raise OSError("cannot map device memory")


@pytest.fixture
def manager():
    manager = PluginManager.load(entry_points=False)
    manager.register(FlakyPlugin())
    return manager


def build(manager, *overrides):
    return Runtime.from_config(compose_config(list(overrides), plugin_manager=manager), plugin_manager=manager)


def test_composes_one_device_from_registered_names(manager):
    with build(manager) as rt:
        assert rt.device.is_open
        assert {c: rt.plugin_for(c) for c in ("device", "memory", "ops", "comm", "streams")} == {
            "device": "cpu", "memory": "cpu-memory", "ops": "torch-ops", "comm": "cpu-comm", "streams": "cpu-streams"}
        for obj, interface in ((rt.device, Device), (rt.memory, MemoryAllocator), (rt.ops, OpsProvider),
                               (rt.comm, Comm), (rt.streams, Streams)):
            assert isinstance(obj, interface)
        assert unwrap(rt.memory).name == "caching"
        t = rt.memory.allocate((2, 3), torch.bfloat16)
        assert t.device == rt.device.torch_device and t.dtype == torch.bfloat16


def test_memory_option_changes_the_allocator(manager):
    with build(manager, "memory=simple") as rt:
        t = rt.memory.allocate((100,), torch.float32)
        rt.memory.free(t)
        assert rt.memory.stats().reserved == 0  # the simple allocator keeps nothing


def test_plugin_exception_is_wrapped_naming_plugin_method_and_layer(manager):
    with build(manager, "memory=flaky") as rt:
        with pytest.raises(PluginError) as info:
            rt.memory.allocate((13,), torch.float32)
        error = info.value
        assert (error.plugin, error.hook, error.layer) == ("flaky", "memory.allocate", "plugin")
        assert isinstance(error.__cause__, RuntimeError)
        assert "flaky" in str(error) and "memory.allocate" in str(error) and "illegal address" in str(error)
        with pytest.raises(DeviceOutOfMemoryError):  # contract errors pass unchanged
            rt.memory.allocate((14,), torch.float32)


def test_factory_failure_names_plugin_and_closes_the_device(manager, monkeypatch):
    closed = []
    from kunlun_infer.plugins.cpu_device import CpuDevice

    original_close = CpuDevice.close
    monkeypatch.setattr(CpuDevice, "close", lambda self: (closed.append(True), original_close(self)))
    with pytest.raises(PluginError, match="plugin 'flaky'.*exploding.*cannot map device memory") as info:
        build(manager, "memory=exploding")
    assert isinstance(info.value.__cause__, OSError)
    assert closed == [True]


def test_unknown_option_at_build_time_lists_available(manager):
    cfg = compose_config([], plugin_manager=manager)
    cfg.memory.name = "nosuchpool"
    with pytest.raises(PluginError, match="no plugin provides memory 'nosuchpool'; available: caching, exploding"):
        Runtime.from_config(cfg, plugin_manager=manager)


def test_missing_choice_is_a_config_error(manager):
    # an application that built its config by hand and forgot the streams group
    cfg = OmegaConf.create(OmegaConf.to_container(compose_config([], plugin_manager=manager)))
    del cfg["streams"]
    with pytest.raises(ConfigError, match="streams.name is not set"):
        Runtime.from_config(cfg, plugin_manager=manager)


def test_close_is_idempotent_and_releases_everything(manager):
    rt = build(manager, "comm=gloo")
    device, memory = unwrap(rt.device), unwrap(rt.memory)
    t = rt.memory.allocate((64,), torch.float32)
    rt.memory.free(t)
    assert memory.stats().reserved > 0
    rt.close()
    rt.close()
    assert rt.closed and not device.is_open
    assert memory.stats().reserved == 0
    with pytest.raises(PluginError, match="stream used after close"):
        rt.streams.compute_stream().submit(print)


def test_close_destroys_an_initialised_comm(manager, monkeypatch):
    from kunlun_infer.plugins.cpu_comm import SingleComm

    destroyed = []
    monkeypatch.setattr(SingleComm, "destroy", lambda self: destroyed.append(True))
    with build(manager) as rt:
        pass
    assert destroyed == []  # never joined: nothing to leave
    with build(manager) as rt:
        rt.init_comm(rank=0, world_size=1)
        assert rt.comm.joined
    assert destroyed == [True]


def test_device_lifecycle_is_shared_between_runtimes(manager):
    with build(manager) as a:
        device = unwrap(a.device)
        device.open()  # someone else holds it too
    assert device.is_open
    device.close()
    assert not device.is_open


def test_hook_and_method_calls_are_traced_at_debug(manager, caplog):
    caplog.set_level(logging.DEBUG, logger="kunlun_infer")
    with build(manager) as rt:
        rt.memory.allocate((4,), torch.float32)
    records = [(r.name, r.getMessage()) for r in caplog.records]
    assert ("kunlun_infer.plugin.cpu-memory", "-> memory factory 'caching'") in records
    assert any(name == "kunlun_infer.plugin.cpu-memory" and msg.startswith("<- memory.allocate (")
               and msg.endswith(" ms)") for name, msg in records)
    assert any(name == "kunlun_infer.runtime" and "runtime ready" in msg for name, msg in records)


def test_plugin_hooks_are_traced_at_load(caplog):
    caplog.set_level(logging.DEBUG, logger="kunlun_infer")
    PluginManager.load(entry_points=False)
    messages = [(r.name, r.getMessage()) for r in caplog.records]
    assert ("kunlun_infer.plugin.torch-ops", "-> kunlun_infer_ops_factories") in messages
    assert any(n == "kunlun_infer.plugin.torch-ops" and m.startswith("<- kunlun_infer_ops_factories (")
               for n, m in messages)


def _init_default(cls):
    return inspect.signature(cls.init).parameters["timeout_s"].default


def test_comm_timeout_has_one_default_wherever_a_comm_is_joined(manager, monkeypatch):
    from kunlun_infer.plugins.cpu_comm import GlooComm, SingleComm
    from kunlun_infer.plugins.process_group import ProcessGroupComm
    from kunlun_infer_cuda.comm import DistComm
    from kunlun_infer_kunlun.comm import BkclComm

    composed = compose_config([], plugin_manager=manager).comm.timeout_s
    assert compose_config(["comm=gloo"], plugin_manager=manager).comm.timeout_s == composed
    assert {_init_default(c) for c in (Comm, SingleComm, ProcessGroupComm, GlooComm, DistComm, BkclComm)} == {composed}
    joined = []
    monkeypatch.setattr(SingleComm, "init", lambda self, **kw: joined.append(kw["timeout_s"]))
    cfg = compose_config([], plugin_manager=manager)
    del cfg.comm.timeout_s  # a config built by hand without the key
    with Runtime.from_config(cfg, plugin_manager=manager) as rt:
        rt.init_comm(rank=0, world_size=1)
    assert joined == [composed]
