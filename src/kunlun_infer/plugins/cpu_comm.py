"""Built-in comm plugins: ``single`` (one process) and ``gloo`` (torch.distributed on CPU).

``gloo`` builds a *private* gloo process group from a rendezvous store
(``tcp://``, ``env://`` or ``file://``): it never creates torch.distributed's
default group, so an application's own use of torch.distributed is left alone.
Low-precision all-reduce is carried out in ``accumulate_dtype`` (float32 by
default) and cast back, so partial sums of bf16/fp16 shards do not lose bits.
The collectives themselves are :class:`~kunlun_infer.plugins.process_group.ProcessGroupComm`'s,
the base every torch.distributed-backed comm plugin shares, except where every
rank of a group is on one host: there its all-reduces, gathers, broadcasts,
all-to-alls and barriers (objects' broadcasts too) and its point-to-point
messages go through a shared-memory segment
(:mod:`~kunlun_infer.plugins.host_collectives`).
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
from kunlun_infer.plugins.host_collectives import HostSegment
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
    """Collectives on a private gloo process group (control tensors on the host), through shared memory among
    the ranks of one host (:class:`~kunlun_infer.plugins.host_collectives.HostSegment`)."""

    name = "gloo"

    def __init__(self, *, accumulate_dtype: torch.dtype | None = torch.float32) -> None:
        super().__init__(accumulate_dtype=accumulate_dtype)
        #: the group's shared-memory segment where its ranks share a host
        self.host: HostSegment | None = None

    def new_group(self, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def release_group(self, group: Any) -> None:
        pass  # gloo's threads and sockets go with the last reference to the group

    def init(self, *, rank: int, world_size: int, init_method: str | None = None,
             timeout_s: float = COMM_TIMEOUT_S) -> None:
        super().init(rank=rank, world_size=world_size, init_method=init_method, timeout_s=timeout_s)
        self.host = HostSegment.join(self, timeout_s)

    def subgroup(self, ranks: Any) -> GlooComm:
        parent, self.host = self.host, None  # the copy the subgroup starts from must not share this group's segment
        try:
            sub = super().subgroup(ranks)
        finally:
            self.host = parent
        sub.host = HostSegment.join(sub, self._timeout.total_seconds())
        return sub

    def destroy(self) -> None:
        host, self.host = self.host, None
        if host is not None:
            host.close()
        super().destroy()

    def buffer_bytes(self) -> int:
        return sum(comm.host.nbytes for comm in (self, *self._subgroups) if comm.host is not None)

    @property
    def capturable(self) -> bool:
        """On one host with the native all-reduce: a float32 or bf16 all-reduce is one call the ``cpu`` ops'
        capture records (any other all-reduce copies in torch, which the capture refuses)."""
        return self.host is not None and self.host.native_all_reduce

    def all_reduce(self, tensor: torch.Tensor, accumulate_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.host is None:
            return super().all_reduce(tensor, accumulate_dtype)
        return self.host.all_reduce(tensor, self.accumulate_dtype_for(tensor, accumulate_dtype) or tensor.dtype)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.host is None:
            return super().all_gather(tensor, dim)
        return self.host.all_gather(tensor, dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.host is None:
            return super().broadcast(tensor, src)
        return self.host.broadcast(tensor, src)

    def all_to_all(self, tensor: torch.Tensor, send_splits: Any, recv_splits: Any) -> torch.Tensor:
        if self.host is None or not self.host.native_all_to_all:
            return super().all_to_all(tensor, send_splits, recv_splits)
        return self.host.all_to_all(tensor, send_splits, recv_splits)

    def barrier(self) -> None:
        if self.host is None:
            super().barrier()
        else:
            self.host.barrier()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        if self.host is None:
            super().send(tensor, dst)
        else:
            self.host.send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        if self.host is None:
            return super().recv(tensor, src)
        return self.host.recv(tensor, src)


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
