"""PluginManager: registration checks, version ranges, per-plugin attribution, observability hooks."""

from __future__ import annotations

import dataclasses

import pytest

from kunlun_infer import PluginError, PluginVersionError
from kunlun_infer.config import DeviceConfig, SchedulerConfig
from kunlun_infer.hookspecs import CAPABILITIES, ConfigOption, PluginInfo, hookimpl
from kunlun_infer.runtime import PluginManager
from kunlun_infer.runtime.versions import api_range_admits, parse_api_range
from tests.runtime.plugin_sources import COUNTING_MEMORY


@pytest.fixture
def manager():
    return PluginManager.load(entry_points=False)


def test_builtins_describe_themselves(manager):
    rows = {row["name"]: row for row in manager.describe()}
    assert set(rows) == {"cpu", "cpu-memory", "torch-ops", "cpu-comm", "cpu-streams"}
    provided = {c for row in rows.values() for c in row["capabilities"]}
    assert provided == set(CAPABILITIES)
    for row in rows.values():
        assert row["version"] and row["api"] == ">=1.0,<2" and row["stack"]["torch"]
    assert rows["cpu-memory"]["options"] == {"memory": ["caching", "simple"]}


@pytest.mark.parametrize("spec, admitted", [
    (">=1.0,<2", True), (">=1", True), ("==1.0", True), (">=1.1", False), ("<1", False), (">=2.0,<3", False),
    ("!=1.0", False), (">0.9, <=1.0", True),
])
def test_api_ranges(spec, admitted):
    assert api_range_admits(spec, (1, 0)) is admitted


def test_malformed_range_is_refused():
    with pytest.raises(ValueError, match="malformed"):
        parse_api_range("one point oh")


def _plugin(info=None, **hooks):
    """An object implementing ``kunlun_infer_plugin_info`` (and ``hooks``) as hookimpls."""
    namespace = {}
    if info is not None:
        namespace["kunlun_infer_plugin_info"] = hookimpl(lambda self: info)
    for name, fn in hooks.items():
        namespace[f"kunlun_infer_{name}"] = hookimpl(fn)
    return type("Plugin", (), namespace)()


def test_plugin_without_info_is_refused(manager):
    with pytest.raises(PluginError, match="does not implement kunlun_infer_plugin_info"):
        manager.register(_plugin(None, device_factories=lambda self: {}))


def test_version_mismatch_via_register(manager):
    with pytest.raises(PluginVersionError, match=r"plugin 'old'.*supports hook API '<1'.*requires hook API 1\.0"):
        manager.register(_plugin(PluginInfo(name="old", version="0.1", api="<1")))
    assert "old" not in manager.plugins


def test_hookimpl_with_unknown_argument_is_refused(manager):
    with pytest.raises(PluginError, match="does not fit the hook specifications"):
        manager.register(_plugin(PluginInfo(name="odd", version="1"),
                                 engine_step=lambda self, stats, bogus: None))


def test_refused_plugin_leaves_nothing_registered(manager):
    bad = _plugin(PluginInfo(name="half", version="1"), device_factories=lambda self: {"half": lambda **_: None},
                  memory_factories=lambda self: {"caching": lambda **_: None})
    with pytest.raises(PluginError, match="'cpu-memory' already registers"):
        manager.register(bad)
    assert "half" not in manager.options("device")
    assert "half" not in manager.plugins


@dataclasses.dataclass
class ChipConfig(DeviceConfig):
    name: str = "chip"
    capacity: int = 1024


@dataclasses.dataclass
class TargetConfig(DeviceConfig):
    name: str = "sneaky"
    _target_: str = "os.system"


@pytest.mark.parametrize("option, why", [
    (ConfigOption("device", "chip", SchedulerConfig), "subclassing kunlun_infer.config.DeviceConfig"),
    (ConfigOption("gpu", "chip", ChipConfig), "unknown group 'gpu'"),
    (ConfigOption("device", "cpu", ChipConfig), "already exists"),
    (ConfigOption("device", "other", ChipConfig), "must equal the option name"),
    (ConfigOption("device", "sneaky", TargetConfig), "_target_"),
    ("device=chip", "is not a kunlun_infer.hookspecs.ConfigOption"),
])
def test_malformed_config_options_are_load_errors(manager, option, why):
    plugin = _plugin(PluginInfo(name="chip", version="1"), config_options=lambda self: [option])
    with pytest.raises(PluginError, match="plugin 'chip' contributes a bad config option") as info:
        manager.register(plugin)
    assert why in str(info.value)


def test_observability_hooks_reach_each_plugin_and_failures_are_attributed(manager):
    seen = []
    manager.register(_plugin(PluginInfo(name="watcher", version="1"),
                             engine_step=lambda self, stats: seen.append(stats["step"])))
    manager.register(_plugin(PluginInfo(name="grumpy", version="1"),
                             engine_stop=lambda self, stats: 1 / 0))
    assert manager.has_observers("kunlun_infer_engine_step")
    manager.engine_step({"step": 7})
    assert seen == [7]
    with pytest.raises(PluginError) as info:
        manager.engine_stop({})
    assert (info.value.plugin, info.value.hook) == ("grumpy", "kunlun_infer_engine_stop")
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_every_manager_reflects_the_current_environment(make_distribution, monkeypatch):
    make_distribution("kunlun-counting", COUNTING_MEMORY, entry_point="counting")
    monkeypatch.setenv("KUNLUN_INFER_DISABLE_PLUGINS", "counting")
    assert "counting" not in PluginManager.load().plugins
    monkeypatch.delenv("KUNLUN_INFER_DISABLE_PLUGINS")
    assert "counting" in PluginManager.load().plugins
