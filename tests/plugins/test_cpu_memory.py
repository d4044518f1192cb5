"""The built-in ``caching`` and ``simple`` allocators: a real pool, alignment, stats, OOM."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import threading

import pytest
import torch

from kunlun_infer import DeviceOutOfMemoryError
from kunlun_infer.plugins import cpu_gemm, cpu_memory
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


# A prefill's MLP in a thread that steps the engine (a fleet replica's engine loop is one): the native GEMM's gate-up
# outputs (2048 x 18944 bf16, 74 MiB) and SwiGLU's (37 MiB), step after step; prints the page faults of three steps
# after two, and whether each step's outputs held the right values (argv[1] as in _STEPS).
_THREAD_STEPS = """
import json, resource, sys, threading, torch
from kunlun_infer.plugins import cpu_gemm, cpu_kernels, cpu_memory
from kunlun_infer.plugins.cpu_device import CpuDevice
if sys.argv[1] == "caching":
    cpu_memory.make_caching(config=None, device=CpuDevice())
torch.manual_seed(0)
x = torch.randn(2048, 64).to(torch.bfloat16)
weight = (torch.randn(18944, 64) / 8).to(torch.bfloat16)
packed = cpu_gemm.pack(weight)
expected = cpu_kernels.silu_and_mul(x @ weight.T)[::97, ::89].float()
result = {}
def steps():
    def step():
        out = cpu_kernels.silu_and_mul(cpu_gemm.linear(x, packed))
        return torch.allclose(out[::97, ::89].float(), expected, rtol=0.02, atol=0.02)
    ok = [step() for _ in range(2)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ok += [step() for _ in range(3)]
    result["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    result["right"] = all(ok)
thread = threading.Thread(target=steps)
thread.start()
thread.join()
print(json.dumps(result))
"""


@pytest.mark.skipif(not cpu_gemm.available(torch.bfloat16), reason="no native bf16 GEMM on this machine")
def test_the_engine_threads_largest_activations_reuse_the_last_steps_pages():
    outcome = {}
    for mode in ("caching", "plain"):
        done = subprocess.run([sys.executable, "-c", _THREAD_STEPS, mode], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        outcome[mode] = json.loads(done.stdout)
    step_pages = (111 << 20) // resource.getpagesize()
    assert outcome["caching"]["right"] and outcome["plain"]["right"], outcome
    # three steps of 111 MiB: with the caching plugin almost none of their pages are faulted in again
    assert outcome["caching"]["faults"] < step_pages // 20, outcome
    if not _transparent_huge_pages_always():  # there fresh mappings fault in 2 MiB at a time
        # a thread's glibc arena grows in heaps of 64 MiB: the gate-up outputs are mapped anew each step
        assert outcome["plain"]["faults"] > step_pages, outcome


def _base(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_a_large_block_goes_to_no_one_else_while_a_view_of_it_lives():
    blocks = cpu_memory.LargeHostBlocks()
    first = blocks.empty(40 << 20)
    first.fill_(3)
    alias, base = first[-10:], _base(first)
    del first
    second = blocks.empty(40 << 20)  # the first's mapping is still held by its view
    assert _base(second) != base
    second.fill_(5)
    assert (alias == 3).all()
    del alias
    third = blocks.empty(40 << 20)  # now it is free again, and taken
    assert _base(third) == base
    blocks.release()


def test_large_blocks_go_to_the_smallest_free_mapping_that_holds_them_and_keep_a_budget():
    huge = cpu_memory.HUGE_PAGE
    blocks = cpu_memory.LargeHostBlocks(keep_bytes=100 << 20)
    a, b = blocks.empty(40 << 20), blocks.empty(80 << 20)
    base_a, base_b = _base(a), _base(b)
    del a, b
    assert blocks.free_bytes() == 80 << 20  # 120 MiB freed, over the budget: the older mapping (40 MiB) is unmapped
    c = blocks.empty(80 << 20)
    assert _base(c) == base_b
    d, e = blocks.empty((30 << 20) + 5), blocks.empty(20 << 20)
    base_d, base_e = _base(d), _base(e)
    assert d.numel() == (30 << 20) + 5 and base_d % huge == 0
    del c, d, e  # 80 + 32 + 20 MiB: the 80 MiB mapping goes
    assert blocks.free_bytes() == (32 << 20) + (20 << 20)
    small, mid = blocks.empty(19 << 20), blocks.empty(21 << 20)
    assert (_base(small), _base(mid)) == (base_e, base_d)  # each to the smallest that holds it
    del small, mid
    blocks.release()
    assert blocks.free_bytes() == 0


def test_a_large_block_whose_last_view_dies_in_another_thread_is_taken_again():
    blocks = cpu_memory.LargeHostBlocks()
    held = [blocks.empty(33 << 20)]
    base = _base(held[0])
    dropper = threading.Thread(target=held.clear)  # the engine's thread lets go of what a handler thread made
    dropper.start()
    dropper.join()
    assert blocks.free_bytes() == 34 << 20
    assert _base(blocks.empty(33 << 20)) == base
    blocks.release()
