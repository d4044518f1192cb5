"""Registration through the entry point, the config options it adds, and composing a run with it."""

import pytest
import torch

from kunlun_infer.errors import ConfigError, OpsCoverageError
from kunlun_infer.runtime import PluginManager, Runtime, compose_config

from kunlun_infer_simchip.config import GIB, MIB, parse_capacity

SIMCHIP_RUN = ["device=simchip", "memory=simchip", "ops=simchip", "streams=simchip"]


@pytest.fixture(scope="module")
def manager():
    return PluginManager.load()


def test_entry_point_registers_simchip_for_four_capabilities(manager):
    plugin = manager.plugins["simchip"]
    assert plugin.source == "entry point" and plugin.distribution == "kunlun-infer-simchip"
    for capability in ("device", "memory", "ops", "streams"):
        assert "simchip" in manager.options(capability)
    assert sorted(o.group for o in plugin.config_options) == ["device", "memory", "ops", "platform", "streams"]


def test_config_options_compose_with_the_default_capacity(manager):
    cfg = compose_config(SIMCHIP_RUN, plugin_manager=manager)
    assert cfg.device.name == "simchip" and cfg.device.capacity == "4GiB"
    assert (cfg.memory.name, cfg.ops.name, cfg.streams.name) == ("simchip", "simchip", "simchip")


def test_unknown_key_under_device_simchip_is_refused_naming_it(manager):
    with pytest.raises(ConfigError, match="device.capcity"):
        compose_config(["device=simchip", "+device.capcity=1"], plugin_manager=manager)


@pytest.mark.parametrize("text,expected", [("4GiB", 4 * GIB), ("64MiB", 64 * MIB), ("3M", 2 * MIB),
                                           (str(8 * MIB), 8 * MIB), ("1.5GiB", 1536 * MIB)])
def test_capacity_sizes(text, expected):
    assert parse_capacity(text) == expected


@pytest.mark.parametrize("text", ["lots", "1MiB", "4 parsecs"])
def test_bad_capacity_names_the_key(text):
    with pytest.raises(ConfigError, match="device.capacity"):
        parse_capacity(text)


def test_runtime_composes_every_simchip_capability(manager):
    cfg = compose_config([*SIMCHIP_RUN, "device.capacity=64MiB"], plugin_manager=manager)
    with Runtime.from_config(cfg, plugin_manager=manager) as runtime:
        assert {c: runtime.plugin_for(c) for c in ("device", "memory", "ops", "streams")} == dict.fromkeys(
            ("device", "memory", "ops", "streams"), "simchip")
        assert runtime.device.identity()["name"] == "simchip"
        assert runtime.device.mem_get_info() == (64 * MIB, 64 * MIB)
        assert torch.float16 not in runtime.device.supported_dtypes()
        t = runtime.memory.allocate((256, 256), torch.bfloat16)
        assert t.data_ptr() % 4096 == 0 and runtime.memory.stats().allocated == 2 * MIB
        assert runtime.device.mem_get_info()[0] == 62 * MIB
        out = []
        runtime.streams.compute_stream().submit(out.append, 1)
        runtime.streams.synchronize()
        assert out == [1]
        runtime.memory.free(t)


def test_missing_ops_fall_back_to_the_reference_and_are_counted(manager):
    cfg = compose_config([*SIMCHIP_RUN, "device.capacity=8MiB"], plugin_manager=manager)
    with Runtime.from_config(cfg, plugin_manager=manager) as runtime:
        table = runtime.resolve_ops(["rms_norm", "linear", "rotary_embedding", "paged_attention"])
        assert table.fallbacks == ["paged_attention", "rotary_embedding"]
        assert table.source("rms_norm") == "simchip" and table.source("linear") == "simchip"
        from kunlun_infer.ops import OP_SPECS

        args, _ = OP_SPECS["rotary_embedding"].sample(torch.float32, torch.device("cpu"),
                                                      torch.Generator().manual_seed(0))
        table.rotary_embedding(*args)
        assert table.fallback_calls["rotary_embedding"] == 1


def test_strict_ops_refuse_listing_the_missing_ones(manager):
    cfg = compose_config([*SIMCHIP_RUN, "device.capacity=8MiB", "ops.strict=true"], plugin_manager=manager)
    with Runtime.from_config(cfg, plugin_manager=manager) as runtime:
        with pytest.raises(OpsCoverageError) as info:
            runtime.resolve_ops(["rms_norm", "rotary_embedding", "paged_attention"])
    assert info.value.missing == ["rotary_embedding", "paged_attention"]
    assert "paged_attention" in str(info.value) and "rotary_embedding" in str(info.value)


def test_mixing_simchip_device_with_builtin_memory_and_ops(manager):
    cfg = compose_config(["device=simchip", "memory=caching", "ops=torch", "device.capacity=8MiB"],
                         plugin_manager=manager)
    with Runtime.from_config(cfg, plugin_manager=manager) as runtime:
        assert runtime.plugin_for("device") == "simchip"
        assert runtime.plugin_for("memory") != "simchip" and runtime.plugin_for("ops") != "simchip"
        table = runtime.resolve_ops(["paged_attention", "rotary_embedding"])
        assert table.fallbacks == []
        t = runtime.memory.allocate((16,), torch.float32)
        assert t.device == runtime.device.torch_device
