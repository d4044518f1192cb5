"""compose_config: the conf tree, overrides, presets, validation and one-line errors, no side effects."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import textwrap

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig
from omegaconf.errors import ValidationError

from kunlun_infer import ConfigError, compose_config
from kunlun_infer.runtime import PluginManager


@pytest.fixture(scope="module")
def builtins_only():
    return PluginManager.load(entry_points=False)


def test_defaults_follow_the_design(builtins_only):
    cfg = compose_config(plugin_manager=builtins_only)
    assert isinstance(cfg, DictConfig)
    assert [cfg[c].name for c in ("device", "memory", "ops", "comm", "streams")] == [
        "cpu", "caching", "cpu", "single", "sync"]
    assert cfg.model.path is None and cfg.model.dtype == "auto"
    assert cfg.server.host == "127.0.0.1" and cfg.server.port == 8000
    assert cfg.comm.accumulate_dtype == "float32" and cfg.ops.strict is False
    assert "hydra" not in cfg


def test_overrides_and_presets(builtins_only):
    cfg = compose_config(["memory=simple", "comm=gloo", "scheduler.max_num_seqs=8", "cache.block_size=32"],
                         plugin_manager=builtins_only)
    assert (cfg.memory.name, cfg.comm.name, cfg.scheduler.max_num_seqs, cfg.cache.block_size) == (
        "simple", "gloo", 8, 32)
    latency = compose_config(["scheduler=latency"], plugin_manager=builtins_only).scheduler
    throughput = compose_config(["scheduler=throughput"], plugin_manager=builtins_only).scheduler
    assert latency.max_num_seqs < throughput.max_num_seqs
    assert latency.max_num_batched_tokens < throughput.max_num_batched_tokens


@pytest.mark.parametrize("override, pieces", [
    ("device=nosuchchip", ["device=nosuchchip", "no such option in group 'device'", "available: cpu"]),
    ("scheduler=fastest", ["group 'scheduler'", "default, latency, throughput"]),
    ("scheduler.max_num_seqs=abc", ["scheduler.max_num_seqs=abc", "expected int"]),
    ("cache.prefix_caching=maybe", ["cache.prefix_caching=maybe", "expected bool"]),
    ("model.max_model_len=1.5", ["model.max_model_len=1.5", "expected int or null"]),
    ("parallel.tensor_size=null", ["parallel.tensor_size", "expected int"]),
    ("scheduler.max_seqs=4", ["scheduler.max_seqs", "unknown key 'max_seqs'", "max_num_seqs"]),
    ("+device.colour=red", ["device.colour", "unknown key"]),
    ("nosuchgroup=1", ["nosuchgroup", "unknown key", "scheduler"]),
    ("+device._target_=x.Y", ["_target_"]),
    ("device", ["cannot parse override 'device'"]),
])
def test_bad_input_is_one_clear_line(builtins_only, override, pieces):
    with pytest.raises(ConfigError) as info:
        compose_config([override], plugin_manager=builtins_only)
    message = str(info.value)
    assert "\n" not in message
    for piece in pieces:
        assert piece in message, message


def test_unknown_option_lists_only_public_names(builtins_only):
    with pytest.raises(ConfigError) as info:
        compose_config(["device=nosuchchip"], plugin_manager=builtins_only)
    assert "_kunlun" not in str(info.value)


def test_removing_a_required_choice_names_the_key(builtins_only):
    with pytest.raises(ConfigError, match=r"device\.name is not set"):
        compose_config(["~device"], plugin_manager=builtins_only)


def test_composed_config_refuses_typos_and_bad_types_later(builtins_only):
    cfg = compose_config(plugin_manager=builtins_only)
    with pytest.raises(Exception, match="max_num_seq"):
        _ = cfg.scheduler.max_num_seq
    with pytest.raises(Exception, match="max_num_seqs"):
        cfg.scheduler.max_num_seqs = "many"
    cfg.scheduler.max_num_seqs = 3
    assert cfg.scheduler.max_num_seqs == 3


def test_no_outputs_folder_no_chdir_no_logging_takeover(builtins_only, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    compose_config(["scheduler=latency"], plugin_manager=builtins_only)
    with pytest.raises(ConfigError):
        compose_config(["device=nosuchchip"], plugin_manager=builtins_only)
    assert os.getcwd() == str(tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert root.handlers == handlers and root.level == level
    assert logging.getLogger("kunlun_infer").handlers == []


def test_config_store_is_left_as_found(builtins_only):
    before = {k: (dict(v) if isinstance(v, dict) else v) for k, v in ConfigStore.instance().repo.items()}
    compose_config(plugin_manager=builtins_only)
    after = {k: (dict(v) if isinstance(v, dict) else v) for k, v in ConfigStore.instance().repo.items()}
    assert after == before


def test_the_same_overrides_again_give_an_equal_config_of_its_own(builtins_only):
    overrides = ["scheduler.max_num_seqs=6", "cache.block_size=32"]
    first = compose_config(overrides, plugin_manager=builtins_only)
    first.scheduler.max_num_seqs = 2  # one engine's config, changed after composing
    first.cache.block_size = 64
    again = compose_config(overrides, plugin_manager=builtins_only)
    assert (again.scheduler.max_num_seqs, again.cache.block_size) == (6, 32)
    assert again == compose_config(overrides, plugin_manager=builtins_only)
    with pytest.raises(ValidationError):  # still typed by the schema
        again.scheduler.max_num_seqs = "many"


def test_a_plugin_option_registered_later_composes_with_the_same_overrides(builtins_only):
    from kunlun_infer.config import DeviceConfig
    from kunlun_infer.hookspecs import ConfigOption
    from tests.runtime.plugin_sources import options_plugin

    @dataclasses.dataclass
    class BoardConfig(DeviceConfig):
        lanes: int = 4

    with pytest.raises(ConfigError, match="device=board: no such option"):
        compose_config(["device=board"], plugin_manager=builtins_only)
    for lanes in (8, 16):  # the same overrides with the plugin's option, then with another value of it
        manager = PluginManager.load(entry_points=False)
        manager.register(options_plugin(ConfigOption(group="device", name="board",
                                                     node=BoardConfig(name="board", lanes=lanes))))
        assert compose_config(["device=board"], plugin_manager=manager).device.lanes == lanes
    with pytest.raises(ConfigError, match="device=board: no such option"):
        compose_config(["device=board"], plugin_manager=builtins_only)


def test_compose_inside_an_application_using_hydra_main(tmp_path):
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent('''
        import os
        import hydra
        from hydra.core.config_store import ConfigStore
        from omegaconf import DictConfig

        import kunlun_infer

        ConfigStore.instance().store(name="app", node={"greeting": "hi", "batch": 1})


        @hydra.main(version_base=None, config_name="app")
        def main(cfg: DictConfig) -> None:
            ours = kunlun_infer.compose_config(["scheduler=latency", "device=cpu"])
            print("app", cfg.greeting, cfg.batch)
            print("ours", ours.scheduler.max_num_seqs, ours.device.name, "hydra" in ours)
            try:
                kunlun_infer.compose_config(["device=nosuchchip"])
            except kunlun_infer.ConfigError as exc:
                print("error", exc)
            print("cwd", os.getcwd())


        main()
    '''))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(app), "greeting=hello", f"hydra.run.dir={run_dir}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "app hello 1" in lines
    assert "ours 4 cpu False" in lines
    assert any(line.startswith("error device=nosuchchip: no such option") for line in lines)
    assert f"cwd {tmp_path}" in lines
