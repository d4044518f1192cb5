"""The built-in ``cpu`` device: identity, dtypes from CPU features, memory info, lifecycle."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from kunlun_infer.plugins import cpu_device
from kunlun_infer.plugins.cpu_device import CpuDevice, make_cpu_device


def test_identity_and_stack():
    ident = CpuDevice().identity()
    assert ident["name"] == "cpu" and ident["cores"] >= 1 and ident["arch"]
    assert CpuDevice().stack_versions()["torch"] == torch.__version__


def test_dtypes_follow_cpu_features(monkeypatch):
    monkeypatch.setattr(cpu_device, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    monkeypatch.setattr(cpu_device, "_dtype_works", lambda dtype: False)
    assert CpuDevice().supported_dtypes() == {torch.float32, torch.bfloat16}
    monkeypatch.setattr(cpu_device, "cpu_flags", lambda: frozenset())
    assert CpuDevice().supported_dtypes() == {torch.float32}
    monkeypatch.setattr(cpu_device, "_dtype_works", lambda dtype: dtype == torch.float16)
    assert CpuDevice().supported_dtypes() == {torch.float32, torch.float16}


def test_mem_get_info_reads_host_memory():
    free, total = CpuDevice().mem_get_info()
    with open("/proc/meminfo") as f:
        total_kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    assert total == total_kib * 1024 and 0 < free <= total


def test_close_without_open_is_an_error():
    device = CpuDevice()
    with pytest.raises(RuntimeError, match="closed more often than opened"):
        device.close()


def test_index_comes_from_config_or_local_rank():
    assert make_cpu_device(config=OmegaConf.create({"name": "cpu", "index": None}), local_rank=3).index == 3
    assert make_cpu_device(config=OmegaConf.create({"name": "cpu", "index": 1}), local_rank=3).index == 1
