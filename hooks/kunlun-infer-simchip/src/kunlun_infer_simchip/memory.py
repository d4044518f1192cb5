"""``memory=simchip``: a caching allocator over the simchip arena.

Every tensor is a view of an arena range, so its address is 4 KiB-aligned and
its footprint whole 2 MiB granules. Freed ranges are kept in buckets by size
and handed out again to requests of the same rounded size; when the arena
cannot satisfy a request the cache is emptied and the request retried once
before :class:`DeviceOutOfMemoryError` (with the numbers) reaches the caller.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kunlun_infer.capabilities import MemoryAllocator, MemoryStats
from kunlun_infer.errors import DeviceOutOfMemoryError, PluginError

from kunlun_infer_simchip import CHIP_NAME
from kunlun_infer_simchip.arena import Arena
from kunlun_infer_simchip.config import ALIGNMENT, GRANULARITY
from kunlun_infer_simchip.device import SimchipDevice


class SimchipAllocator(MemoryAllocator):
    """Hands out arena-backed tensors; keeps freed ranges for reuse."""

    name = CHIP_NAME
    alignment = ALIGNMENT
    granularity = GRANULARITY

    def __init__(self, device: SimchipDevice) -> None:
        if not isinstance(device, SimchipDevice):
            raise PluginError(
                f"memory={CHIP_NAME} allocates from the simchip arena and needs device={CHIP_NAME}, got "
                f"device={getattr(device, 'name', type(device).__name__)}; choose memory=caching for that device",
                plugin=CHIP_NAME, hook="kunlun_infer_memory_factories")
        self.device = device
        self._live: dict[int, int] = {}  # data_ptr -> arena offset
        self._cached: dict[int, list[int]] = {}  # rounded size -> arena offsets
        self._allocated = 0
        self._reserved = 0
        self._peak = 0
        self._num_allocs = 0
        self._num_cache_hits = 0
        self._arena_in_use = None

    def _arena(self) -> Arena:
        """The device's arena; bookkeeping of an earlier arena (device closed and reopened) is dropped."""
        arena = self.device.arena
        if arena is not self._arena_in_use:
            self._live.clear()
            self._cached.clear()
            self._allocated = self._reserved = 0
            self._arena_in_use = arena
        return arena

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self._num_allocs += 1
        if nbytes == 0:  # an empty tensor has no address to hand out; it takes no arena memory
            return torch.empty(shape, dtype=dtype)
        arena = self._arena()
        size = self.round_size(nbytes)
        offset = self._take_cached(size)
        if offset is None:
            offset = self._reserve(nbytes, size)
        tensor = arena.view(offset, nbytes).view(dtype).view(shape)
        self._live[tensor.data_ptr()] = offset
        self._allocated += size
        self._peak = max(self._peak, self._allocated)
        return tensor

    def _take_cached(self, size: int) -> int | None:
        bucket = self._cached.get(size)
        if not bucket:
            return None
        self._num_cache_hits += 1
        return bucket.pop()

    def _reserve(self, nbytes: int, size: int) -> int:
        arena = self._arena()
        try:
            offset = arena.reserve(size)
        except DeviceOutOfMemoryError:
            if not any(self._cached.values()):
                raise arena.out_of_memory(nbytes) from None
            self.empty_cache()  # cached ranges of other sizes may make room
            try:
                offset = arena.reserve(size)
            except DeviceOutOfMemoryError:
                raise arena.out_of_memory(nbytes) from None
        self._reserved += size
        return offset

    def free(self, tensor: torch.Tensor) -> None:
        if tensor.numel() == 0:
            return
        key = tensor.data_ptr()
        offset = self._live.pop(key, None)
        if offset is None:
            raise PluginError(f"memory={CHIP_NAME}: free() of a tensor it did not allocate, or freed twice "
                              f"(address {key:#x})", plugin=CHIP_NAME, hook="MemoryAllocator.free")
        size = self._arena().size_of(offset)
        self._allocated -= size
        self._cached.setdefault(size, []).append(offset)

    def empty_cache(self) -> None:
        arena = self._arena()
        for size, offsets in self._cached.items():
            for offset in offsets:
                arena.release(offset)
                self._reserved -= size
        self._cached.clear()

    def reset_peak(self) -> None:
        self._peak = self._allocated

    def stats(self) -> MemoryStats:
        reserved = self._reserved
        return MemoryStats(allocated=self._allocated, reserved=reserved, peak=self._peak,
                           fragmentation=(1.0 - self._allocated / reserved) if reserved else 0.0,
                           num_allocs=self._num_allocs, num_cache_hits=self._num_cache_hits)
