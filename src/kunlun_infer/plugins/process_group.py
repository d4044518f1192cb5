"""``ProcessGroupComm``: the Comm base for every plugin whose collectives run on a torch.distributed process group.

The group is *private*: it is built from a rendezvous store (``tcp://``,
``env://``, ``file://``) and never becomes torch.distributed's default group,
so an application's own use of torch.distributed is left alone.
Low-precision all-reduce runs in ``accumulate_dtype`` (``comm.accumulate_dtype``,
float32 by default) and is cast back, so bf16/fp16 partial sums do not lose bits.

The built-in ``gloo`` comm is this class on a gloo group. A vendor plugin
subclasses it and overrides only what its backend changes:

- :meth:`ProcessGroupComm.new_group` — which process group to build (the backend);
- :attr:`ProcessGroupComm.control_device` — where the small control tensors of
  :meth:`~ProcessGroupComm.broadcast_object` and :meth:`~ProcessGroupComm.barrier`
  live (the host by default; a device backend wants its device);

and, where the backend needs it, :meth:`ProcessGroupComm.release_group` and
:meth:`ProcessGroupComm.new_subgroup` (the group of some ranks, hook API 1.4).
Point-to-point ``send``/``recv`` (hook API 1.4) are the process group's own.
"""

from __future__ import annotations

import collections
import copy
import datetime
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from kunlun_infer.capabilities import Comm
from kunlun_infer.config import COMM_TIMEOUT_S

LOW_PRECISION = (torch.bfloat16, torch.float16)

#: collectives whose tensors a comm keeps after they complete (see :meth:`ProcessGroupComm.complete`)
SETTLING_COLLECTIVES = 4


def parse_dtype(name: Any) -> torch.dtype | None:
    """``"float32"`` → ``torch.float32``; ``None``/``"none"`` → ``None``; anything not a floating dtype is refused."""
    if name is None or str(name).lower() in ("", "none", "null"):
        return None
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"comm.accumulate_dtype={name!r} is not a floating torch dtype (e.g. float32)")
    return dtype


