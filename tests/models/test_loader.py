"""Weights load only from safetensors, sharded or not, and every problem names its file and tensor."""

from __future__ import annotations

import json
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from kunlun_infer.errors import ModelLoadError
from kunlun_infer.models import load_model
from tests.models.hf_factory import build_hf_model
from tests.models.paged import PagedKV, ReferenceRuntime, hf_logits, max_relative_error


@pytest.fixture
def folder(tmp_path):
    build_hf_model(tmp_path, "llama", tokenizer=False)
    return tmp_path


def rewrite(folder, change):
    """Apply ``change(tensors)`` to model.safetensors and save it back."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def load(folder, **kwargs):
    return load_model(folder, runtime=ReferenceRuntime(), dtype=torch.float32, **kwargs)


def test_sharded_checkpoint_loads(tmp_path, runtime):
    hf = build_hf_model(tmp_path, "qwen3", max_shard_size="60KB", tokenizer=False)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "model.safetensors").exists()
    model = load_model(tmp_path, runtime=runtime, dtype=torch.float32)
    tokens = list(range(3, 20))
    assert max_relative_error(PagedKV(model).step({0: tokens})[0], hf_logits(hf, tokens)) < 1e-4


def test_tied_checkpoint_that_also_stores_lm_head_loads(folder, tmp_path):
    hf = build_hf_model(tmp_path / "q", "qwen2", tokenizer=False)
    rewrite(tmp_path / "q", lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model = load(tmp_path / "q")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert max_relative_error(PagedKV(model).step({0: [5, 6, 7]})[0], hf_logits(hf, [5, 6, 7])) < 1e-4


def test_missing_tensor_is_named(folder):
    rewrite(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' \(shape \[96, 64\]\) "
                                             r"is missing from model\.safetensors"):
        load(folder)
    rewrite(folder, lambda t: [t.pop(n) for n in list(t) if n.startswith("model.layers.0.")])
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\..*' \(shape .*\) \(and 9 more\) is missing"):
        load(folder)


def test_wrong_shape_is_named_with_file_and_shapes(folder):
    rewrite(folder, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(48, 64)}))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj"
                                             r"\.weight' has shape \[48, 64\], but config\.json implies \[32, 64\]"):
        load(folder)


def test_unexpected_tensor_is_named(folder):
    rewrite(folder, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        load(folder)


def test_integer_weights_are_refused(folder):
    rewrite(folder, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int8)}))
    with pytest.raises(ModelLoadError, match=r"'model\.norm\.weight' has dtype I8"):
        load(folder)


def test_truncated_file_is_named(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-1000])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is truncated: tensor '.*'"):
        load(folder)


def test_corrupt_header_is_named(folder):
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"garbage!!!!!"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is not a readable safetensors file"):
        load(folder)


def test_missing_shard_is_named(tmp_path):
    build_hf_model(tmp_path, "llama", max_shard_size="60KB", tokenizer=False)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"lists {shard.name}, which is missing"):
        load(tmp_path)


def test_pickle_only_folder_is_refused_without_unpickling(folder, monkeypatch):
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was loaded"))
    with pytest.raises(ModelLoadError, match=r"only pickle weights \(pytorch_model\.bin\); only safetensors"):
        load(folder)


def test_folder_without_weights(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights in"):
        load(folder)


def test_model_that_cannot_be_split_is_refused(folder):
    comm = object()  # never used: the split is refused before any compute
    with pytest.raises(ModelLoadError, match=r"cannot split this model over 3 ranks: attention heads \(4\)"):
        load_model(folder, runtime=ReferenceRuntime(comm=comm), dtype=torch.float32, tp_rank=0, tp_size=3)


def test_ops_are_resolved_through_the_runtime(folder):
    runtime = ReferenceRuntime()  # offers no attention backend: the reference backend's ops are resolved too
    model = load_model(folder, runtime=runtime, dtype=torch.float32)
    assert runtime.resolved == [*model.required_ops, "store_kv", "paged_attention"]
    assert model.attention.name == "reference"


def test_what_loading_freed_goes_back_once_the_weights_are_in_place(folder, monkeypatch):
    """The loader calls the runtime's ``memory.empty_cache`` after the weights are loaded (the checkpoint's copies
    and the weights before packing are free by then), once; a runtime without ``memory`` loads as before."""
    from kunlun_infer.models import loader

    events = []
    weights = loader.load_weights
    monkeypatch.setattr(loader, "load_weights", lambda *a, **k: (weights(*a, **k), events.append("weights"))[0])
    runtime = ReferenceRuntime()
    runtime.memory = types.SimpleNamespace(empty_cache=lambda: events.append("empty_cache"))
    load_model(folder, runtime=runtime, dtype=torch.float32)
    assert events == ["weights", "empty_cache"]
    events.clear()
    load(folder)  # ReferenceRuntime has no memory
    assert events == ["weights"]
