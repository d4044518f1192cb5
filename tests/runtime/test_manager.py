"""PluginManager: registration checks, version ranges, per-plugin attribution, observability hooks."""

from __future__ import annotations

import dataclasses
import re

import pytest

from kunlun_infer import ConfigError, PluginError, PluginVersionError
from kunlun_infer.config import DeviceConfig, SchedulerConfig
from kunlun_infer.hookspecs import CAPABILITIES, HOOK_API_VERSION_STR, ConfigOption, PluginInfo, hookimpl
from kunlun_infer.runtime import PluginManager
from kunlun_infer.runtime.versions import api_range_admits, parse_api_range
from tests.runtime.plugin_sources import COUNTING_MEMORY


@pytest.fixture
def manager():
    return PluginManager.load(entry_points=False)


def test_builtins_describe_themselves(manager):
    rows = {row["name"]: row for row in manager.describe()}
    assert set(rows) == {"cpu", "cpu-memory", "torch-ops", "cpu-comm", "cpu-streams", "xgrammar"}
    provided = {c for row in rows.values() for c in row["capabilities"]}
    assert provided == set(CAPABILITIES)
    for row in rows.values():
        assert row["version"] and row["stack"]["torch"]
        assert row["api"] == (">=1.2,<2" if row["name"] == "xgrammar" else ">=1.0,<2")  # logits processors: 1.2
    assert rows["cpu-memory"]["options"] == {"memory": ["caching", "simple"]}
    assert rows["xgrammar"]["options"] == {"logits_processor": ["xgrammar"]} and rows["xgrammar"]["stack"]["xgrammar"]


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
    expected = rf"plugin 'old'.*supports hook API '<1'.*requires hook API {re.escape(HOOK_API_VERSION_STR)}"
    with pytest.raises(PluginVersionError, match=expected):
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


def test_observability_hooks_reach_each_plugin_and_failures_are_logged_with_the_plugin(manager, caplog):
    seen = []
    manager.register(_plugin(PluginInfo(name="watcher", version="1"),
                             engine_step=lambda self, stats: seen.append(stats["step"])))
    manager.register(_plugin(PluginInfo(name="grumpy", version="1"),
                             engine_stop=lambda self, stats: 1 / 0))
    assert manager.has_observers("kunlun_infer_engine_step")
    manager.engine_step({"step": 7})
    assert seen == [7]
    manager.engine_stop({})  # an observer's failure is reported, never raised
    assert "plugin 'grumpy' failed in kunlun_infer_engine_stop" in caplog.text
    assert "ZeroDivisionError" in caplog.text


def _raise(exc):
    raise exc


def test_a_failing_observer_neither_escapes_nor_silences_the_others(manager, caplog):
    heard = []
    # registered first, so pluggy calls it last; each one raises something other than PluginError
    manager.register(_plugin(PluginInfo(name="listener", version="1"),
                             engine_step=lambda self, stats: heard.append(stats["step"])))
    manager.register(_plugin(PluginInfo(name="strict", version="1"),
                             engine_step=lambda self, stats: _raise(ConfigError("bad observer setting"))))
    manager.register(_plugin(PluginInfo(name="clumsy", version="1"),
                             engine_step=lambda self, stats: _raise(KeyError("missing"))))
    manager.engine_step({"step": 3})
    assert heard == [3]
    assert "plugin 'strict' failed in kunlun_infer_engine_step" in caplog.text
    assert "plugin 'clumsy' failed in kunlun_infer_engine_step" in caplog.text


def test_observers_run_in_pluggy_order_and_wrappers_surround_them(manager):
    heard = []

    def around(self, stats):
        heard.append("before")
        result = yield
        heard.append("after")
        return result

    late = hookimpl(trylast=True)(lambda self, stats: heard.append("last"))
    early = hookimpl(tryfirst=True)(lambda self, stats: heard.append("first"))
    for name, fn in (("early", early), ("plain", lambda self, stats: heard.append("plain")), ("late", late)):
        impl = fn if hasattr(fn, "kunlun_infer_impl") else hookimpl(fn)
        manager.register(type("Plugin", (), {"kunlun_infer_plugin_info": hookimpl(
            lambda self, name=name: PluginInfo(name=name, version="1")), "kunlun_infer_engine_step": impl})())
    manager.register(type("Plugin", (), {
        "kunlun_infer_plugin_info": hookimpl(lambda self: PluginInfo(name="around", version="1")),
        "kunlun_infer_engine_step": hookimpl(wrapper=True)(around)})())
    manager.engine_step({"step": 1})
    assert heard == ["before", "first", "plain", "last", "after"]


def test_a_failing_wrapper_is_skipped_and_the_observers_still_hear(manager, caplog):
    heard = []

    def broken(self, stats):
        raise ConfigError("wrapper setup failed")
        yield  # unreachable: makes this a generator, as a wrapper is

    def broken_after(self, stats):
        yield
        heard.append("teardown")
        raise RuntimeError("wrapper teardown failed")

    manager.register(_plugin(PluginInfo(name="listener", version="1"),
                             engine_step=lambda self, stats: heard.append(stats["step"])))
    for name, fn in (("broken", broken), ("broken-after", broken_after)):
        manager.register(type("Plugin", (), {
            "kunlun_infer_plugin_info": hookimpl(lambda self, name=name: PluginInfo(name=name, version="1")),
            "kunlun_infer_engine_step": hookimpl(wrapper=True)(fn)})())
    manager.engine_step({"step": 5})
    assert heard == [5, "teardown"]
    assert "plugin 'broken' failed in kunlun_infer_engine_step" in caplog.text
    assert "plugin 'broken-after' failed in kunlun_infer_engine_step" in caplog.text


def test_every_manager_reflects_the_current_environment(make_distribution, monkeypatch):
    make_distribution("kunlun-counting", COUNTING_MEMORY, entry_point="counting")
    monkeypatch.setenv("KUNLUN_INFER_DISABLE_PLUGINS", "counting")
    assert "counting" not in PluginManager.load().plugins
    monkeypatch.delenv("KUNLUN_INFER_DISABLE_PLUGINS")
    assert "counting" in PluginManager.load().plugins
