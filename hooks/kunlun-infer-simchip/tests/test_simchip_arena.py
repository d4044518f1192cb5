"""The simchip arena and allocator: real alignment and granularity, reuse, and out-of-memory with numbers."""

import pytest
import torch

from kunlun_infer.errors import DeviceOutOfMemoryError, PluginError

from kunlun_infer_simchip.arena import Arena
from kunlun_infer_simchip.config import ALIGNMENT, GRANULARITY, MIB
from kunlun_infer_simchip.device import SimchipDevice
from kunlun_infer_simchip.memory import SimchipAllocator


@pytest.fixture
def device():
    dev = SimchipDevice(capacity=16 * MIB)
    dev.open()
    yield dev
    dev.close()


def test_every_allocation_is_4k_aligned_and_whole_granules_from_the_arena_base(device):
    memory = SimchipAllocator(device)
    tensors = [memory.allocate(shape, dtype) for shape, dtype in
               [((3,), torch.float32), ((1000, 7), torch.bfloat16), ((2, 300_000), torch.float32)]]
    base = device.arena.base_ptr
    assert base % ALIGNMENT == 0
    offsets = sorted(t.data_ptr() - base for t in tensors)
    for t in tensors:
        assert t.data_ptr() % ALIGNMENT == 0
        assert (t.data_ptr() - base) % GRANULARITY == 0
        assert 0 <= t.data_ptr() - base < device.capacity
    # 12 B and 14 KB take one granule each, 2.4 MB takes two: the ranges sit granule after granule
    assert offsets == [0, GRANULARITY, 2 * GRANULARITY]
    assert memory.stats().allocated == 4 * GRANULARITY
    assert device.mem_get_info() == (16 * MIB - 4 * GRANULARITY, 16 * MIB)


def test_tensors_are_usable_and_do_not_overlap(device):
    memory = SimchipAllocator(device)
    a = memory.allocate((1024,), torch.float32)
    b = memory.allocate((1024,), torch.float32)
    a.fill_(1.0)
    b.fill_(2.0)
    assert a.sum().item() == 1024.0 and b.sum().item() == 2048.0


def test_exhaustion_raises_device_oom_with_requested_free_and_capacity(device):
    memory = SimchipAllocator(device)
    memory.allocate((3 * MIB // 4,), torch.float32)  # 3 MiB -> 4 MiB reserved
    with pytest.raises(DeviceOutOfMemoryError) as info:
        memory.allocate((13 * MIB // 4,), torch.float32)  # 13 MiB asked, 12 MiB free
    err = info.value
    assert err.requested == 13 * MIB and err.free == 12 * MIB and err.capacity == 16 * MIB
    text = str(err)
    assert "simchip out of memory" in text and str(13 * MIB) in text and str(16 * MIB) in text
    assert "device.capacity" in text  # says what to do


def test_fragmentation_is_reported_when_free_space_is_not_contiguous(device):
    memory = SimchipAllocator(device)
    blocks = [memory.allocate((GRANULARITY,), torch.uint8) for _ in range(8)]
    for t in blocks[::2]:
        memory.free(t)
    memory.empty_cache()
    assert device.arena.free_bytes == 4 * GRANULARITY
    with pytest.raises(DeviceOutOfMemoryError) as info:
        memory.allocate((2 * GRANULARITY,), torch.uint8)
    assert "largest contiguous free range 2.0 MiB" in str(info.value)


def test_freed_ranges_are_cached_reused_and_merged_on_release(device):
    memory = SimchipAllocator(device)
    a = memory.allocate((100,), torch.float32)
    ptr = a.data_ptr()
    memory.free(a)
    stats = memory.stats()
    assert stats.allocated == 0 and stats.reserved == GRANULARITY and stats.fragmentation == 1.0
    b = memory.allocate((200,), torch.float32)
    assert b.data_ptr() == ptr and memory.stats().num_cache_hits == 1
    memory.free(b)
    memory.empty_cache()
    assert memory.stats().reserved == 0
    assert device.arena.free_ranges() == [(0, 16 * MIB)]  # merged back into one range


def test_cache_is_emptied_before_giving_up(device):
    memory = SimchipAllocator(device)
    small = [memory.allocate((GRANULARITY,), torch.uint8) for _ in range(8)]
    for t in small:
        memory.free(t)  # all 16 MiB now cached in 2 MiB pieces
    big = memory.allocate((16 * MIB,), torch.uint8)
    assert big.numel() == 16 * MIB and memory.stats().reserved == 16 * MIB


def test_peak_and_reset_peak(device):
    memory = SimchipAllocator(device)
    a = memory.allocate((GRANULARITY,), torch.uint8)
    b = memory.allocate((GRANULARITY,), torch.uint8)
    memory.free(a)
    assert memory.stats().peak == 2 * GRANULARITY
    memory.reset_peak()
    assert memory.stats().peak == GRANULARITY
    memory.free(b)


def test_double_free_and_foreign_tensor_are_refused(device):
    memory = SimchipAllocator(device)
    a = memory.allocate((10,), torch.float32)
    memory.free(a)
    with pytest.raises(PluginError, match="freed twice"):
        memory.free(a)
    with pytest.raises(PluginError, match="did not allocate"):
        memory.free(torch.zeros(4))


def test_memory_simchip_needs_a_simchip_device():
    class Other:
        name = "cpu"

    with pytest.raises(PluginError, match="needs device=simchip"):
        SimchipAllocator(Other())


def test_allocating_on_a_closed_device_says_open_it():
    dev = SimchipDevice(capacity=4 * MIB)
    memory = SimchipAllocator(dev)
    with pytest.raises(PluginError, match="not open"):
        memory.allocate((4,), torch.float32)


def test_arena_release_merges_both_neighbours():
    arena = Arena(8 * MIB)
    a, b, c = (arena.reserve(GRANULARITY) for _ in range(3))
    arena.release(a)
    arena.release(c)
    assert arena.free_ranges() == [(0, GRANULARITY), (2 * GRANULARITY, 4 * MIB)]
    arena.release(b)
    assert arena.free_ranges() == [(0, 8 * MIB)]
    with pytest.raises(ValueError, match="double free"):
        arena.release(b)


def test_allocator_starts_afresh_when_the_device_is_reopened():
    dev = SimchipDevice(capacity=8 * MIB)
    memory = SimchipAllocator(dev)
    dev.open()
    memory.free(memory.allocate((10,), torch.float32))  # one range cached in the first arena
    dev.close()
    dev.open()
    t = memory.allocate((10,), torch.float32)
    assert memory.stats().num_cache_hits == 0 and memory.stats().reserved == GRANULARITY
    assert t.data_ptr() == dev.arena.base_ptr
    dev.close()