class ProcessGroupComm(Comm):
    """Collectives on a private torch.distributed process group; subclasses choose the backend."""

    name = "process-group"

    def __init__(self, *, accumulate_dtype: torch.dtype | None = torch.float32) -> None:
        self.default_accumulate_dtype = accumulate_dtype
        self._group: Any = None
        self._store: Any = None
        self._timeout = datetime.timedelta(seconds=COMM_TIMEOUT_S)
        #: the comms of this group's subgroups, destroyed with it
        self._subgroups: list[ProcessGroupComm] = []
        #: this group's ranks in the group it was split from (``None`` for a group of its own)
        self.parent_ranks: tuple[int, ...] | None = None
        self._settling: collections.deque[tuple[torch.Tensor, ...]] = collections.deque(maxlen=SETTLING_COLLECTIVES)

    # ------------------------------------------------------------------ what a backend overrides

    def new_group(self, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
        """The process group of this backend over ``store`` (already prefixed for this comm)."""
        raise NotImplementedError(f"{type(self).__name__} must say which process group to build (new_group)")

    @property
    def control_device(self) -> torch.device:
        """Where the small tensors this class makes itself (object sizes, payloads, barriers) live."""
        return torch.device("cpu")

    def release_group(self, group: Any) -> None:
        """Free the backend's resources held by ``group`` on :meth:`destroy`: its ``shutdown()``, where it has one."""
        shutdown = getattr(group, "shutdown", None)
        if callable(shutdown):
            shutdown()

    # ------------------------------------------------------------------ lifecycle

    def init(self, *, rank: int, world_size: int, init_method: str | None = None, timeout_s: float = COMM_TIMEOUT_S) -> None:
        if self._group is not None:
            raise RuntimeError(f"comm={self.name} is already initialised; destroy() it first")
        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world_size = next(dist.rendezvous(init_method or "env://", rank, world_size, timeout=timeout))
        self._store = dist.PrefixStore(f"kunlun_infer/{self.name}/", store)
        self._group = self.new_group(self._store, rank, world_size, timeout)
        self.rank, self.world_size, self._timeout = rank, world_size, timeout

    def subgroup(self, ranks: Sequence[int]) -> ProcessGroupComm:
        """A comm of the same backend over ``ranks``, on its own process group built from this group's store."""
        ranks = tuple(int(r) for r in ranks)
        if list(ranks) != sorted(set(ranks)) or not ranks or ranks[0] < 0 or ranks[-1] >= self.world_size \
                or self.rank not in ranks:
            raise ValueError(f"comm={self.name}: subgroup ranks {list(ranks)} must be ascending, distinct, within "
                             f"0..{self.world_size - 1} and include this rank ({self.rank})")
        sub = copy.copy(self)
        sub._subgroups = []
        sub._settling = collections.deque(maxlen=SETTLING_COLLECTIVES)
        sub._store = dist.PrefixStore(f"sub-{'-'.join(map(str, ranks))}/", self.store)
        sub._group = None
        sub._group = sub.new_subgroup(ranks, sub._store, self._timeout)
        sub.rank, sub.world_size, sub.parent_ranks = ranks.index(self.rank), len(ranks), ranks
        self._subgroups.append(sub)
        return sub

    def new_subgroup(self, ranks: tuple[int, ...], store: Any, timeout: datetime.timedelta) -> Any:
        """The process group over ``ranks`` of this group (``store``: prefixed for it); :meth:`new_group`'s
        by default. Called on a copy of this comm that becomes the subgroup's."""
        return self.new_group(store, ranks.index(self.rank), len(ranks), timeout)

    @property
    def store(self) -> Any:
        if self._store is None:
            raise RuntimeError(f"comm={self.name} used before init(rank=, world_size=, init_method=)")
        return self._store

    @property
    def group(self) -> Any:
        if self._group is None:
            raise RuntimeError(f"comm={self.name} used before init(rank=, world_size=, init_method=)")
        return self._group

    def destroy(self) -> None:
        subgroups, self._subgroups = self._subgroups, []
        for sub in subgroups:
            sub.destroy()
        group, self._group, self._store = self._group, None, None
        if group is not None:
            self.release_group(group)
        del group  # the process group goes first (usually its last reference), then the tensors kept for it
        self._settling.clear()

    def complete(self, work: Any, *tensors: torch.Tensor) -> None:
        """Wait for a collective's ``work``, and keep the tensors it was given for a few more collectives.

        A backend's worker thread lets go of a finished collective (and of its tensors) just after ``wait``
        returns. A tensor whose Python object is already gone by then makes that thread take the GIL to free
        it; if the process group is being destroyed at that moment, the destructor (torch < 2.8 holds the GIL
        through it) waits for the worker and the worker for the GIL, for ever. Kept here, those tensors are
        freed by whoever drops them last in Python, and :meth:`destroy` lets them go only after the group.
        """
        work.wait()
        self._settling.append(tensors)

    # ------------------------------------------------------------------ collectives

    def accumulate_dtype_for(self, tensor: torch.Tensor, requested: torch.dtype | None) -> torch.dtype | None:
        """The wider dtype to reduce ``tensor`` in, or None to reduce it as it is (only ever widens)."""
        dtype = requested if requested is not None else (
            self.default_accumulate_dtype if tensor.dtype in LOW_PRECISION else None)
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
        self.complete(self.group.allreduce([work]), work)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        tensor = tensor.contiguous()
        # the backend may fill the parts from its own thread, where torch 2.5 refuses writes to inference tensors
        with torch.inference_mode(False):
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.complete(self.group.allgather([parts], [tensor]), tensor, *parts)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, tensor: torch.Tensor, send_splits: Any, recv_splits: Any) -> torch.Tensor:
        # variable split sizes along dim 0; like all_gather, the output is made outside inference mode
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        with torch.inference_mode(False):
            out = work.new_empty((sum(recv_splits), *work.shape[1:]))
        self.complete(self.group.alltoall_base(out, work, list(recv_splits), list(send_splits), dist.AllToAllOptions()),
                      out, work)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.complete(self.group.broadcast([work], options), work)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        where = self.control_device
        payload = pickle.dumps(obj) if self.rank == src else b""
        size = self.broadcast(torch.tensor([len(payload)], dtype=torch.int64, device=where), src)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=where)
        if self.rank == src:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.broadcast(data, src)
        return obj if self.rank == src else pickle.loads(data.cpu().numpy().tobytes())  # noqa: S301 - peers only

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        work = tensor.contiguous()
        self.complete(self.group.send([work], dst, 0), work)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        with torch.inference_mode(False):  # the backend may write from its own thread (see all_gather)
            buffer = torch.empty_like(work) if work.is_inference() else work
        self.complete(self.group.recv([buffer], src, 0), buffer)
        if buffer is not tensor:
            tensor.copy_(buffer)
        return tensor

    def barrier(self) -> None:
        # a one-element all-reduce on a control tensor is a barrier every backend implements
        token = torch.zeros(1, device=self.control_device)
        self.complete(self.group.allreduce([token]), token)
