"""The chip's memory: one fixed-capacity arena carved into granule-sized ranges.

The arena is a single byte buffer reserved when the device opens (the host's
operating system commits its pages only when they are first written, so a
4 GiB arena costs nothing until used). Its base address is aligned to 4 KiB
and every range handed out starts at a multiple of the 2 MiB granularity from
that base, so alignment and granularity are properties of real addresses:
``tensor.data_ptr() - arena.base_ptr`` is a multiple of the granularity.

Free space is a sorted list of ``(offset, size)`` ranges; a reservation takes
the best-fitting range, a release merges with its neighbours. When no range
is large enough the arena raises :class:`DeviceOutOfMemoryError` with the
requested, free and total bytes, and the largest contiguous free range.
"""

from __future__ import annotations

import bisect
import threading

import torch

from kunlun_infer.errors import DeviceOutOfMemoryError

from kunlun_infer_simchip.config import ALIGNMENT, GRANULARITY, MIB


def format_bytes(nbytes: int) -> str:
    """``nbytes`` in MiB with the exact count, for error messages."""
    return f"{nbytes / MIB:.1f} MiB ({nbytes} bytes)"


class Arena:
    """A fixed-capacity, granule-granular range allocator over one real byte buffer.

    Thread-safe. ``reserve`` returns an offset; ``view`` gives the bytes at an
    offset as a ``uint8`` tensor sharing the arena's storage.
    """

    def __init__(self, capacity: int, *, alignment: int = ALIGNMENT, granularity: int = GRANULARITY) -> None:
        if capacity < granularity or capacity % granularity:
            raise ValueError(f"arena capacity {capacity} must be a positive multiple of {granularity}")
        if granularity % alignment:
            raise ValueError(f"granularity {granularity} must be a multiple of alignment {alignment}")
        self.capacity = capacity
        self.alignment = alignment
        self.granularity = granularity
        # over-reserve by one alignment unit so the arena can start on an aligned address
        self._buffer = torch.empty(capacity + alignment, dtype=torch.uint8)
        skip = -self._buffer.data_ptr() % alignment
        self._memory = self._buffer[skip: skip + capacity]
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted by offset, never adjacent
        self._used: dict[int, int] = {}  # offset -> size

    @property
    def base_ptr(self) -> int:
        """Address of the arena's first byte (a multiple of ``alignment``)."""
        return self._memory.data_ptr()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self.capacity - sum(self._used.values())

    @property
    def largest_free(self) -> int:
        """Size of the largest contiguous free range."""
        with self._lock:
            return max((size for _, size in self._free), default=0)

    def round_up(self, nbytes: int) -> int:
        """Bytes a request of ``nbytes`` occupies: whole granules, at least one."""
        g = self.granularity
        return max(g, -(-nbytes // g) * g)

    def reserve(self, nbytes: int) -> int:
        """Offset of a fresh range of ``round_up(nbytes)`` bytes; raises when none fits."""
        size = self.round_up(nbytes)
        with self._lock:
            fits = [(rsize, i) for i, (_, rsize) in enumerate(self._free) if rsize >= size]
            if not fits:
                raise self._out_of_memory(nbytes, size)
            _, index = min(fits)
            offset, rsize = self._free[index]
            if rsize == size:
                del self._free[index]
            else:
                self._free[index] = (offset + size, rsize - size)
            self._used[offset] = size
            return offset

    def out_of_memory(self, nbytes: int) -> DeviceOutOfMemoryError:
        """The error for a request of ``nbytes`` that cannot be satisfied now, with the numbers."""
        with self._lock:
            return self._out_of_memory(nbytes, self.round_up(nbytes))

    def _out_of_memory(self, nbytes: int, size: int) -> DeviceOutOfMemoryError:
        free = self.capacity - sum(self._used.values())
        largest = max((s for _, s in self._free), default=0)
        return DeviceOutOfMemoryError(
            f"simchip out of memory: requested {format_bytes(nbytes)}, which takes {format_bytes(size)} "
            f"in {self.granularity // MIB} MiB granules; free {format_bytes(free)} of capacity "
            f"{format_bytes(self.capacity)}, largest contiguous free range {format_bytes(largest)}. "
            f"Raise device.capacity, or lower cache.num_blocks, cache.memory_fraction or "
            f"scheduler.max_num_seqs.", requested=nbytes, free=free, capacity=self.capacity)

    def release(self, offset: int) -> None:
        """Give the range at ``offset`` back, merging it with free neighbours."""
        with self._lock:
            size = self._used.pop(offset, None)
            if size is None:
                raise ValueError(f"no simchip arena range starts at offset {offset} (double free?)")
            index = bisect.bisect_left(self._free, (offset, 0))
            if index < len(self._free) and self._free[index][0] == offset + size:  # merge right
                size += self._free.pop(index)[1]
            if index > 0 and sum(self._free[index - 1]) == offset:  # merge left
                offset = self._free[index - 1][0]
                size += self._free.pop(index - 1)[1]
                index -= 1
            self._free.insert(index, (offset, size))

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` bytes at ``offset`` as a ``uint8`` tensor sharing the arena's storage."""
        return self._memory[offset: offset + nbytes]

    def size_of(self, offset: int) -> int:
        """Bytes of the live range starting at ``offset``."""
        with self._lock:
            return self._used[offset]

    def free_ranges(self) -> list[tuple[int, int]]:
        """A copy of the free list, ``(offset, size)`` sorted by offset."""
        with self._lock:
            return list(self._free)
