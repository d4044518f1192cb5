"""The security model of SECURITY.md, claim by claim.

Each "never" is tested with a booby trap: a pickle, a module or a plugin that
would leave a marker file behind if its code ran. The marker must not appear.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kunlun_infer import LLM, SamplingParams, compose_config
from kunlun_infer.errors import ConfigError, ModelLoadError, RequestError
from kunlun_infer.runtime import PluginManager
from tests.hardening.conftest import tiny_overrides

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


class TouchOnUnpickle:
    """Unpickling this object creates ``marker``: what a malicious checkpoint could do, harmlessly."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def booby_trapped_pickle(path: Path, marker: Path) -> None:
    probe = marker.with_name("probe")
    pickle.loads(pickle.dumps(TouchOnUnpickle(probe)))  # the trap works when it is unpickled
    assert probe.exists()
    path.write_bytes(pickle.dumps({"model.embed_tokens.weight": TouchOnUnpickle(marker)}))


def trap_module(path: Path, marker: Path) -> None:
    path.write_text(f"from pathlib import Path\nPath({str(marker)!r}).touch()\n")


def snapshot(folder: Path) -> dict[str, tuple[int, float, str]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def model(tiny_folder, tmp_path) -> Path:
    return shutil.copytree(tiny_folder, tmp_path / "model")


# ---------------------------------------------------------------------------- weights: safetensors only


def test_a_pickle_only_checkpoint_is_refused_without_being_unpickled(model, tmp_path):
    marker = tmp_path / "pickle-ran"
    (model / "model.safetensors").unlink()
    booby_trapped_pickle(model / "pytorch_model.bin", marker)
    with pytest.raises(ModelLoadError, match=r"only pickle weights \(pytorch_model\.bin\)"):
        LLM(overrides=tiny_overrides(model))
    assert not marker.exists()


def test_pickles_beside_safetensors_are_never_opened(model, tmp_path):
    marker = tmp_path / "pickle-ran"
    for name in ("pytorch_model.bin", "model.pt", "training_args.bin", "optimizer.pt"):
        booby_trapped_pickle(model / name, marker)
    with LLM(overrides=tiny_overrides(model)) as llm:
        assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids) == 4
    assert not marker.exists()


# ---------------------------------------------------------------------------- model folders: read, never run


