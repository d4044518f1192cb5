"""``comm=nccl``: collectives on a private NCCL process group.

The group is built from a rendezvous store (``tcp://``, ``env://``,
``file://``) and never becomes torch.distributed's default group, so an
application's own use of torch.distributed is left alone. Low-precision
all-reduce runs in ``accumulate_dtype`` (``comm.accumulate_dtype``, float32 by
default) and is cast back, so bf16/fp16 partial sums do not lose bits.

The class is written against torch's process-group API, not NCCL itself:
:meth:`DistComm.new_group` is the one place that names a backend, which a
subclass replaces (the tests exercise the collective logic on gloo).
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

from kunlun_infer.capabilities import Comm

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def parse_dtype(name: Any) -> torch.dtype | None:
    """``"float32"`` → ``torch.float32``; ``None``/``"none"`` → ``None``."""
    if name is None or str(name).lower() in ("", "none", "null"):
        return None
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"comm.accumulate_dtype={name!r} is not a floating torch dtype (e.g. float32)")
    return dtype


class DistComm(Comm):
    """Collectives on a private torch.distributed process group of ``backend``."""

    name = "nccl"
    backend = "nccl"

    def __init__(self, *, device: Any, accumulate_dtype: torch.dtype | None = torch.float32) -> None:
        self.device = device
        self.default_accumulate_dtype = accumulate_dtype
        self._group: Any = None

    # ------------------------------------------------------------------ group

    def new_group(self, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
        """The process group for this backend (NCCL here)."""
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)

    def init(self, *, rank: int, world_size: int, init_method: str | None = None, timeout_s: float = 300.0) -> None:
        if self._group is not None:
            raise RuntimeError(f"comm={self.name} is already initialised; destroy() it first")
        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world_size = next(dist.rendezvous(init_method or "env://", rank, world_size, timeout=timeout))
        self._group = self.new_group(dist.PrefixStore(f"kunlun_infer/{self.name}/", store), rank, world_size,
                                     timeout)
        self.rank, self.world_size = rank, world_size

    @property
    def group(self) -> Any:
        if self._group is None:
            raise RuntimeError(f"comm={self.name} used before init(rank=, world_size=, init_method=)")
        return self._group

    def destroy(self) -> None:
        group, self._group = self._group, None
        shutdown = getattr(group, "shutdown", None)
        if callable(shutdown):
            shutdown()

    # ------------------------------------------------------------------ collectives

    def accumulate_dtype_for(self, tensor: torch.Tensor, requested: torch.dtype | None) -> torch.dtype | None:
        """The wider dtype to reduce ``tensor`` in, or None to reduce as is (only ever widens)."""
        dtype = requested if requested is not None else (
            self.default_accumulate_dtype if tensor.dtype in _LOW_PRECISION else None)
        if dtype is None or not tensor.is_floating_point() or not dtype.is_floating_point:
            return None
        if torch.finfo(dtype).bits <= torch.finfo(tensor.dtype).bits:
            return None
        return dtype

    def all_reduce(self, tensor: torch.Tensor, accumulate_dtype: torch.dtype | None = None) -> torch.Tensor:
        wide = self.accumulate_dtype_for(tensor, accumulate_dtype)
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
        where = self.device.torch_device
        payload = pickle.dumps(obj) if self.rank == src else b""
        size = self.broadcast(torch.tensor([len(payload)], dtype=torch.int64, device=where), src)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=where)
        if self.rank == src:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.broadcast(data, src)
        return obj if self.rank == src else pickle.loads(data.cpu().numpy().tobytes())  # noqa: S301 - peers only

    def barrier(self) -> None:
        # a one-element all-reduce is a barrier every backend implements on device tensors
        self.all_reduce(torch.zeros(1, device=self.device.torch_device))
        self.device.synchronize()
