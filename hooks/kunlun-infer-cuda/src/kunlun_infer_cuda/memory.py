"""``memory=cuda``: torch's CUDA caching allocator, with its statistics.

``allocate`` is ``torch.empty`` on the device, so blocks come from (and go
back to) torch's caching allocator, which rounds requests to 512 bytes and
keeps freed blocks for reuse. ``free`` releases a tensor's storage at once
(``untyped_storage().resize_(0)``) instead of waiting for the last Python
reference to go. Statistics are the allocator's own for this device
(``memory_allocated``, ``memory_reserved``, ``max_memory_allocated``), so
they include tensors made outside this plugin (weights, activations).
An out-of-memory condition becomes :class:`DeviceOutOfMemoryError` with the
requested bytes and the device's free and total bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kunlun_infer.capabilities import MemoryAllocator, MemoryStats
from kunlun_infer.errors import DeviceOutOfMemoryError


class CudaCachingAllocator(MemoryAllocator):
    """Allocates through torch's caching allocator on ``device`` (a :class:`CudaDevice`)."""

    name = "cuda"
    #: the caching allocator's block size: every block starts and ends on 512 bytes
    alignment = 512
    granularity = 512

    def __init__(self, device: Any) -> None:
        self.device = device
        self.api = getattr(device, "api", torch.cuda)
        self._num_allocs = 0

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(int(d) for d in shape)
        try:
            tensor = self.empty(shape, dtype)
        except torch.OutOfMemoryError as exc:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            free, total = self.device.mem_get_info()
            raise DeviceOutOfMemoryError(
                f"{self.device.name} device {self.device.index} out of memory: requested {nbytes} bytes, "
                f"{free} free of {total}; torch holds {self.api.memory_reserved(self.device.index)} reserved. "
                f"Lower cache.memory_fraction or cache.num_blocks, or free other processes' memory "
                f"({exc.__class__.__name__}: {str(exc).splitlines()[0]})",
                requested=nbytes, free=free, capacity=total) from exc
        self._num_allocs += 1
        return tensor

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor from torch's caching allocator."""
        return torch.empty(shape, dtype=dtype, device=self.device.torch_device)

    def free(self, tensor: torch.Tensor) -> None:
        tensor.untyped_storage().resize_(0)  # back to the caching allocator now, not at garbage collection

    def stats(self) -> MemoryStats:
        index = self.device.index
        allocated = int(self.api.memory_allocated(index))
        reserved = int(self.api.memory_reserved(index))
        counters = self.api.memory_stats(index)
        block_allocs = int(counters.get("allocation.all.allocated", 0))
        segment_allocs = int(counters.get("segment.all.allocated", 0))
        return MemoryStats(allocated=allocated, reserved=reserved, peak=int(self.api.max_memory_allocated(index)),
                           fragmentation=(1.0 - allocated / reserved) if reserved else 0.0,
                           num_allocs=self._num_allocs,
                           num_cache_hits=max(0, block_allocs - segment_allocs))

    def empty_cache(self) -> None:
        self.api.empty_cache()

    def reset_peak(self) -> None:
        self.api.reset_peak_memory_stats(self.device.index)
