"""Broken model folders, opened the way a user opens them (``LLM(model=...)``).

Each is refused with a ``ModelLoadError`` naming the file (and the tensor or
field at fault) before any compute: the installed ``flaky`` ops and memory
plugins count every kernel call and allocation, and see none.
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from kunlun_infer import LLM
from kunlun_infer.errors import ModelLoadError
from tests.hardening.conftest import tiny_overrides


def edit_config(folder, **fields):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in fields.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def truncate(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-700])


def garble_header(folder):
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:24] = b"\x00not json at all"
    path.write_bytes(bytes(data))


def huge_header_length(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**62) + data[8:])


def empty_file(folder):
    (folder / "model.safetensors").write_bytes(b"")


def rename_tensor(folder):
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.mlp.gate_proj.wieght"] = tensors.pop("model.layers.0.mlp.gate_proj.weight")
    save_file(tensors, path, metadata={"format": "pt"})


CASES = {
    "truncated weights": (truncate, r"model\.safetensors is truncated: tensor '[^']+'"),
    "garbled header": (garble_header, r"model\.safetensors is not a readable safetensors file"),
    "header length past the end": (huge_header_length, r"model\.safetensors"),
    "empty weights file": (empty_file, r"model\.safetensors"),
    "misnamed tensor": (rename_tensor, r"'model\.layers\.0\.mlp\.gate_proj\.weight' .*is missing"),
    "shapes not matching the config": (lambda f: edit_config(f, intermediate_size=48),
                                       r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight'.*48"),
    "config without hidden_size": (lambda f: edit_config(f, hidden_size=None), r"config\.json.*hidden_size"),
    "config with a wrong type": (lambda f: edit_config(f, num_hidden_layers="two"),
                                 r"config\.json.*num_hidden_layers"),
    "config with heads not dividing": (lambda f: edit_config(f, num_key_value_heads=3),
                                       r"config\.json.*num_key_value_heads=3"),
    "config.json not JSON": (lambda f: (f / "config.json").write_text("{'hidden_size': 32,"),
                             r"config\.json is not readable JSON"),
    "unknown architecture": (lambda f: edit_config(f, architectures=["EvilForCausalLM"]),
                             r"config\.json.*EvilForCausalLM is not supported"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_broken_model_folder_is_refused_naming_file_and_tensor_before_any_compute(
        case, flaky, tiny_folder, tmp_path):
    folder = shutil.copytree(tiny_folder, tmp_path / "model")
    damage, message = CASES[case]
    damage(folder)
    with pytest.raises(ModelLoadError, match=message):
        LLM(model=str(folder), overrides=tiny_overrides(folder, ops="flaky", memory="flaky"))
    assert all(sum(ops.calls.values()) == 0 for ops in flaky.PROVIDERS), "a kernel ran before the refusal"
    assert all(memory.calls == 0 for memory in flaky.ALLOCATORS), "memory was allocated before the refusal"
