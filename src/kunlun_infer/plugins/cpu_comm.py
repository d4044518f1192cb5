"""Built-in comm plugins: ``single`` (one process) and ``gloo`` (torch.distributed on CPU).

``gloo`` builds a *private* gloo process group from a rendezvous store
(``tcp://``, ``env://`` or ``file://``): it never creates torch.distributed's
default group, so an application's own use of torch.distributed is left alone.
Low-precision all-reduce is carried out in ``accumulate_dtype`` (float32 by
default) and cast back, so partial sums of bf16/fp16 shards do not lose bits.
The collectives themselves are :class:`~kunlun_infer.plugins.process_group.ProcessGroupComm`'s,
the base every torch.distributed-backed comm plugin shares.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from kunlun_infer.version import __version__
from kunlun_infer.capabilities import Comm, Device
from kunlun_infer.config import COMM_TIMEOUT_S, schema_default
from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.plugins.cpu_device import stack_versions
from kunlun_infer.plugins.process_group import ProcessGroupComm, parse_dtype

__all__ = ["GlooComm", "SingleComm", "make_gloo", "make_single", "parse_dtype"]

PLUGIN_NAME = "cpu-comm"


class SingleComm(Comm):
    """World size 1: every collective returns its input."""

    name = "single"

    def __init__(self, *, accumulate_dtype: torch.dtype | None = torch.float32) -> None:
        self.default_accumulate_dtype = accumulate_dtype

    def init(self, *, rank: int, world_size: int, init_method: str | None = None, timeout_s: float = COMM_TIMEOUT_S) -> None:
        if rank != 0 or world_size != 1:
            raise ValueError(f"comm=single serves exactly one process (rank 0 of 1), asked for rank {rank} of "
                             f"{world_size}; choose comm=gloo for tensor parallelism")
        self.rank, self.world_size = 0, 1

    def all_reduce(self, tensor: torch.Tensor, accumulate_dtype: torch.dtype | None = None) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass

    def destroy(self) -> None:
        pass


class GlooComm(ProcessGroupComm):
    """Collectives on a private gloo process group (control tensors on the host)."""

    name = "gloo"

    def new_group(self, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def release_group(self, group: Any) -> None:
        pass  # gloo's threads and sockets go with the last reference to the group


def _accumulate(config: Any) -> torch.dtype | None:
    default = schema_default("comm.accumulate_dtype")
    return parse_dtype(config.get("accumulate_dtype", default) if config is not None else default)


def make_single(*, config: Any, device: Device) -> SingleComm:
    return SingleComm(accumulate_dtype=_accumulate(config))


def make_gloo(*, config: Any, device: Device) -> GlooComm:
    return GlooComm(accumulate_dtype=_accumulate(config))


@hookimpl
def kunlun_infer_plugin_info() -> PluginInfo:
    stack = dict(stack_versions(), gloo="built into torch " + torch.__version__)
    return PluginInfo(name=PLUGIN_NAME, version=__version__, api=">=1.0,<2", capabilities=("comm",),
                      stack=stack, description="single-process identity collectives and gloo")


@hookimpl
def kunlun_infer_comm_factories() -> dict[str, Any]:
    return {"single": make_single, "gloo": make_gloo}
