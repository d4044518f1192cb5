"""``comm=nccl``: collectives on a private NCCL process group.

The collective logic is the framework's
:class:`~kunlun_infer.plugins.process_group.ProcessGroupComm` (private group
from a rendezvous store, low-precision all-reduce widened to
``comm.accumulate_dtype``). This class says only what NCCL changes: which
process group :meth:`DistComm.new_group` builds, and that control tensors live
on the device (a subclass replaces ``new_group``; the tests exercise the
collective logic on gloo).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from kunlun_infer.plugins.process_group import ProcessGroupComm, parse_dtype

__all__ = ["DistComm", "parse_dtype"]


class DistComm(ProcessGroupComm):
    """Collectives on a private torch.distributed process group of ``backend``."""

    name = "nccl"
    backend = "nccl"

    def __init__(self, *, device: Any, accumulate_dtype: torch.dtype | None = torch.float32) -> None:
        super().__init__(accumulate_dtype=accumulate_dtype)
        self.device = device

    def new_group(self, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
        """The process group for this backend (NCCL here)."""
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)

    @property
    def control_device(self) -> torch.device:
        return self.device.torch_device

    def barrier(self) -> None:
        super().barrier()
        self.device.synchronize()  # device collectives complete asynchronously; the host waits for them here
