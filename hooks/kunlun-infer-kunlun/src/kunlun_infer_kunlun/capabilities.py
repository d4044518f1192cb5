"""Memory, streams and comm for ``device=kunlun``: the CUDA-API classes under Kunlun's names.

``torch_xmlir`` serves torch's CUDA API (caching allocator, streams, events)
from the XPU and maps torch.distributed's NCCL backend onto BKCL/XCCL, so the
classes of ``kunlun_infer_cuda`` do the work (``ops=kunlun`` has its own
module, :mod:`kunlun_infer_kunlun.ops`). ``comm=bkcl`` adds one step:
the collective library's tuning variables are exported before the process
group is created.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

from kunlun_infer.config import COMM_TIMEOUT_S
from kunlun_infer_cuda.comm import DistComm
from kunlun_infer_cuda.memory import CudaCachingAllocator
from kunlun_infer_cuda.streams import CudaStreams
from kunlun_infer_kunlun.config import COMM, DEVICE
from kunlun_infer_kunlun.tuning import export_tuning


class KunlunAllocator(CudaCachingAllocator):
    """The vendor stack's caching allocator, reached through torch's CUDA memory API."""

    name = DEVICE


class KunlunStreams(CudaStreams):
    """XPU streams and events through torch's CUDA stream API."""

    name = DEVICE


class BkclComm(DistComm):
    """A private process group on the stack's NCCL backend (BKCL/XCCL underneath), tuned from config."""

    name = COMM

    def __init__(self, *, tuning: dict[str, str], environ: MutableMapping[str, str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tuning = tuning
        self.environ = os.environ if environ is None else environ

    def init(self, *, rank: int, world_size: int, init_method: str | None = None, timeout_s: float = COMM_TIMEOUT_S) -> None:
        export_tuning(self.tuning, self.environ)  # read by the library when the communicator is created
        super().init(rank=rank, world_size=world_size, init_method=init_method, timeout_s=timeout_s)
