"""The hook implementations behind the ``kunlun_infer`` entry point ``simchip``.

Registers ``simchip`` as an option of the device, memory, ops and streams
capabilities, and the matching Hydra options. Collectives are left to the
built-in ``comm=gloo``: simchip tensors are host tensors underneath, which
gloo moves as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

import kunlun_infer_simchip
from kunlun_infer.hookspecs import ConfigOption, PluginInfo, hookimpl

from kunlun_infer_simchip import CHIP_NAME
from kunlun_infer_simchip.config import config_options


def make_device(*, config: Any = None, local_rank: int = 0) -> Any:
    from kunlun_infer_simchip.device import SimchipDevice

    return SimchipDevice.from_config(config, local_rank=local_rank)


def make_memory(*, config: Any = None, device: Any) -> Any:
    from kunlun_infer_simchip.memory import SimchipAllocator

    return SimchipAllocator(device)


def make_ops(*, config: Any = None, device: Any = None) -> Any:
    from kunlun_infer_simchip.ops import SimchipOps

    return SimchipOps()


def make_streams(*, config: Any = None, device: Any = None) -> Any:
    from kunlun_infer_simchip.streams import SimchipStreams

    return SimchipStreams(device)


@hookimpl
def kunlun_infer_plugin_info() -> PluginInfo:
    return PluginInfo(
        name=CHIP_NAME,
        version=kunlun_infer_simchip.__version__,
        api=">=1.1,<2",  # its platform option needs the platform group, its ops the attention backend (1.1)
        capabilities=("device", "memory", "ops", "streams"),
        stack={"torch": torch.__version__},
        description="simulated accelerator on the CPU: 4 KiB-aligned arena in 2 MiB granules, "
                    "worker-thread streams, partial op set, Kunlun-layout attention backend",
    )


@hookimpl
def kunlun_infer_device_factories() -> Mapping[str, Any]:
    return {CHIP_NAME: make_device}


@hookimpl
def kunlun_infer_memory_factories() -> Mapping[str, Any]:
    return {CHIP_NAME: make_memory}


@hookimpl
def kunlun_infer_ops_factories() -> Mapping[str, Any]:
    return {CHIP_NAME: make_ops}


@hookimpl
def kunlun_infer_streams_factories() -> Mapping[str, Any]:
    return {CHIP_NAME: make_streams}


@hookimpl
def kunlun_infer_config_options() -> Iterable[ConfigOption]:
    return config_options()
