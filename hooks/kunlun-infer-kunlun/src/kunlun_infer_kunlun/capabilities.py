"""Memory and streams for ``device=kunlun``: the CUDA-API classes under Kunlun's names.

The xpytorch build serves torch's CUDA API (caching allocator, streams,
events) from the XPU, so the classes of ``kunlun_infer_cuda`` do the work.
``ops=kunlun`` has its own module, :mod:`kunlun_infer_kunlun.ops`, and
``comm=bkcl`` its own, :mod:`kunlun_infer_kunlun.comm`.
"""

from __future__ import annotations

from kunlun_infer_cuda.memory import CudaCachingAllocator
from kunlun_infer_cuda.streams import CudaStreams
from kunlun_infer_kunlun.config import DEVICE


class KunlunAllocator(CudaCachingAllocator):
    """The vendor stack's caching allocator, reached through torch's CUDA memory API."""

    name = DEVICE


class KunlunStreams(CudaStreams):
    """XPU streams and events through torch's CUDA stream API."""

    name = DEVICE
