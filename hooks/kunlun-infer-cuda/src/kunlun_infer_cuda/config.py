"""The Hydra options the CUDA plugin adds: ``device=cuda memory=cuda ops=cuda streams=cuda comm=nccl``."""

from __future__ import annotations

import dataclasses

from kunlun_infer.config import CommConfig, DeviceConfig, MemoryConfig, OpsConfig, PlatformConfig, StreamsConfig
from kunlun_infer.hookspecs import ConfigOption

DEVICE = "cuda"
COMM = "nccl"


@dataclasses.dataclass
class CudaDeviceConfig(DeviceConfig):
    """``device=cuda``: ``index`` (default: the local rank) and TF32 matmuls (off: exact float32)."""

    name: str = DEVICE
    allow_tf32: bool = False


@dataclasses.dataclass
class NcclCommConfig(CommConfig):
    """``comm=nccl``: collectives on a private NCCL process group."""

    name: str = COMM


def config_options() -> list[ConfigOption]:
    return [
        ConfigOption(group="device", name=DEVICE, node=CudaDeviceConfig),
        ConfigOption(group="memory", name=DEVICE, node=MemoryConfig(name=DEVICE)),
        ConfigOption(group="ops", name=DEVICE, node=OpsConfig(name=DEVICE)),
        ConfigOption(group="streams", name=DEVICE, node=StreamsConfig(name=DEVICE)),
        ConfigOption(group="comm", name=COMM, node=NcclCommConfig),
        ConfigOption(group="platform", name=DEVICE,
                     node=PlatformConfig(name=DEVICE, device=DEVICE, memory=DEVICE, ops=DEVICE, comm=COMM,
                                         streams=DEVICE)),
    ]