def test_custom_code_in_a_model_folder_is_never_imported(model, tmp_path):
    marker = tmp_path / "custom-code-ran"
    trap_module(model / "modeling_evil.py", marker)
    trap_module(model / "tokenization_evil.py", marker)
    trap_module(model / "__init__.py", marker)
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    tokenizer_config["tokenizer_class"] = "EvilTokenizer"
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with LLM(overrides=tiny_overrides(model)) as llm:  # the built-in Llama serves it; auto_map is ignored
        llm.generate(["hello"], GREEDY, use_tqdm=False)
    config["architectures"] = ["EvilForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="EvilForCausalLM is not supported"):
        LLM(overrides=tiny_overrides(model))
    assert not marker.exists()
    assert not [m for m in list(sys.modules.values()) if str(model) in str(getattr(m, "__file__", None) or "")]


def test_a_model_folder_is_only_read(model):
    """Loading, generating and closing change no file of the folder and create none."""
    before = snapshot(model)
    writes: list[tuple] = []
    watching = [True]

    def audit(event, args):
        if event == "open" and watching[0] and str(model) in str(args[0]):
            path, mode, flags = args
            if set(mode or "") & set("wax+") or (flags or 0) & 0o3:  # O_WRONLY or O_RDWR
                writes.append(args)

    sys.addaudithook(audit)  # hooks cannot be removed: this one only watches this folder, during this test
    try:
        with LLM(overrides=tiny_overrides(model)) as llm:
            llm.generate(["a prompt", [4, 5, 6]], GREEDY, use_tqdm=False)
    finally:
        watching[0] = False
    assert writes == [] and snapshot(model) == before


# ---------------------------------------------------------------------------- configs: no _target_


@pytest.mark.parametrize("override", ["+device._target_=os.system", "+model._target_=builtins.eval",
                                      "+_target_=subprocess.run", "++cache._target_=os.system"])
def test_target_is_refused_in_overrides(override):
    with pytest.raises(ConfigError, match="never carry '_target_'"):
        compose_config([override])


def test_target_is_refused_in_a_config_built_by_hand(tiny_folder, tmp_path):
    marker = tmp_path / "target-ran"
    raw = OmegaConf.to_container(compose_config(tiny_overrides(tiny_folder)))
    raw["memory"]["_target_"] = "pathlib.Path.touch"
    raw["memory"]["self"] = str(marker)
    with pytest.raises(ConfigError, match=r"memory\._target_: configs never carry '_target_'"):
        LLM.from_config(OmegaConf.create(raw))
    raw["memory"].pop("_target_")
    raw["scheduler"]["presets"] = [{"_target_": "os.system", "command": "true"}]
    with pytest.raises(ConfigError, match=r"scheduler\.presets\[0\]\._target_"):
        LLM.from_config(OmegaConf.create(raw))
    assert not marker.exists()


# ---------------------------------------------------------------------------- plugins: entry points, allow/block


def plugin_source(marker: Path) -> str:
    return textwrap.dedent(f"""
        from pathlib import Path
        Path({str(marker)!r}).touch()  # importing a plugin runs its code: installing it is trusting it
    """)


def test_plugins_load_only_through_the_entry_point_group_and_the_env_lists(make_distribution, monkeypatch,
                                                                           tmp_path):
    markers = {name: tmp_path / f"{name}-imported" for name in ("blocked", "unlisted", "elsewhere", "allowed")}
    for name in ("blocked", "unlisted", "allowed"):
        make_distribution(f"kunlun-infer-{name}", plugin_source(markers[name]), entry_point=name)
    other_group = make_distribution.root / "other_group-1.0.dist-info"  # a module under another group's name
    other_group.mkdir()
    (other_group / "METADATA").write_text("Metadata-Version: 2.1\nName: other-group\nVersion: 1.0\n")
    (other_group / "entry_points.txt").write_text("[kunlun_infer_extras]\nelsewhere = elsewhere_plugin\n")
    (make_distribution.root / "elsewhere_plugin.py").write_text(plugin_source(markers["elsewhere"]))

    monkeypatch.setenv("KUNLUN_INFER_PLUGINS", "blocked,allowed")
    monkeypatch.setenv("KUNLUN_INFER_DISABLE_PLUGINS", "blocked")
    manager = PluginManager.load()
    assert markers["allowed"].exists()
    assert not markers["blocked"].exists() and not markers["unlisted"].exists()
    assert not markers["elsewhere"].exists()
    skipped = dict(manager.skipped)
    assert skipped["blocked"] == "listed in KUNLUN_INFER_DISABLE_PLUGINS"
    assert skipped["unlisted"] == "not listed in KUNLUN_INFER_PLUGINS"


# ---------------------------------------------------------------------------- chat templates, server


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['__builtins__'] }}",
    "{% set ns = namespace(_private=1) %}{{ ns }}",
    "{{ messages.append({'role': 'user', 'content': 'injected'}) }}",
    "{% include '/etc/passwd' %}",
    "{% import 'os' as os %}",
    "{{ 1 / 0 }}",
    "{{ range(10**12) | list }}",
])
def test_chat_templates_cannot_reach_the_interpreter_or_the_files(template, tmp_path):
    from kunlun_infer.chat import load_chat_template
    from tests.chat_models import write_chat_tokenizer

    write_chat_tokenizer(tmp_path, template)
    with pytest.raises(RequestError):
        load_chat_template(tmp_path).render([{"role": "user", "content": "hi"}])


def test_the_server_binds_to_loopback_unless_told_otherwise():
    assert compose_config([]).server.host == "127.0.0.1"
