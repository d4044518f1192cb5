"""Stage 1: the device opens, a tensor round-trips host → device → host, memory allocates and frees.

Only the device and memory plugins are involved, so this stage runs even
when another chosen plugin failed to load (stage 2 reports that). Data that
comes back different points at the hardware (or the device plugin's copies);
an allocation that does not hold what was written points at the memory
plugin.
"""

from __future__ import annotations

from typing import Any

import torch

from kunlun_infer.capabilities import Device, MemoryAllocator
from kunlun_infer.runtime import compose_config
from kunlun_infer.runtime.guard import guard, guarded_call
from kunlun_infer.tools.doctor.blame import blame
from kunlun_infer.tools.doctor.context import DoctorContext, overrides_for
from kunlun_infer.tools.doctor.report import Failure, StageFailed, StageResult
from kunlun_infer.tools.sizes import format_bytes

NAME = "device opens, a tensor round-trips, memory allocates and frees"
_VISIBLE = ("check that the device is visible to this process: driver loaded, the vendor's smi tool lists it, "
            "visible-devices environment variables, permissions")


def _device_config(ctx: DoctorContext) -> Any:
    if ctx.cfg is not None:
        return ctx.cfg

    return compose_config(overrides_for(ctx.overrides, ("device", "memory")), plugin_manager=ctx.manager)


def _fail(layer: str, message: str, plugin: str, hook: str, steps: list[str]) -> StageFailed:
    return StageFailed(Failure(layer=layer, message=message, plugin=plugin, hook=hook, next_steps=steps))


def _copy_back(host: torch.Tensor, where: torch.device, plugin: str) -> torch.Tensor:
    try:
        return host.to(where).cpu()
    except Exception as exc:  # noqa: BLE001 - torch talking to the device's stack failed
        raise _fail("hardware", f"copying a {host.dtype} tensor to {where} and back failed: "
                    f"{type(exc).__name__}: {exc}", plugin, "Device.torch_device (host <-> device copy)",
                    [_VISIBLE, f"check that device plugin '{plugin}' names a torch device its stack provides"]) from exc


def _round_trip(device: Any, plugin: str, result: StageResult) -> None:
    where = device.torch_device
    for dtype in sorted(device.supported_dtypes(), key=str):
        host = (torch.arange(4096, dtype=torch.float32) % 251 - 125).to(dtype)
        back = _copy_back(host, where, plugin)
        if back.dtype != dtype or not torch.equal(back, host):
            bad = int((back != host).sum()) if back.shape == host.shape else host.numel()
            raise _fail("hardware", f"a {dtype} tensor of {host.numel()} elements came back from {where} with "
                        f"{bad} element(s) changed", plugin, "Device.torch_device (host <-> device copy)",
                        ["run the vendor's memory / copy test on this device",
                         f"check the device plugin '{plugin}' maps tensors to the right torch device"])
    result.details.append(f"round trip host -> {where} -> host exact in "
                          f"{', '.join(str(d).removeprefix('torch.') for d in sorted(device.supported_dtypes(), key=str))}")


def _memory_check(memory: Any, plugin: str, result: StageResult) -> None:
    before = memory.stats()
    pattern = torch.arange(1 << 18, dtype=torch.int32)
    block = memory.allocate((1 << 18,), torch.int32)
    try:
        if block.data_ptr() % memory.alignment:
            raise _fail("plugin", f"allocate gave an address that is not a multiple of alignment={memory.alignment}",
                        plugin, "memory.allocate", ["check the allocator's alignment arithmetic"])
        block.copy_(pattern.to(block.device))
        if not torch.equal(block.cpu(), pattern):
            raise _fail("plugin", "a 1 MiB allocation does not hold what was written to it", plugin,
                        "memory.allocate", ["check the allocator's offsets and sizes (overlapping blocks?)",
                                            "run the conformance suite: pytest --pyargs kunlun_infer.testing.suite"])
        during = memory.stats()
    finally:
        memory.free(block)
    after = memory.stats()
    if during.allocated < before.allocated + pattern.numel() * 4 or after.allocated != before.allocated:
        raise _fail("plugin", f"stats().allocated went {before.allocated} -> {during.allocated} -> {after.allocated} "
                    f"for one 1 MiB allocate/free", plugin, "memory.stats",
                    ["check that allocate and free update the allocator's statistics"])
    result.details.append(f"memory: allocate/free of 1 MiB ok (alignment {memory.alignment} B, granularity "
                          f"{format_bytes(memory.granularity)})")


def run(ctx: DoctorContext, result: StageResult) -> None:
    cfg = _device_config(ctx)
    plugin, factory = ctx.manager.factory("device", str(cfg.device.name))
    made = guarded_call(plugin, f"device factory '{cfg.device.name}'", factory, config=cfg.device, local_rank=0)
    device = guard(made, plugin=plugin, capability="device", interface=Device)
    try:
        device.open()
    except Exception as exc:  # noqa: BLE001 - attributed below
        raise StageFailed(blame(exc, plugin=plugin, hook="Device.open", next_steps=[_VISIBLE])) from exc
    try:
        identity = device.identity()
        free, total = device.mem_get_info()
        result.data.update(identity={k: str(v) for k, v in identity.items()}, free=free, total=total,
                           plugin=plugin, stack=device.stack_versions())
        result.details.append(f"device '{cfg.device.name}' (plugin {plugin}): "
                              + ", ".join(f"{k}={identity[k]}" for k in ("vendor", "model", "index") if k in identity))
        result.details.append(f"memory: {format_bytes(free)} free of {format_bytes(total)}")
        if not 0 <= free <= total or total <= 0:
            raise _fail("plugin", f"mem_get_info() gave free={free}, total={total}", plugin, "Device.mem_get_info",
                        ["check the device plugin's memory query"])
        _round_trip(device, plugin, result)
        mem_plugin, mem_factory = ctx.manager.factory("memory", str(cfg.memory.name))
        made_memory = guarded_call(mem_plugin, f"memory factory '{cfg.memory.name}'", mem_factory,
                                   config=cfg.memory, device=made)
        memory = guard(made_memory, plugin=mem_plugin, capability="memory", interface=MemoryAllocator)
        try:
            _memory_check(memory, mem_plugin, result)
        finally:
            memory.empty_cache()
    finally:
        device.close()
