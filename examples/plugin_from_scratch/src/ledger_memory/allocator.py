"""The allocator itself: a :class:`kunlun_infer.capabilities.MemoryAllocator` with a budget and a ledger."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kunlun_infer.capabilities import MemoryAllocator, MemoryStats
from kunlun_infer.errors import DeviceOutOfMemoryError, PluginError


class LedgerAllocator(MemoryAllocator):
    """Every allocation is 256-byte aligned, rounded to 256 bytes, and counted against a budget."""

    name = "ledger"
    alignment = 256
    granularity = 256

    def __init__(self, device, limit: int | None = None) -> None:
        self.device = device
        self.limit = limit
        self._live: dict[int, int] = {}  # data_ptr -> bytes charged
        self._allocated = 0
        self._peak = 0
        self._num_allocs = 0

    def _budget(self) -> int:
        """Bytes this allocator may still hand out: the limit if set, else the device's free memory."""
        if self.limit is not None:
            return self.limit - self._allocated
        return self.device.mem_get_info()[0]

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(int(d) for d in shape) * torch.empty((), dtype=dtype).element_size()
        self._num_allocs += 1
        if nbytes == 0:  # nothing to charge, and an empty tensor has no address to track
            return torch.empty(tuple(shape), dtype=dtype, device=self.device.torch_device)
        charged = self.round_size(nbytes)
        budget = self._budget()
        if charged > budget:
            raise DeviceOutOfMemoryError(
                f"memory=ledger: {nbytes} bytes requested ({charged} charged), {max(budget, 0)} left of "
                f"{'memory.limit=' + str(self.limit) if self.limit is not None else 'the device'}; "
                f"raise memory.limit or lower cache.num_blocks", requested=nbytes, free=max(budget, 0),
                capacity=self.limit if self.limit is not None else self.device.mem_get_info()[1])
        # over-allocate by one alignment unit and start the tensor on an aligned address
        raw = torch.empty(charged + self.alignment, dtype=torch.uint8, device=self.device.torch_device)
        skip = -raw.data_ptr() % self.alignment
        tensor = raw[skip: skip + nbytes].view(dtype).view(tuple(shape))
        self._live[tensor.data_ptr()] = charged
        self._allocated += charged
        self._peak = max(self._peak, self._allocated)
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        if tensor.numel() == 0:
            return
        charged = self._live.pop(tensor.data_ptr(), None)
        if charged is None:
            raise PluginError("memory=ledger: free() of a tensor it did not allocate (or freed twice)",
                              plugin="ledger", hook="MemoryAllocator.free")
        self._allocated -= charged

    def stats(self) -> MemoryStats:
        # nothing is cached: what is reserved is exactly what is live
        return MemoryStats(allocated=self._allocated, reserved=self._allocated, peak=self._peak,
                           fragmentation=0.0, num_allocs=self._num_allocs)

    def reset_peak(self) -> None:
        self._peak = self._allocated

    def ledger(self) -> list[int]:
        """Bytes charged for each live allocation, largest first."""
        return sorted(self._live.values(), reverse=True)
