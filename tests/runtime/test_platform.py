"""``platform=<name>``: one word composes all five capabilities; a capability named after it still wins."""

from __future__ import annotations

import io

import pytest
import yaml

from kunlun_infer import ConfigError, PluginError, compose_config
from kunlun_infer.cli import main
from kunlun_infer.config import PlatformConfig
from kunlun_infer.hookspecs import CAPABILITIES, ConfigOption
from kunlun_infer.runtime import PluginManager
from kunlun_infer.runtime.options import packaged_options
from tests.runtime.plugin_sources import options_plugin


def choices(cfg) -> dict[str, str]:
    return {c: cfg[c].name for c in (*CAPABILITIES, "platform")}


def test_the_default_platform_is_the_cpu_with_the_built_in_plugins():
    cfg = compose_config(plugin_manager=PluginManager.load(entry_points=False))
    assert choices(cfg) == {"device": "cpu", "memory": "caching", "ops": "cpu", "comm": "single",
                            "streams": "sync", "platform": "cpu"}
    assert packaged_options("platform") == ["cpu"]


def test_config_command_shows_the_five_choices_of_the_simulated_chip():
    out = io.StringIO()
    assert main(["config", "platform=simchip"], stdout=out, stderr=io.StringIO()) == 0
    shown = yaml.safe_load(out.getvalue())
    assert {c: shown[c]["name"] for c in CAPABILITIES} == {
        "device": "simchip", "memory": "simchip", "ops": "simchip", "comm": "single", "streams": "simchip"}
    assert shown["platform"] == {"name": "simchip"}


@pytest.mark.parametrize("order", [["platform=kunlun", "ops=torch"], ["ops=torch", "platform=kunlun"]])
def test_a_capability_named_on_the_command_line_wins_over_the_platform(order):
    assert choices(compose_config(order)) == {"device": "kunlun", "memory": "kunlun", "ops": "torch",
                                              "comm": "bkcl", "streams": "kunlun", "platform": "kunlun"}
    assert choices(compose_config(["platform=cuda"]))["comm"] == "nccl"


def test_an_unknown_platform_lists_the_ones_there_are():
    with pytest.raises(ConfigError, match=r"platform=tpu: no such option.*cpu, cuda, kunlun, simchip"):
        compose_config(["platform=tpu"])


def test_a_plugin_adds_its_own_platform_through_the_config_options_hook(tmp_path):
    from kunlun_infer import LLM
    from tests.engine.tiny_models import build_tiny_model, engine_overrides

    board = PlatformConfig(name="board", device="cpu", memory="simple", ops="torch", comm="single", streams="sync")
    manager = PluginManager.load(entry_points=False)
    manager.register(options_plugin(ConfigOption(group="platform", name="board", node=board)))
    cfg = compose_config(["platform=board", *engine_overrides(), f"model.path={build_tiny_model(tmp_path, 'llama')}"],
                         plugin_manager=manager)
    assert choices(cfg) == {"device": "cpu", "memory": "simple", "ops": "torch", "comm": "single",
                            "streams": "sync", "platform": "board"}
    with LLM.from_config(cfg) as llm:  # and it runs: the simple allocator and the reference ops serve the model
        assert len(llm.generate([[1, 2, 3]], use_tqdm=False)[0].token_ids) > 0


@pytest.mark.parametrize("node, why", [
    (PlatformConfig(name="half", device="cpu", memory="simple"), "missing: ops, comm, streams"),
    (PlatformConfig(name="other", device="cpu", memory="simple", ops="torch", comm="single", streams="sync"),
     "must equal the option name"),
])
def test_a_malformed_platform_option_is_the_plugins_load_error(node, why):
    manager = PluginManager.load(entry_points=False)
    with pytest.raises(PluginError, match=why):
        manager.register(options_plugin(ConfigOption(group="platform", name="half", node=node)))
