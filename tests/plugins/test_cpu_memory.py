"""The built-in ``caching`` and ``simple`` allocators: a real pool, alignment, stats, OOM."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest
import torch

from kunlun_infer import DeviceOutOfMemoryError
from kunlun_infer.plugins import cpu_memory
from kunlun_infer.plugins.cpu_device import CpuDevice
from kunlun_infer.plugins.cpu_memory import CachingAllocator, SimpleAllocator


def test_caching_pool_reuses_freed_blocks_of_the_same_size():
    pool = CachingAllocator(device=CpuDevice())
    a = pool.allocate((100,), torch.float32)  # 400 bytes -> one 512-byte block
    address = a.data_ptr()
    pool.free(a)
    b = pool.allocate((10, 10), torch.int32)  # same rounded size, another shape and dtype
    assert b.data_ptr() == address
    stats = pool.stats()
    assert (stats.num_allocs, stats.num_cache_hits, stats.reserved) == (2, 1, 512)


def test_stats_track_allocated_reserved_peak_and_fragmentation():
    pool = CachingAllocator(device=CpuDevice())
    big = pool.allocate((1024,), torch.float32)  # 4096 bytes
    small = pool.allocate((1,), torch.float32)  # 512 bytes
    pool.free(big)
    stats = pool.stats()
    assert (stats.allocated, stats.reserved, stats.peak) == (512, 4608, 4608)
    assert stats.fragmentation == pytest.approx(1 - 512 / 4608)
    assert pool.cached_sizes() == {4096: 1}
    pool.empty_cache()
    assert pool.stats().reserved == 512 and pool.cached_sizes() == {}
    pool.free(small)


def test_alignment_and_granularity_are_honoured():
    pool = CachingAllocator(device=CpuDevice(), alignment=4096, granularity=8192)
    tensors = [pool.allocate((n,), torch.uint8) for n in (1, 5000, 8193)]
    assert all(t.data_ptr() % 4096 == 0 for t in tensors)
    assert pool.stats().allocated == 8192 + 8192 + 16384


def test_bad_layout_is_refused():
    with pytest.raises(ValueError, match="power of two"):
        CachingAllocator(device=CpuDevice(), alignment=48)


def test_simple_allocator_keeps_nothing():
    alloc = SimpleAllocator(device=CpuDevice())
    t = alloc.allocate((3, 3), torch.float16)
    assert alloc.stats().reserved == 512
    alloc.free(t)
    assert alloc.stats().reserved == 0 and alloc.stats().peak == 512


@pytest.mark.parametrize("kind", [CachingAllocator, SimpleAllocator])
def test_request_beyond_device_memory_raises_with_numbers(kind):
    device = CpuDevice()
    free, total = device.mem_get_info()
    with pytest.raises(DeviceOutOfMemoryError) as info:
        kind(device=device).allocate((total + 1,), torch.uint8)
    assert info.value.requested >= total + 1 and info.value.capacity == total
    assert str(total) in str(info.value)


def test_freeing_a_foreign_tensor_is_refused():
    pool = CachingAllocator(device=CpuDevice())
    t = pool.allocate((4,), torch.float32)
    pool.free(t)
    with pytest.raises(ValueError, match="not allocated by this allocator or was already freed"):
        pool.free(t)


# A prefill's activations on the host, step after step: blocks of several sizes alive at once, two beyond glibc's
# largest mmap threshold; prints the page faults of three steps after four and the resident memory before and after the
# pool's empty_cache (argv[1]: "caching" composes the caching plugin first, "plain" leaves the C library alone).
_STEPS = """
import json, resource, sys, torch
from kunlun_infer.plugins import cpu_memory
from kunlun_infer.plugins.cpu_device import CpuDevice
pool = cpu_memory.make_caching(config=None, device=CpuDevice()) if sys.argv[1] == "caching" else None
def step():
    blocks = [torch.ones(n, dtype=torch.uint8) for n in (8 << 20, 40 << 20, 20 << 20, 80 << 20)]
    return sum(int(b[-1]) for b in blocks)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
for _ in range(4):  # glibc's free lists settle where each block goes within a few steps
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
kept = rss()
if pool is not None:
    pool.empty_cache()
print(json.dumps({"faults": faults, "kept": kept, "after_empty_cache": rss()}))
"""


def _steps(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _transparent_huge_pages_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(cpu_memory._glibc() is None, reason="the host allocator's policy is glibc's (mallopt)")
def test_caching_plugin_has_the_next_steps_activations_reuse_the_last_ones_pages():
    caching, plain = _steps("caching"), _steps("plain")
    step_pages = (148 << 20) // resource.getpagesize()
    # three steps of 148 MiB: the caching plugin's process faults (almost) none of their pages in again
    assert caching["faults"] < step_pages // 20, caching
    if not _transparent_huge_pages_always():  # there fresh mappings fault in 2 MiB at a time
        assert plain["faults"] > step_pages, plain  # by default glibc maps the 40 and 80 MiB blocks anew each step
    # what the steps freed is kept, and empty_cache gives it back
    assert caching["kept"] - caching["after_empty_cache"] > (100 << 20), caching
