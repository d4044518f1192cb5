"""The peer benchmark reads the checkpoint kunlun_infer serves, bit for bit, without torch (the peers' Pythons
may have none), so llama.cpp and vLLM are measured on the same weights."""

import pytest
import torch
from safetensors.torch import save_file

from tests.scripts import load_script


@pytest.fixture(scope="module")
def cpu_peers():
    return load_script("benchmarks/cpu_peers.py")


def test_reads_bf16_f16_and_f32_tensors_exactly(cpu_peers, tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(5, 7, generator=g).to(torch.bfloat16),
               "b.bias": torch.randn(3, generator=g).to(torch.float16),
               "c.norm": torch.randn(2, 2, 2, generator=g)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    read = cpu_peers.read_safetensors(tmp_path)
    assert sorted(read) == sorted(tensors)
    for name, tensor in tensors.items():
        assert read[name].shape == tuple(tensor.shape)
        assert torch.equal(torch.from_numpy(read[name].copy()), tensor.float()), name


def test_refuses_a_dtype_it_cannot_widen(cpu_peers, tmp_path):
    save_file({"q": torch.ones(4, dtype=torch.int8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="tensor q has dtype I8"):
        cpu_peers.read_safetensors(tmp_path)


def test_every_dtype_perf_cpu_measures_has_peers_that_exist(cpu_peers):
    assert set(cpu_peers.FOR_DTYPE) == {"bfloat16", "float32", "int8"}
    assert all(engine in cpu_peers.ENGINES for engines in cpu_peers.FOR_DTYPE.values() for engine in engines)
