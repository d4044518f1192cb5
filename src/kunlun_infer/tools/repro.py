"""Minimal repros: a failing doctor stage becomes a standalone pytest file.

The file records what failed — the op or collective, its shapes and dtypes,
the seed, the overrides choosing the plugins, the plugin modules registered
by code and the plugin versions — and re-runs just that check, so it fails
while the fault is there and passes once it is fixed. Named ``test_*.py``,
it is collected as-is when dropped into a plugin's test folder. Inputs
captured from a model run are saved beside it as safetensors.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

PREFIX = "test_kunlun_infer_repro"


def default_repro_dir() -> Path:
    """Where repros go when no folder is given: under the system's temp folder, not the cwd."""
    return Path(tempfile.gettempdir()) / "kunlun-infer-repro"


@dataclasses.dataclass
class Repro:
    """One failure to reproduce. ``kind`` picks the test body; ``constants`` are written as Python literals."""

    kind: str
    stage: int
    stage_name: str
    subject: str
    summary: str
    layer: str
    plugin: str | None
    hook: str | None
    overrides: list[str]
    modules: list[str]
    versions: dict[str, str]
    constants: dict[str, Any] = dataclasses.field(default_factory=dict)
    tensors: dict[str, torch.Tensor] | None = None


_BODIES = {
    "device": '''
def test_device_round_trip_and_memory():
    from kunlun_infer.testing import build_runtime, check_allocations, check_device

    runtime = build_runtime(OVERRIDES, MODULES)
    try:
        check_device(runtime.device)
        check_allocations(runtime.memory)
    finally:
        runtime.close()
''',
    "plugins": '''
def test_chosen_plugins_load():
    from kunlun_infer.testing import build_runtime, plugin_manager

    manager = plugin_manager(MODULES)
    broken = [f"{e.name}: {e.message}" for e in manager.load_errors]
    assert not broken, "plugins failed to load: " + "; ".join(broken)
    build_runtime(OVERRIDES, MODULES).close()
''',
    "op": '''
def test_op_matches_reference():
    from kunlun_infer.testing import build_runtime, check_op

    runtime = build_runtime(OVERRIDES, MODULES)
    try:
        check_op(runtime.ops, OP, getattr(torch, DTYPE), runtime.device.torch_device, seed=SEED)
    finally:
        runtime.close()
''',
    "op_inputs": '''
def test_op_matches_reference_on_captured_inputs():
    from pathlib import Path

    from safetensors.torch import load_file

    from kunlun_infer.ops import OP_SPECS
    from kunlun_infer.testing import assert_matches, build_runtime

    tensors = load_file(str(Path(__file__).with_suffix(".safetensors")))
    runtime = build_runtime(OVERRIDES, MODULES)
    try:
        device = runtime.device.torch_device

        def arguments():
            return [tensors[a["tensor"]].to(device) if "tensor" in a else a["value"] for a in ARGS]

        mine, ref = arguments(), arguments()
        got = runtime.ops.get(OP)(*mine)
        want = OP_SPECS[OP].reference(*ref)
        what, dtype = f"op '{OP}' on the inputs captured from the model", getattr(torch, DTYPE)
        index = OP_SPECS[OP].in_place_arg
        if index is None:
            assert_matches(got, want, what=what, dtype=dtype)
        else:
            for i in (index, index + 1) if OP == "store_kv" else (index,):
                assert_matches(mine[i], ref[i], what=what, dtype=dtype, path=f"argument {i} (updated in place)")
    finally:
        runtime.close()
''',
    "attention": '''
def test_attention_backend_matches_reference_backend():
    from kunlun_infer.testing import build_runtime, check_attention_backend

    runtime = build_runtime(OVERRIDES, MODULES)
    try:
        check_attention_backend(runtime.ops, runtime.device, dtypes=[getattr(torch, DTYPE)], seed=SEED)
    finally:
        runtime.close()
''',
    "attention_model": '''
def test_tiny_model_logits_with_the_attention_backend_equal_the_reference(tmp_path):
    from kunlun_infer.testing import build_runtime
    from kunlun_infer.tools.doctor.model_check import compare_logits, mixed_table, run_logits
    from kunlun_infer.tools.tiny_model import write_tiny_model

    folder = write_tiny_model(tmp_path / "tiny", seed=SEED)
    runtime = build_runtime(OVERRIDES, MODULES)
    try:
        want = run_logits(runtime, folder, mixed_table(runtime, ()), seed=SEED)
        got = run_logits(runtime, folder, mixed_table(runtime, ()), seed=SEED, plugin_attention=True)
        difference = compare_logits(got, want)
        assert difference is None, difference
    finally:
        runtime.close()
''',
    "collectives": '''
def test_collectives_exact_on_every_rank():
    from kunlun_infer.testing import check_collectives

    check_collectives(OVERRIDES, world_size=WORLD_SIZE, modules=MODULES)
''',
    "tensor_parallel": '''
def test_multi_device_equals_single_device(tmp_path):
    from kunlun_infer import LLM, SamplingParams
    from kunlun_infer.tools.tiny_model import write_tiny_model

    folder = write_tiny_model(tmp_path / "tiny", tensor_size=WORLD_SIZE, seed=SEED)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = {}
    for size in (1, WORLD_SIZE):
        with LLM(model=str(folder), overrides=OVERRIDES + [f"parallel.tensor_size={size}"]) as llm:
            tokens[size] = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert tokens[WORLD_SIZE] == tokens[1]
''',
}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower() or "failure"


def repro_path(directory: Path, stage: int, subject: str) -> Path:
    return Path(directory) / f"{PREFIX}_stage{stage}_{_slug(subject)}.py"


def write_repro(repro: Repro, directory: str | Path) -> Path:
    """Write the repro (and its captured tensors) into ``directory``; returns the test file's path."""
    from safetensors.torch import save_file

    if repro.kind not in _BODIES:
        raise ValueError(f"unknown repro kind {repro.kind!r}; kinds: {', '.join(_BODIES)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = repro_path(directory, repro.stage, repro.subject)
    versions = "\n".join(f"    {k}: {v}" for k, v in repro.versions.items())
    summary = "\n".join(f"    {line}" for line in repro.summary.splitlines())
    at_fault = ", ".join(x for x in (f"layer {repro.layer}", f"plugin {repro.plugin}" if repro.plugin else "",
                                     f"hook {repro.hook}" if repro.hook else "") if x)
    lines = [
        f'"""Regression test written by `kunlun-infer doctor`: stage {repro.stage} ({repro.stage_name}) failed.',
        "",
        "What failed:",
        summary.replace('"""', "'''").replace("\\", "\\\\"),
        "",
        f"At fault: {at_fault}.",
        "",
        "Versions when it was written:",
        versions,
        "",
        f"Run: pytest {path.name}   (it passes once the fault is fixed)",
        '"""',
        "",
        "import torch",
        "",
        f"OVERRIDES = {list(repro.overrides)!r}",
        "#: plugin modules registered by code (plugins not installed as distributions)",
        f"MODULES = {list(repro.modules)!r}",
    ]
    lines += [f"{name} = {value!r}" for name, value in repro.constants.items()]
    text = "\n".join(lines) + "\n\n\n" + _BODIES[repro.kind].lstrip("\n")
    if repro.tensors is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in repro.tensors.items()},
                  str(path.with_suffix(".safetensors")))
    path.write_text(text, encoding="utf-8")
    return path
