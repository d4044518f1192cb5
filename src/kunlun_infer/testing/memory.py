"""Conformance of a memory allocator: alignment, granularity, stats, reuse, empty_cache, OOM."""

from __future__ import annotations

from typing import Any

import torch

from kunlun_infer.errors import DeviceOutOfMemoryError
from kunlun_infer.testing.compare import ConformanceError

SHAPES: tuple[tuple[tuple[int, ...], torch.dtype], ...] = (
    ((1,), torch.float32), ((3, 5), torch.float32), ((7, 33), torch.bfloat16), ((2, 64, 8), torch.float16),
    ((1000,), torch.int64), ((4096,), torch.uint8),
)


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise ConformanceError(message)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def check_allocations(memory: Any) -> None:
    """Alignment, granularity, usable contents and allocated/peak bookkeeping."""
    base = memory.stats()
    live = []
    expected = base.allocated
    for shape, dtype in SHAPES:
        t = memory.allocate(shape, dtype)
        _expect(tuple(t.shape) == shape and t.dtype == dtype, f"memory: allocate({shape}, {dtype}) gave "
                f"{tuple(t.shape)} {t.dtype}")
        _expect(t.data_ptr() % memory.alignment == 0, f"memory: allocate({shape}, {dtype}) start address is not "
                f"a multiple of alignment={memory.alignment}")
        t.fill_(3)
        _expect(bool((t == 3).all()),
                f"memory: a tensor from allocate({shape}, {dtype}) does not hold what was written")
        rounded = memory.round_size(_nbytes(shape, dtype))
        _expect(rounded % memory.granularity == 0 and rounded >= _nbytes(shape, dtype),
                f"memory: round_size gave {rounded}, not a multiple of granularity={memory.granularity}")
        expected += rounded
        live.append(t)
        stats = memory.stats()
        _expect(stats.allocated == expected, f"memory: stats().allocated={stats.allocated} after allocate({shape}, "
                f"{dtype}), expected {expected} (sizes rounded to the granularity)")
        _expect(stats.reserved >= stats.allocated, f"memory: reserved {stats.reserved} < allocated {stats.allocated}")
        _expect(stats.peak >= stats.allocated, f"memory: peak {stats.peak} < allocated {stats.allocated}")
        _expect(0.0 <= stats.fragmentation <= 1.0, f"memory: fragmentation {stats.fragmentation} outside 0..1")
    peak = memory.stats().peak
    for t in live:
        memory.free(t)
    stats = memory.stats()
    _expect(stats.allocated == base.allocated, f"memory: allocated={stats.allocated} after freeing everything, "
            f"expected {base.allocated}")
    _expect(stats.peak == peak, f"memory: peak fell from {peak} to {stats.peak} on free")
    memory.reset_peak()
    _expect(memory.stats().peak == stats.allocated, "memory: reset_peak() must restart peak from allocated")


def check_reuse_and_empty_cache(memory: Any) -> None:
    """A caching allocator hands a freed block out again; ``empty_cache`` returns cached blocks."""
    shape, dtype = (256, 16), torch.float32
    first = memory.allocate(shape, dtype)
    memory.free(first)
    after_free = memory.stats()
    if after_free.reserved > after_free.allocated:  # the block was cached: it must be reused
        again = memory.allocate(shape, dtype)
        stats = memory.stats()
        _expect(stats.reserved == after_free.reserved, f"memory: a cached block of the same size was not reused "
                f"(reserved grew from {after_free.reserved} to {stats.reserved})")
        memory.free(again)
    memory.empty_cache()
    stats = memory.stats()
    _expect(stats.reserved == stats.allocated, f"memory: after empty_cache() reserved={stats.reserved} but only "
            f"{stats.allocated} is live")


def check_out_of_memory(memory: Any, device: Any) -> None:
    """A request beyond the device's memory raises DeviceOutOfMemoryError carrying the numbers."""
    _, total = device.mem_get_info()
    try:
        t = memory.allocate((total * 2,), torch.uint8)
    except DeviceOutOfMemoryError as exc:
        _expect(exc.requested >= total * 2, f"memory: DeviceOutOfMemoryError.requested={exc.requested}, asked "
                f"{total * 2}")
        return
    memory.free(t)
    raise ConformanceError(f"memory: allocating {total * 2} bytes (twice the device's {total}) did not raise "
                           f"DeviceOutOfMemoryError")


def check_memory(memory: Any, device: Any) -> None:
    """Every memory check."""
    check_allocations(memory)
    check_reuse_and_empty_cache(memory)
    check_out_of_memory(memory, device)
