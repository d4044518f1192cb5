"""The Hydra options the CUDA plugin adds: ``device=cuda memory=cuda ops=cuda streams=cuda comm=nccl``."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from kunlun_infer.config import CommConfig, DeviceConfig, MemoryConfig, OpsConfig, PlatformConfig, StreamsConfig
from kunlun_infer.hookspecs import ConfigOption

DEVICE = "cuda"
COMM = "nccl"


@dataclasses.dataclass
class CudaDeviceConfig(DeviceConfig):
    """``device=cuda``: ``index`` (default: the local rank) and TF32 matmuls (off: exact float32)."""

    name: str = DEVICE
    allow_tf32: bool = False


#: the decode batch sizes captured as CUDA graphs; a step of another size is padded to the next one
GRAPH_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]


@dataclasses.dataclass
class CudaOpsConfig(OpsConfig):
    """``ops=cuda``: ``attention`` (``auto`` | ``triton`` | ``sdpa``), ``fused_kernels`` (``auto`` | ``on`` |
    ``off``; ``auto``: Triton on a GPU when it imports), decode steps captured as CUDA graphs at
    ``step_graph_sizes`` up to ``step_graphs`` sequences."""

    name: str = DEVICE
    attention: str = "auto"
    fused_kernels: str = "auto"
    step_graphs: int = 256
    step_graph_sizes: Optional[List[int]] = dataclasses.field(default_factory=lambda: list(GRAPH_SIZES))


@dataclasses.dataclass
class NcclCommConfig(CommConfig):
    """``comm=nccl``: collectives on a private NCCL process group."""

    name: str = COMM


def config_options() -> list[ConfigOption]:
    return [
        ConfigOption(group="device", name=DEVICE, node=CudaDeviceConfig),
        ConfigOption(group="memory", name=DEVICE, node=MemoryConfig(name=DEVICE)),
        ConfigOption(group="ops", name=DEVICE, node=CudaOpsConfig),
        ConfigOption(group="streams", name=DEVICE, node=StreamsConfig(name=DEVICE)),
        ConfigOption(group="comm", name=COMM, node=NcclCommConfig),
        ConfigOption(group="platform", name=DEVICE,
                     node=PlatformConfig(name=DEVICE, device=DEVICE, memory=DEVICE, ops=DEVICE, comm=COMM,
                                         streams=DEVICE)),
    ]
