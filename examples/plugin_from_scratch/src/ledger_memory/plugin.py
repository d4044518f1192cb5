"""The hook implementations the entry point ``ledger`` points at."""

from __future__ import annotations

import dataclasses
from typing import Optional

from kunlun_infer.config import MemoryConfig
from kunlun_infer.hookspecs import ConfigOption, PluginInfo, hookimpl

import ledger_memory


@dataclasses.dataclass
class LedgerMemoryConfig(MemoryConfig):
    """``memory=ledger``: ``limit`` caps the bytes it hands out (None = the device's free memory)."""

    name: str = "ledger"
    limit: Optional[int] = None


def make_ledger(*, config, device):
    from ledger_memory.allocator import LedgerAllocator

    limit = config.get("limit") if config is not None else None
    return LedgerAllocator(device, limit=None if limit is None else int(limit))


@hookimpl
def kunlun_infer_plugin_info():
    return PluginInfo(name="ledger", version=ledger_memory.__version__, api=">=1.0,<2",
                      capabilities=("memory",), description="memory with a byte budget and a ledger")


@hookimpl
def kunlun_infer_memory_factories():
    return {"ledger": make_ledger}


@hookimpl
def kunlun_infer_config_options():
    return [ConfigOption(group="memory", name="ledger", node=LedgerMemoryConfig)]
