"""The CPU memory plugin hands out large blocks (a KV cache's) on 2 MiB boundaries of mappings of their own, so that
the system can back them with huge pages; both large and small blocks hold what is written, go back to the plugin
whole, and a host buffer's memory lives as long as a view of it."""

import mmap

import pytest
import torch

from kunlun_infer.plugins import cpu_memory
from kunlun_infer.plugins.cpu_device import CpuDevice


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no transparent huge pages on this system")
@pytest.mark.parametrize("kind", [cpu_memory.CachingAllocator, cpu_memory.SimpleAllocator], ids=lambda k: k.name)
def test_a_kv_sized_block_starts_on_a_huge_page_and_holds_what_is_written(kind):
    allocator = kind(device=CpuDevice())
    small = allocator.allocate((64, 16, 2, 64), torch.bfloat16)  # 256 KiB: ordinary memory
    cache = allocator.allocate((1200, 16, 2, 64), torch.bfloat16)  # 4.7 MiB: one layer's keys of a 0.5B model
    assert cache.data_ptr() % cpu_memory.HUGE_PAGE == 0
    for block in (small, cache):
        block.zero_()
        block[7, 3] = 2.5
        assert block.float().sum().item() == 2.5 * 2 * 64
    allocator.free(cache)
    allocator.free(small)
    assert allocator.stats().allocated == 0


def test_a_host_buffer_lives_as_long_as_a_view_of_it():
    assert cpu_memory.host_buffer(1000).numel() == 1000
    big = cpu_memory.host_buffer(3 * cpu_memory.HUGE_PAGE)
    assert big.numel() == 3 * cpu_memory.HUGE_PAGE
    big.fill_(7)
    alias = big[-10:]
    del big
    assert (alias == 7).all()
