"""Built-in memory plugins for the CPU: ``caching`` (a pool) and ``simple`` (straight through).

Both hand out tensors viewed on uint8 blocks whose start is a multiple of
``alignment`` and whose size is a multiple of ``granularity``. ``caching``
keeps freed blocks in free lists bucketed by size and hands them out again;
``empty_cache`` gives them back. ``caching`` also has the C library keep the
memory torch's host tensors free (:func:`keep_freed_host_memory`), so that a
step's activations reuse the last step's pages; its ``empty_cache`` gives
that back too. It also keeps, between steps, the mappings of the largest
tensors the CPU ops make (:class:`LargeHostBlocks`). Blocks of 2 MiB or more
(a KV cache's) are mapped in huge pages where the system grants them
(:func:`host_buffer`). Requests larger than the memory the device reports
free raise :class:`DeviceOutOfMemoryError` with the numbers, instead of
leaving the process to the operating system's OOM killer.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import math
import mmap
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from kunlun_infer.version import __version__
from kunlun_infer.capabilities import Device, MemoryAllocator, MemoryStats
from kunlun_infer.errors import DeviceOutOfMemoryError
from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.plugins.cpu_device import stack_versions

log = logging.getLogger(__name__)

PLUGIN_NAME = "cpu-memory"
#: requests at least this large are checked against the device's free memory first
_CHECK_FREE_FROM = 64 << 20
#: a transparent huge page on x86-64 Linux
HUGE_PAGE = 2 << 20


def host_buffer(nbytes: int) -> torch.Tensor:
    """An empty uint8 host tensor of ``nbytes``, in huge pages where the system grants them.

    What a step streams or reads scattered, in 4 KiB pages, costs a TLB miss
    every 4 KiB: the packed weights (see ``cpu_gemm.weight_buffer``) and the
    KV cache, whose blocks of 16 tokens a decode step reads one here, one
    there (the 0.5B model's decode attention over 8 x 1024 tokens, every layer
    its own cache: 0.85x the time in huge pages). A buffer of at least one
    huge page gets a fresh anonymous mapping, aligned to 2 MiB and advised
    ``MADV_HUGEPAGE`` before anything touches it (the alignment slack is
    never touched, so it takes no memory); where that is not available
    (another OS, the advice refused) it keeps the usual pages. The mapping
    lives as long as a view of it.
    """
    if nbytes < HUGE_PAGE or getattr(mmap, "MADV_HUGEPAGE", None) is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    region, skip = _huge_page_mapping(nbytes)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=skip)  # holds the mapping


def _huge_page_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A fresh anonymous mapping with ``nbytes`` from a 2 MiB boundary on, advised ``MADV_HUGEPAGE`` where the
    system has the advice (see :func:`host_buffer`), and where in it that boundary lies."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    skip = -start % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice, skip - skip % mmap.PAGESIZE, nbytes + skip % mmap.PAGESIZE)
        except OSError:
            pass
    return region, skip


#: ``mallopt`` parameters (glibc's ``malloc.h``)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
#: freed heap the C library keeps rather than giving it back, and the room it adds beyond a request as the heap grows
HOST_KEEP_BYTES = 512 << 20


@functools.cache
def _glibc() -> Any:
    """The process's C library where it is glibc (``mallopt``, ``malloc_trim``), else ``None``; looked up once."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc alone
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_host_memory() -> bool:
    """Have glibc keep the memory torch's host tensors free, for the next ones; ``False`` where the C library is
    not glibc (nothing changes there).

    By default glibc maps a block larger than its threshold (128 KiB, raised
    as such blocks are freed, to 32 MiB at most) in pages of its own and
    unmaps it when freed, and gives the top of its heap back to the system
    once more than twice that threshold lies free there. A step's
    activations are freed at its end, so the next step's found fresh pages
    and faulted each one in: a prefill of 32 prompts (4369 tokens in steps of
    2048) of the 0.5B model in bf16 took ~440 000 page faults, ~15% of its
    time in the kernel zeroing and mapping pages. Here every block comes from
    the heap (no mapping of its own), and up to :data:`HOST_KEEP_BYTES` of
    freed heap stays with the process: the same prefill again takes a few
    hundred faults. Blocks up to 32 MiB (glibc's largest mmap threshold)
    from the heap and the larger ones mapped had left 2 processes of 62
    mapping the 40 MiB gate-up outputs afresh every step, as before. A thread
    that allocates from an arena of its own (a fleet replica's engine loop does)
    grows it in heaps of 64 MiB, so blocks larger than that are still mapped
    there each time; the CPU ops take their largest outputs from
    :class:`LargeHostBlocks` instead. The setting is the process's; it stays
    for as long as the process runs (:func:`release_freed_host_memory` gives
    back what is free meanwhile).
    """
    libc = _glibc()
    if libc is None:
        return False
    kept = all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, HOST_KEEP_BYTES), (_M_TOP_PAD, HOST_KEEP_BYTES)))
    if kept:
        log.debug("host allocator: every block from the heap, up to %d MiB of it kept free", HOST_KEEP_BYTES >> 20)
    return kept


