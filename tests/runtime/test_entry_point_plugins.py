"""Outside plugins found through entry points of installed distributions."""

from __future__ import annotations

import sys

import pytest
import torch

from kunlun_infer.hookspecs import HOOK_API_VERSION_STR
from kunlun_infer import ConfigError, DeviceOutOfMemoryError, PluginError, PluginVersionError, compose_config
from kunlun_infer.hookspecs import HOOK_API_VERSION_STR
from kunlun_infer.runtime import PluginManager, Runtime
from tests.runtime.plugin_sources import BROKEN_IMPORT, COUNTING_MEMORY, DUPLICATE_CACHING, FAILING_HOOK, FUTURE_API


def test_outside_plugin_adds_a_memory_option_and_a_run_allocates_through_it(make_distribution, only_plugins):
    module = make_distribution("kunlun-counting", COUNTING_MEMORY, entry_point="counting")
    only_plugins("counting")
    manager = PluginManager.load()
    assert "counting" in manager.options("memory")

    cfg = compose_config(["memory=counting", "memory.limit_bytes=8192"], plugin_manager=manager)
    assert cfg.memory.limit_bytes == 8192
    with Runtime.from_config(cfg, plugin_manager=manager) as rt:
        assert rt.plugin_for("memory") == "counting"
        t = rt.memory.allocate((4, 8), torch.float32)
        t.fill_(1.0)
        rt.memory.free(t)
        with pytest.raises(DeviceOutOfMemoryError) as oom:  # the plugin's own error passes through unchanged
            rt.memory.allocate((1 << 20,), torch.float32)
        assert oom.value.capacity == 8192
    calls = sys.modules[module].CALLS
    assert calls == [("allocate", (4, 8), torch.float32), ("free", (4, 8), torch.float32)]


def test_outside_plugin_option_is_type_checked(make_distribution, only_plugins):
    make_distribution("kunlun-counting", COUNTING_MEMORY, entry_point="counting")
    only_plugins("counting")
    with pytest.raises(ConfigError, match=r"memory\.limit_bytes=lots.*expected int"):
        compose_config(["memory=counting", "memory.limit_bytes=lots"])
    with pytest.raises(ConfigError, match=r"memory\.colour.*unknown key"):
        compose_config(["memory=counting", "memory.colour=red"])


def test_plugin_with_incompatible_api_is_refused_naming_versions(make_distribution, only_plugins):
    make_distribution("kunlun-future", FUTURE_API, version="7.0.0", entry_point="future")
    only_plugins("future")
    manager = PluginManager.load()
    assert "future" not in manager.plugins
    (error,) = manager.load_errors
    assert isinstance(error.error, PluginVersionError)
    message = error.message
    for part in ("'future'", "kunlun-future 7.0.0", ">=2.0,<3", f"requires hook API {HOOK_API_VERSION_STR}"):
        assert part in message, message


def test_incompatible_plugin_is_fatal_under_strict_loading(make_distribution, only_plugins, monkeypatch):
    make_distribution("kunlun-future", FUTURE_API, version="7.0.0", entry_point="future")
    only_plugins("future")
    monkeypatch.setenv("KUNLUN_INFER_STRICT_PLUGINS", "1")
    with pytest.raises(PluginVersionError, match="kunlun-future 7.0.0"):
        PluginManager.load()


def test_broken_plugin_is_recorded_and_fatal_only_when_chosen(make_distribution, only_plugins):
    make_distribution("kunlun-brokenchip", BROKEN_IMPORT, entry_point="brokenchip")
    only_plugins("brokenchip")
    manager = PluginManager.load()
    (error,) = manager.load_errors
    assert error.name == "brokenchip" and "libchip.so" in error.message
    # a run that does not choose it works
    with Runtime.from_config(compose_config([], plugin_manager=manager), plugin_manager=manager) as rt:
        assert rt.plugin_for("device") == "cpu"
    # choosing it names the broken plugin and its error
    with pytest.raises(ConfigError, match="brokenchip.*libchip.so"):
        compose_config(["device=brokenchip"], plugin_manager=manager)
    cfg = compose_config([], plugin_manager=manager)
    cfg.device.name = "brokenchip"
    with pytest.raises(PluginError, match="brokenchip.*failed to load.*libchip.so") as info:
        Runtime.from_config(cfg, plugin_manager=manager)
    assert isinstance(info.value.__cause__, PluginError)


def test_duplicate_option_names_are_a_load_error_naming_both_plugins(make_distribution, only_plugins):
    make_distribution("kunlun-copycat", DUPLICATE_CACHING, entry_point="copycat")
    only_plugins("copycat")
    manager = PluginManager.load()
    (error,) = manager.load_errors
    assert "'copycat'" in error.message and "'cpu-memory'" in error.message and "'caching'" in error.message
    assert manager.factory("memory", "caching")[0] == "cpu-memory"


def test_exception_in_a_plugin_hook_names_plugin_hook_and_layer(make_distribution, only_plugins, monkeypatch):
    make_distribution("kunlun-faulty", FAILING_HOOK, entry_point="faulty")
    only_plugins("faulty")
    (error,) = PluginManager.load().load_errors
    assert error.error.plugin == "faulty"
    assert error.error.hook == "kunlun_infer_ops_factories"
    assert error.error.layer == "plugin"
    assert isinstance(error.error.__cause__, RuntimeError)
    assert "driver table not initialised" in error.message


def test_allow_and_block_lists_filter_entry_points(make_distribution, monkeypatch):
    make_distribution("kunlun-counting", COUNTING_MEMORY, entry_point="counting")
    make_distribution("kunlun-brokenchip", BROKEN_IMPORT, entry_point="brokenchip")

    monkeypatch.setenv("KUNLUN_INFER_PLUGINS", "counting")
    manager = PluginManager.load()
    assert "counting" in manager.plugins and not manager.load_errors
    assert ("brokenchip", "not listed in KUNLUN_INFER_PLUGINS") in manager.skipped

    monkeypatch.setenv("KUNLUN_INFER_PLUGINS", "counting,brokenchip")
    monkeypatch.setenv("KUNLUN_INFER_DISABLE_PLUGINS", "counting")
    manager = PluginManager.load()
    assert "counting" not in manager.plugins
    assert ("counting", "listed in KUNLUN_INFER_DISABLE_PLUGINS") in manager.skipped
    assert [e.name for e in manager.load_errors] == ["brokenchip"]

    # a blocked plugin's options are gone from composition too
    with pytest.raises(ConfigError, match="memory=counting: no such option"):
        compose_config(["memory=counting"])
    # built-ins are always there
    assert "cpu" in manager.options("device")
