"""The hook implementations behind the ``kunlun_infer`` entry point ``kunlun``.

Registers ``kunlun`` for device, memory, ops and streams, and ``bkcl`` for
comm. Loading runs no tool and imports no vendor module: the plugin lists
itself and composes configs on any machine; detection happens when the
device is opened (and in ``Device.stack_versions``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

import kunlun_infer_kunlun
from kunlun_infer.hookspecs import ConfigOption, PluginInfo, hookimpl

from kunlun_infer_cuda.device import config_value
from kunlun_infer_kunlun.config import COMM, DEVICE, config_options


def make_device(*, config: Any = None, local_rank: int = 0) -> Any:
    from kunlun_infer_kunlun.device import KunlunDevice

    return KunlunDevice.from_config(config, local_rank=local_rank)


def make_memory(*, config: Any = None, device: Any) -> Any:
    from kunlun_infer_kunlun.capabilities import KunlunAllocator

    return KunlunAllocator(device)


def make_ops(*, config: Any = None, device: Any = None) -> Any:
    from kunlun_infer_kunlun.ops import KunlunOps

    return KunlunOps()


def make_streams(*, config: Any = None, device: Any) -> Any:
    from kunlun_infer_kunlun.capabilities import KunlunStreams

    return KunlunStreams(device)


def make_comm(*, config: Any = None, device: Any) -> Any:
    from kunlun_infer.plugins.process_group import parse_dtype
    from kunlun_infer_kunlun.comm import BkclComm
    from kunlun_infer_kunlun.config import BkclCommConfig
    from kunlun_infer_kunlun.tuning import tuning_env

    return BkclComm(device=device, tuning=tuning_env(config if config is not None else BkclCommConfig()),
                    accumulate_dtype=parse_dtype(config_value(config, "accumulate_dtype", "float32")))


@hookimpl
def kunlun_infer_plugin_info() -> PluginInfo:
    from kunlun_infer_kunlun.detect import StackProbe, package_versions

    found = package_versions(StackProbe())  # installed distributions only: no tool runs, nothing is imported
    stack = {"torch": torch.__version__, **{k: v or "not installed" for k, v in found.items() if k != "torch"}}
    return PluginInfo(
        name="kunlun",
        version=kunlun_infer_kunlun.__version__,
        api=">=1.1,<2",  # its platform option needs the platform group (1.1)
        capabilities=("device", "memory", "ops", "comm", "streams"),
        stack=stack,
        description="Kunlun XPU (P800) via the xpytorch build, BKCL/XCCL collectives; not yet run on a Kunlun card",
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
