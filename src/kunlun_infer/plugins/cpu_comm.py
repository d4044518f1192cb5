"""Built-in comm plugins: ``single`` (one process) and ``gloo`` (torch.distributed on CPU).

``gloo`` builds a *private* gloo process group from a rendezvous store
(``tcp://``, ``env://`` or ``file://``): it never creates torch.distributed's
default group, so an application's own use of torch.distributed is left alone.
Low-precision all-reduce is carried out in ``accumulate_dtype`` (float32 by
default) and cast back, so partial sums of bf16/fp16 shards do not lose bits.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

from kunlun_infer import __version__
from kunlun_infer.capabilities import Comm, Device
from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.plugins.cpu_device import stack_versions

PLUGIN_NAME = "cpu-comm"
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def parse_dtype(name: str | None) -> torch.dtype | None:
    """``"float32"`` → ``torch.float32``; ``None``/``"none"`` → ``None``."""
    if name is None or str(name).lower() in ("", "none", "null"):
        return None
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"comm.accumulate_dtype={name!r} is not a torch dtype (e.g. float32)")
    return dtype


class _CommBase(Comm):
    def __init__(self, *, accumulate_dtype: torch.dtype | None = torch.float32) -> None:
        self.default_accumulate_dtype = accumulate_dtype

    def _accumulate_dtype(self, tensor: torch.Tensor, requested: torch.dtype | None) -> torch.dtype | None:
        dtype = requested if requested is not None else (
            self.default_accumulate_dtype if tensor.dtype in _LOW_PRECISION else None)
        if dtype is None or not tensor.is_floating_point() or not dtype.is_floating_point:
            return None
        if torch.finfo(dtype).bits <= torch.finfo(tensor.dtype).bits:
            return None  # only ever widen
        return dtype


class SingleComm(_CommBase):
    """World size 1: every collective returns its input."""

    name = "single"

    def init(self, *, rank: int, world_size: int, init_method: str | None = None, timeout_s: float = 300.0) -> None:
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


class GlooComm(_CommBase):
    """Collectives on a private gloo process group."""

    name = "gloo"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._group: Any = None
        self._store: Any = None

    def init(self, *, rank: int, world_size: int, init_method: str | None = None, timeout_s: float = 300.0) -> None:
        if self._group is not None:
            raise RuntimeError("gloo comm is already initialised; destroy() it first")
        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world_size = next(dist.rendezvous(init_method or "env://", rank, world_size, timeout=timeout))
        self._store = dist.PrefixStore("kunlun_infer/", store)
        self._group = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)
        self.rank, self.world_size = rank, world_size

    @property
    def group(self) -> Any:
        if self._group is None:
            raise RuntimeError("gloo comm used before init(rank=, world_size=, init_method=)")
        return self._group

    def all_reduce(self, tensor: torch.Tensor, accumulate_dtype: torch.dtype | None = None) -> torch.Tensor:
        wide = self._accumulate_dtype(tensor, accumulate_dtype)
        work = tensor.to(wide) if wide is not None else tensor
        if not work.is_contiguous():
            work = work.contiguous()
        self.group.allreduce([work]).wait()
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.group.allgather([parts], [tensor]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([work], options).wait()
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        payload = pickle.dumps(obj) if self.rank == src else b""
        size = self.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        if self.rank == src:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.broadcast(data, src)
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())  # noqa: S301 - peers only

    def barrier(self) -> None:
        self.group.barrier().wait()

    def destroy(self) -> None:
        self._group = None
        self._store = None


def _accumulate(config: Any) -> torch.dtype | None:
    return parse_dtype(config.get("accumulate_dtype", "float32") if config is not None else "float32")


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
