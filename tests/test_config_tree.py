"""The config tree ``conf/``: the package's is the checkout's; defaults live in the schema; the examples compose.

``conf/`` sits at the top level of the repository and becomes the package
``kunlun_infer.conf`` when installed (``package-dir`` in ``pyproject.toml``).
``scripts/check_installed_config.py`` checks the same for a non-editable
``pip install .`` into a fresh venv (too slow for the suite).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kunlun_infer import ConfigError, LLM, SamplingParams, compose_config
from kunlun_infer.config import GROUP_SCHEMAS, check_ranges
from tests.engine.tiny_models import build_tiny_model, engine_overrides

try:
    import tomllib
except ImportError:  # Python 3.10: pytest's own TOML reader
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]


def _files(root) -> dict[str, bytes]:
    """``relative path -> bytes`` of every YAML and Python file below ``root`` (a path or a resource)."""
    found: dict[str, bytes] = {}

    def walk(node, prefix: str) -> None:
        for entry in node.iterdir():
            if entry.is_dir():
                if entry.name != "__pycache__":
                    walk(entry, f"{prefix}{entry.name}/")
            elif entry.name.endswith((".yaml", ".py")):
                found[prefix + entry.name] = entry.read_bytes()

    walk(root, "")
    return found


def test_the_package_composes_exactly_the_checkouts_conf_tree():
    packaged = _files(importlib.resources.files("kunlun_infer.conf"))
    checkout = _files(REPO / "conf")
    assert "config.yaml" in checkout and "deploy/kunlun_tp.yaml" in checkout
    assert packaged == checkout


def test_pyproject_ships_every_package_of_the_source_tree():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    source = REPO / "src"
    found = {".".join(p.parent.relative_to(source).parts) for p in source.glob("kunlun_infer/**/__init__.py")}
    assert set(setuptools["packages"]) == found | {"kunlun_infer.conf"}
    assert setuptools["package-dir"]["kunlun_infer.conf"] == "conf"
    assert "**/*.yaml" in setuptools["package-data"]["kunlun_infer.conf"]


@pytest.mark.parametrize("deploy, chosen, keys", [
    ("cpu", {"device": "cpu", "ops": "cpu", "comm": "single"}, {"cache.memory_fraction": 0.5}),
    ("simchip", {"device": "simchip", "memory": "simchip", "streams": "simchip"}, {"device.capacity": "4GiB"}),
    ("cuda_tp", {"device": "cuda", "comm": "nccl", "streams": "cuda"}, {"parallel.tensor_size": 2}),
    ("kunlun_tp", {"device": "kunlun", "comm": "bkcl", "memory": "kunlun"}, {"parallel.tensor_size": 8}),
])
def test_a_deployment_example_sets_its_options_and_the_command_line_still_wins(deploy, chosen, keys):
    cfg = compose_config([f"deploy={deploy}"])
    assert {group: cfg[group].name for group in chosen} == chosen
    for key, value in keys.items():
        group, name = key.split(".")
        assert cfg[group][name] == value
    assert compose_config([f"deploy={deploy}", "model.dtype=float32"]).model.dtype == "float32"


def test_the_kunlun_example_exports_the_bkcl_tuning_keys():
    from kunlun_infer_kunlun.tuning import tuning_env

    env = tuning_env(compose_config(["deploy=kunlun_tp"]).comm)
    assert {"BKCL_TIMEOUT", "BKCL_TREE_THRESHOLD", "BKCL_FORCE_L3_RDMA"} <= set(env)
    env = tuning_env(compose_config(["deploy=kunlun_tp", "comm.socket_ifname=eth0"]).comm)
    assert env["BKCL_SOCKET_IFNAME"] == "eth0"


def test_a_key_the_chosen_option_lacks_is_named():
    with pytest.raises(ConfigError, match=r"deploy/cuda_tp.*'allow_tf32' not in 'DeviceConfig'"):
        compose_config(["deploy=cuda_tp", "device=cpu"])


@pytest.mark.parametrize("deploy", ["cpu", "simchip"])
def test_the_examples_this_machine_can_run_generate(deploy, tmp_path):
    folder = build_tiny_model(tmp_path, "llama")
    with LLM(model=str(folder), overrides=[f"deploy={deploy}", *engine_overrides()]) as llm:
        (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                              use_tqdm=False)
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def test_every_composed_default_is_the_schemas():
    cfg = compose_config([])
    for group in cfg:
        node = cfg[group]
        for f in dataclasses.fields(OmegaConf.get_type(node)):
            if f.name != "name":  # which option was chosen, not a default
                assert node[f.name] == _default(f), f"{group}.{f.name}"


def _group_option_files() -> list[str]:
    """``group/option.yaml`` of every option that fills its own group (not the whole-stack ones)."""
    return sorted(str(p.relative_to(REPO / "conf")) for p in (REPO / "conf").glob("*/*.yaml")
                  if not p.read_text().startswith("# @package _global_"))


@pytest.mark.parametrize("option", _group_option_files())
def test_a_group_option_file_sets_only_what_differs_from_the_schema(option):
    group = option.split("/")[0]
    defaults = {f.name: _default(f) for f in dataclasses.fields(GROUP_SCHEMAS[group])}
    for key, value in (OmegaConf.to_container(OmegaConf.load(REPO / "conf" / option)) or {}).items():
        assert value != defaults[key], f"conf/{option} repeats the default of {group}.{key}; the schema holds it"


@pytest.mark.parametrize("override, message", [
    ("cache.block_size=0", "cache.block_size=0 must be >= 1"),
    ("cache.memory_fraction=1.5", r"cache.memory_fraction=1.5 must be in \(0, 1\]"),
    ("scheduler.on_step_error=later", "scheduler.on_step_error=later must be recover or shutdown"),
    ("scheduler.overlap_steps=always", "scheduler.overlap_steps=always must be auto or on or off"),
    ("parallel.tensor_size=0", "parallel.tensor_size=0 must be at least 1"),
    ("server.port=70000", r"server.port=70000 must be in \[0, 65535\]"),
    ("model.dtype=int8", "model.dtype=int8 must be auto, float32, bfloat16, float16"),
])
def test_a_value_out_of_range_is_refused_at_composition_and_in_a_config_built_by_hand(override, message):
    with pytest.raises(ConfigError, match=message):
        compose_config([override])
    with pytest.raises(ConfigError, match=message):
        check_ranges(OmegaConf.from_dotlist([override]))
