"""``comm=bkcl``: collectives through BKCL/XCCL, reached the way the vendor stack expects.

The xpytorch build rewrites torch.distributed's ``nccl`` backend onto the
XPU's collective library. That rewrite is met by asking torch.distributed for
a group by backend name — ``torch.distributed.new_group(backend="nccl")``, as
vLLM-Kunlun and sglang-kunlun do — and missed by constructing
``ProcessGroupNCCL`` by hand. ``new_group`` needs a default group: when the
process has none, one is made on gloo (host only, cheap) from this comm's
rendezvous store and released with the comm; when the application already
has one, it must span exactly this comm's ranks (the group is created over
them, which every rank of the default group must join).

Before the group is created the tuning variables are exported (``BKCL_*``
and ``TORCH_NCCL_AVOID_RECORD_STREAMS=1``); after it, a one-element
all-reduce warms the communicator up — the library creates it lazily — and
checks that every rank took part, so a broken fabric fails ``init`` rather
than the first decode step. Low-precision all-reduce accumulates in
``comm.accumulate_dtype`` (float32 by default; the README says what that costs).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import MutableMapping
from typing import Any

import torch
import torch.distributed

from kunlun_infer.config import COMM_TIMEOUT_S
from kunlun_infer.errors import PluginError

from kunlun_infer_cuda.comm import DistComm
from kunlun_infer_kunlun.config import COMM
from kunlun_infer_kunlun.tuning import export_tuning


class BkclComm(DistComm):
    """A process group of the stack's ``nccl`` backend (BKCL/XCCL underneath), tuned from config."""

    name = COMM
    #: the backend name the vendor stack serves its collective library under
    group_backend = "nccl"
    #: the backend of a default group this comm has to create (host-side; only a parent for new_group)
    default_backend = "gloo"

    def __init__(self, *, tuning: dict[str, str], environ: MutableMapping[str, str] | None = None,
                 dist_api: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tuning = tuning
        self.environ = os.environ if environ is None else environ
        self.dist = torch.distributed if dist_api is None else dist_api
        self._owns_default_group = False

    def init(self, *, rank: int, world_size: int, init_method: str | None = None,
             timeout_s: float = COMM_TIMEOUT_S) -> None:
        export_tuning(self.tuning, self.environ)  # read when the communicator and the process group are created
        super().init(rank=rank, world_size=world_size, init_method=init_method, timeout_s=timeout_s)
        try:
            self.warm_up()
        except BaseException:
            self.destroy()
            raise

    def new_group(self, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
        dist = self.dist
        if not dist.is_initialized():
            dist.init_process_group(backend=self.default_backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
            self._owns_default_group = True
        elif (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise PluginError(
                f"comm={self.name}: this process already belongs to a torch.distributed world of "
                f"{dist.get_world_size()} rank(s) (rank {dist.get_rank()}), but the engine asked for rank {rank} "
                f"of {world_size}; run the engine over the same ranks as the application's world, or in processes "
                f"without one", plugin=self.name, hook="Comm.init", layer="plugin")
        try:
            return dist.new_group(ranks=list(range(world_size)), backend=self.group_backend, timeout=timeout)
        except BaseException:
            self._release_default_group()
            raise

    def new_subgroup(self, ranks: tuple[int, ...], store: Any, timeout: datetime.timedelta) -> Any:
        """A pipeline stage's group, by backend name like the whole one; only its ranks take part."""
        self._owns_default_group = False  # this copy becomes the subgroup's comm: the default group is not its
        return self.dist.new_group(ranks=list(ranks), backend=self.group_backend, timeout=timeout,
                                   use_local_synchronization=True)

    def warm_up(self) -> None:
        """One all-reduce of ones: creates the communicator now and checks that all ranks answered."""
        probe = torch.ones(1, dtype=torch.float32, device=self.control_device)
        self.complete(self.group.allreduce([probe]), probe)
        self.device.synchronize()
        got = float(probe.item())
        if got != float(self.world_size):
            raise PluginError(
                f"comm={self.name}: the warm-up all-reduce of ones over {self.world_size} rank(s) gave {got:g}; "
                f"the collective library did not reach every rank (check BKCL_SOCKET_IFNAME / comm.socket_ifname, "
                f"the RDMA NICs, and that every rank sees its own XPU)", plugin=self.name, hook="Comm.init",
                layer="hardware")

    def release_group(self, group: Any) -> None:
        try:
            self.dist.destroy_process_group(group)
        finally:
            self._release_default_group()

    def _release_default_group(self) -> None:
        if self._owns_default_group:
            self._owns_default_group = False
            self.dist.destroy_process_group()
