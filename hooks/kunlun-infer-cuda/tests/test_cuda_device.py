"""The CUDA device, memory and streams logic, against a fake CUDA API (real GPU tests are in test_cuda_gpu.py)."""

import pytest
import torch
from cuda_fakes import FakeCudaApi

from kunlun_infer.errors import DeviceOutOfMemoryError, PluginError

from kunlun_infer_cuda.device import CudaDevice
from kunlun_infer_cuda.memory import CudaCachingAllocator
from kunlun_infer_cuda.streams import CudaStreams


def test_index_comes_from_config_else_local_rank():
    assert CudaDevice.from_config({"index": None}, local_rank=3, api=FakeCudaApi()).index == 3
    assert CudaDevice.from_config({"index": 1}, local_rank=3, api=FakeCudaApi()).index == 1
    assert CudaDevice.from_config({"index": 1}).torch_device == torch.device("cuda", 1)


def test_open_selects_the_device_and_last_close_synchronizes():
    api = FakeCudaApi()
    device = CudaDevice(index=1, api=api)
    device.open()
    device.open()
    assert api.current == 1 and device.is_open
    device.close()
    assert api.synced == [] and device.is_open
    device.close()
    assert api.synced == [1] and not device.is_open
    with pytest.raises(PluginError, match="closed more often"):
        device.close()


def test_open_without_any_gpu_says_what_to_check():
    device = CudaDevice(index=0, api=FakeCudaApi(count=0))
    with pytest.raises(PluginError) as info:
        device.open()
    assert info.value.layer == "hardware" and info.value.plugin == "cuda"
    assert "no NVIDIA device is visible" in str(info.value) and "nvidia-smi" in str(info.value)
    assert not device.is_open


def test_index_beyond_the_visible_devices_is_refused_naming_both():
    with pytest.raises(PluginError, match=r"device.index=2 but only 2 device\(s\) are visible"):
        CudaDevice(index=2, api=FakeCudaApi(count=2)).open()


def test_identity_dtypes_and_memory_info():
    api = FakeCudaApi(major=8)
    device = CudaDevice(index=0, api=api)
    facts = device.identity()
    assert facts["model"] == "Fake GPU 9000" and facts["capability"] == "8.0" and facts["vendor"] == "NVIDIA"
    assert device.supported_dtypes() == {torch.float32, torch.float16, torch.bfloat16}
    assert CudaDevice(index=0, api=FakeCudaApi(major=7)).supported_dtypes() == {torch.float32, torch.float16}
    assert device.mem_get_info() == (70 * 2**30, 80 * 2**30)
    assert device.stack_versions()["kunlun-infer-cuda"] == "0.1.0"


def test_stats_come_from_the_caching_allocator():
    api = FakeCudaApi()
    api.counters = {"allocated": 300, "reserved": 1000, "peak": 700}
    memory = CudaCachingAllocator(CudaDevice(index=0, api=api))
    stats = memory.stats()
    assert (stats.allocated, stats.reserved, stats.peak) == (300, 1000, 700)
    assert stats.fragmentation == pytest.approx(0.7) and stats.num_cache_hits == 7
    memory.reset_peak()
    assert memory.stats().peak == 300
    memory.empty_cache()
    assert memory.stats().reserved == 300


def test_allocator_out_of_memory_becomes_device_oom_with_numbers(monkeypatch):
    memory = CudaCachingAllocator(CudaDevice(index=0, api=FakeCudaApi(free=1000, total=4000)))

    def exhausted(shape, dtype):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 KiB")

    monkeypatch.setattr(memory, "empty", exhausted)
    with pytest.raises(DeviceOutOfMemoryError) as info:
        memory.allocate((1024,), torch.float32)
    assert (info.value.requested, info.value.free, info.value.capacity) == (4096, 1000, 4000)
    assert "requested 4096 bytes, 1000 free of 4000" in str(info.value)


def test_free_releases_the_storage_at_once():
    memory = CudaCachingAllocator(CudaDevice(index=0, api=FakeCudaApi()))
    t = torch.empty(256)  # any storage shows the effect; on a GPU it returns to the caching allocator
    memory.free(t)
    assert t.untyped_storage().nbytes() == 0


def test_streams_run_work_with_the_stream_current_and_order_with_events():
    api = FakeCudaApi()
    streams = CudaStreams(CudaDevice(index=0, api=api))
    compute, comm = streams.compute_stream(), streams.comm_stream()
    assert streams.overlaps
    seen = []
    compute.submit(lambda: seen.append(api.active))
    assert seen == [compute.raw]
    event = compute.record_event()
    assert event.raw.recorded_on is compute.raw
    comm.wait_event(event)
    assert comm.raw.waited == [event.raw]


def test_stream_host_errors_are_sticky_until_synchronize():
    streams = CudaStreams(CudaDevice(index=0, api=FakeCudaApi()))
    stream = streams.compute_stream()
    ran = []
    stream.submit(lambda: 1 / 0)
    stream.submit(ran.append, 1)
    with pytest.raises(ZeroDivisionError):
        stream.synchronize()
    stream.submit(ran.append, 2)
    stream.synchronize()
    assert ran == [2]