def release_freed_host_memory() -> bool:
    """Give the host memory kept free back to the system: the free :class:`LargeHostBlocks`, and what glibc
    holds (``malloc_trim``); ``False`` without glibc."""
    if _large_blocks is not None:
        _large_blocks.release()
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


#: host tensors of at least this many bytes that the CPU ops make come from :class:`LargeHostBlocks` (glibc's
#: largest mmap threshold: the heap holds smaller ones between steps in any thread)
LARGE_HOST_BYTES = 32 << 20


class LargeHostBlocks:
    """Mappings for the largest host tensors the CPU ops make (a prefill's MLP activations), kept between steps.

    A thread other than the main one allocates from an arena of its own,
    which glibc grows in heaps of 64 MiB: a block larger than that is mapped
    on its own and unmapped when freed, whatever :func:`keep_freed_host_memory`
    set. A fleet replica's engine loop runs the steps in such a thread (as
    the server's did before it stepped on its main thread, and as an
    application may), so there a prefill step faulted its largest
    activations in afresh every time: a 1.5B Qwen2-shaped model in bf16
    (gate-up outputs of 73 MB at 2048 tokens) took ~1 000 000 minor faults to
    prefill 32 prompts in a thread, at 0.80x the main thread's tokens a
    second (497 against 624; ``benchmarks/host_memory.py --model 1.5b
    --thread``). Here such a tensor is a view of a mapping in huge pages (see
    :func:`host_buffer`); when its last view dies the mapping goes to a free
    list, and the next request that fits takes the smallest free mapping that
    holds it. Up to ``keep_bytes`` of free mappings are kept, the oldest
    unmapped beyond that; :meth:`release` unmaps them all.
    """

    def __init__(self, keep_bytes: int = HOST_KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        #: free mappings, oldest first, each with its 2 MiB boundary's offset and the bytes from there
        self._free: list[tuple[mmap.mmap, int, int]] = []
        #: mappings whose last view died, not yet in the free list: a view can die in any thread, inside this
        #: thread's locked section too (a garbage collection there), so it only queues its mapping
        self._returned: collections.deque[tuple[mmap.mmap, int, int]] = collections.deque()

    def empty(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of ``nbytes`` on a kept mapping, or on a new one when none free holds it."""
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        with self._lock:
            dropped = self._settle()
            fits = [entry for entry in self._free if entry[2] >= size]
            found = min(fits, key=lambda entry: entry[2]) if fits else None
            if found is not None:
                self._free.remove(found)
        for old in dropped:
            old.close()
        region, skip, held = found if found is not None else (*_huge_page_mapping(size), size)
        lease = memoryview(region)  # its last holder is the tensor's storage: dead with the last view
        weakref.finalize(lease, self._returned.append, (region, skip, held)).atexit = False
        return torch.frombuffer(lease, dtype=torch.uint8, count=nbytes, offset=skip)

    def free_bytes(self) -> int:
        """Bytes of the mappings kept free."""
        with self._lock:
            dropped = self._settle()
            free = sum(held for _, _, held in self._free)
        for old in dropped:
            old.close()
        return free

    def release(self) -> None:
        """Unmap every free mapping."""
        with self._lock:
            self._settle()
            free, self._free = self._free, []
        for region, _, _ in free:
            region.close()

    def _settle(self) -> list[mmap.mmap]:
        """The returned mappings into the free list, and out of it the oldest beyond ``keep_bytes`` (under the
        lock; the caller unmaps them after it)."""
        while self._returned:
            self._free.append(self._returned.popleft())
        dropped, kept = [], sum(held for _, _, held in self._free)
        while kept > self.keep_bytes:
            old, _, held = self._free.pop(0)
            dropped.append(old)
            kept -= held
        return dropped


#: the process's large host blocks, once the ``caching`` plugin keeps freed host memory (:func:`host_empty`)
_large_blocks: LargeHostBlocks | None = None
_large_blocks_made = threading.Lock()


def keep_large_host_blocks() -> LargeHostBlocks:
    """Have :func:`host_empty` take large tensors from the process's :class:`LargeHostBlocks` (made once)."""
    global _large_blocks
    with _large_blocks_made:
        if _large_blocks is None:
            _large_blocks = LargeHostBlocks()
    return _large_blocks


def host_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the host, for a CPU op's output: from :class:`LargeHostBlocks`
    where it is at least :data:`LARGE_HOST_BYTES` and the ``caching`` plugin keeps freed host memory.

    Not while a torch dispatch mode watches (``cpu_capture`` recording a step): there the allocation must be
    one the mode sees, so that the captured step lays the buffer out in its arena.
    """
    blocks = _large_blocks
    nbytes = math.prod(int(d) for d in shape) * dtype.itemsize
    if blocks is None or nbytes < LARGE_HOST_BYTES or _get_current_dispatch_mode() is not None:
        return torch.empty(tuple(shape), dtype=dtype)
    return blocks.empty(nbytes).view(dtype).view(tuple(shape))


class _Block:
    """One reserved region: ``data`` is an aligned uint8 view of ``size`` bytes."""

    __slots__ = ("data", "size")

    def __init__(self, data: torch.Tensor, size: int) -> None:
        self.data = data
        self.size = size


class _BaseAllocator(MemoryAllocator):
    """Shared bookkeeping: block reservation, live blocks by address, statistics."""

    def __init__(self, *, device: Device, alignment: int = 64, granularity: int = 512) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if granularity <= 0 or granularity % alignment and alignment % granularity:
            raise ValueError(f"granularity {granularity} must be a positive multiple or divisor of alignment")
        self.device = device
        self.alignment = alignment
        self.granularity = granularity
        self._lock = threading.Lock()
        self._live: dict[int, _Block] = {}
        self._allocated = 0
        self._reserved = 0
        self._peak = 0
        self._num_allocs = 0
        self._num_cache_hits = 0

    def _reserve(self, size: int) -> _Block:
        """A fresh aligned block of ``size`` bytes from the device."""
        if size >= _CHECK_FREE_FROM:
            free, total = self.device.mem_get_info()
            if size > free:
                raise DeviceOutOfMemoryError(
                    f"{self.name}: cannot allocate {size} bytes; {free} of {total} bytes free on device "
                    f"'{self.device.name}'", requested=size, free=free, capacity=total)
        try:
            if torch.device(self.device.torch_device).type == "cpu":  # a KV cache, say: huge pages (host_buffer)
                raw = host_buffer(size + self.alignment)
            else:
                raw = torch.empty(size + self.alignment, dtype=torch.uint8, device=self.device.torch_device)
        except (RuntimeError, OSError) as exc:  # the device (or, for the host, the system) refused it
            free, total = self.device.mem_get_info()
            raise DeviceOutOfMemoryError(f"{self.name}: cannot allocate {size} bytes ({exc}); {free} of {total} "
                                         f"bytes free", requested=size, free=free, capacity=total) from exc
        offset = (-raw.data_ptr()) % self.alignment
        self._reserved += size
        return _Block(raw[offset:offset + size], size)

    def _hand_out(self, block: _Block, shape: Sequence[int], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        self._live[block.data.data_ptr()] = block
        self._allocated += block.size
        self._peak = max(self._peak, self._allocated)
        self._num_allocs += 1
        return block.data[:nbytes].view(dtype).view(tuple(shape))

    def _take_back(self, tensor: torch.Tensor) -> _Block:
        block = self._live.pop(tensor.data_ptr(), None)
        if block is None:
            raise ValueError(f"{self.name}: this tensor was not allocated by this allocator or was already freed")
        self._allocated -= block.size
        return block

    @staticmethod
    def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
        return math.prod(int(d) for d in shape) * torch.empty((), dtype=dtype).element_size()

    def stats(self) -> MemoryStats:
        with self._lock:
            reserved = self._reserved
            fragmentation = 1.0 - self._allocated / reserved if reserved else 0.0
            return MemoryStats(allocated=self._allocated, reserved=reserved, peak=self._peak,
                               fragmentation=fragmentation, num_allocs=self._num_allocs,
                               num_cache_hits=self._num_cache_hits)

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._allocated


class CachingAllocator(_BaseAllocator):
    """A pool: freed blocks wait in a free list per rounded size and are reused first."""

    name = "caching"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._free: dict[int, list[_Block]] = collections.defaultdict(list)

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = self._nbytes(shape, dtype)
        size = self.round_size(nbytes)
        with self._lock:
            bucket = self._free.get(size)
            if bucket:
                self._num_cache_hits += 1
                return self._hand_out(bucket.pop(), shape, dtype, nbytes)
            try:
                block = self._reserve(size)
            except DeviceOutOfMemoryError:
                self._release_cached()  # cached blocks of other sizes may make room
                block = self._reserve(size)
            return self._hand_out(block, shape, dtype, nbytes)

    def free(self, tensor: torch.Tensor) -> None:
        with self._lock:
            block = self._take_back(tensor)
            self._free[block.size].append(block)

    def empty_cache(self) -> None:
        """Give back the cached blocks, and the host memory the C library keeps free."""
        with self._lock:
            self._release_cached()
        release_freed_host_memory()

    def _release_cached(self) -> None:
        for size, blocks in self._free.items():
            self._reserved -= size * len(blocks)
        self._free.clear()

    def cached_sizes(self) -> dict[int, int]:
        """``{block size: number of cached blocks}``, for inspection."""
        with self._lock:
            return {size: len(blocks) for size, blocks in self._free.items() if blocks}


class SimpleAllocator(_BaseAllocator):
    """No cache: every allocation reserves a new block, every free releases it."""

    name = "simple"

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = self._nbytes(shape, dtype)
        with self._lock:
            return self._hand_out(self._reserve(self.round_size(nbytes)), shape, dtype, nbytes)

    def free(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self._reserved -= self._take_back(tensor).size


def _layout(config: Any) -> dict[str, int]:
    layout = {}
    for key in ("alignment", "granularity"):
        if config is not None and config.get(key) is not None:
            layout[key] = int(config.get(key))
    return layout


def make_caching(*, config: Any, device: Device) -> CachingAllocator:
    keep_freed_host_memory()
    keep_large_host_blocks()
    return CachingAllocator(device=device, **_layout(config))


def make_simple(*, config: Any, device: Device) -> SimpleAllocator:
    return SimpleAllocator(device=device, **_layout(config))


@hookimpl
def kunlun_infer_plugin_info() -> PluginInfo:
    return PluginInfo(name=PLUGIN_NAME, version=__version__, api=">=1.0,<2", capabilities=("memory",),
                      stack=stack_versions(), description="host memory: a caching pool and a plain allocator")


@hookimpl
def kunlun_infer_memory_factories() -> dict[str, Any]:
    return {"caching": make_caching, "simple": make_simple}
