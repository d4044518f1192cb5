"""The hook implementations behind the ``kunlun_infer`` entry point ``cuda``.

Registers ``cuda`` for device, memory, ops and streams, and ``nccl`` for comm.
Loading needs no GPU: factories only build objects; ``Device.open`` is the
first thing that touches the hardware.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

import kunlun_infer_cuda
from kunlun_infer.hookspecs import ConfigOption, PluginInfo, hookimpl
from kunlun_infer.version import distribution_version

from kunlun_infer_cuda.config import COMM, DEVICE, config_options
from kunlun_infer_cuda.device import config_value


def make_device(*, config: Any = None, local_rank: int = 0) -> Any:
    from kunlun_infer_cuda.device import CudaDevice

    return CudaDevice.from_config(config, local_rank=local_rank)


def make_memory(*, config: Any = None, device: Any) -> Any:
    from kunlun_infer_cuda.memory import CudaCachingAllocator

    return CudaCachingAllocator(device)


def make_ops(*, config: Any = None, device: Any = None) -> Any:
    from kunlun_infer_cuda.ops import TorchCudaOps

    return TorchCudaOps(torch_device=getattr(device, "torch_device", None),
                        attention=str(config_value(config, "attention", "auto")),
                        fused_kernels=str(config_value(config, "fused_kernels", "auto")))


def make_streams(*, config: Any = None, device: Any) -> Any:
    from kunlun_infer_cuda.streams import CudaStreams

    return CudaStreams(device)


def make_comm(*, config: Any = None, device: Any) -> Any:
    from kunlun_infer_cuda.comm import DistComm, parse_dtype

    return DistComm(device=device, accumulate_dtype=parse_dtype(config_value(config, "accumulate_dtype", "float32")))


@hookimpl
def kunlun_infer_plugin_info() -> PluginInfo:
    return PluginInfo(
        name="cuda",
        version=kunlun_infer_cuda.__version__,
        api=">=1.1,<2",  # its platform option needs the platform group (1.1)
        capabilities=("device", "memory", "ops", "comm", "streams"),
        stack={"torch": torch.__version__, "cuda runtime": str(torch.version.cuda or "none"),
               # without Triton the torch kernels serve
               "triton": distribution_version("triton") or "not installed"},
        description="NVIDIA GPUs: torch.cuda device, caching allocator, CUDA streams, NCCL, Triton paged "
                    "attention, fused norms and rotary, CUDA-graph decode steps",
    )


@hookimpl
def kunlun_infer_device_factories() -> Mapping[str, Any]:
    return {DEVICE: make_device}


@hookimpl
def kunlun_infer_memory_factories() -> Mapping[str, Any]:
    return {DEVICE: make_memory}


@hookimpl
def kunlun_infer_ops_factories() -> Mapping[str, Any]:
    return {DEVICE: make_ops}


@hookimpl
def kunlun_infer_streams_factories() -> Mapping[str, Any]:
    return {DEVICE: make_streams}


@hookimpl
def kunlun_infer_comm_factories() -> Mapping[str, Any]:
    return {COMM: make_comm}


@hookimpl
def kunlun_infer_config_options() -> Iterable[ConfigOption]:
    return config_options()
