"""Conformance of a device: reference-counted open/close across threads, identity, dtypes, memory info."""

from __future__ import annotations

import threading
from typing import Any

import torch

from kunlun_infer.testing.compare import ConformanceError


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise ConformanceError(message)


def check_device(device: Any, *, threads: int = 4, rounds: int = 25) -> None:
    """``device`` is an opened device (as a runtime hands it out); it is left open."""
    _expect(device.is_open, "device: a runtime's device must be open")
    identity = device.identity()
    _expect(isinstance(identity, dict) and bool(identity.get("name")), f"device: identity() needs a 'name': {identity}")
    dtypes = device.supported_dtypes()
    _expect(torch.float32 in dtypes, f"device: supported_dtypes() must contain float32, got {sorted(map(str, dtypes))}")
    free, total = device.mem_get_info()
    _expect(0 <= free <= total and total > 0, f"device: mem_get_info() gave free={free}, total={total}")
    _expect(all(isinstance(v, str) for v in device.stack_versions().values()),
            "device: stack_versions() values must be str")

    data = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    back = data.to(device.torch_device).mul(2).cpu()
    _expect(torch.equal(back, data * 2), "device: a tensor did not survive a round trip to the device")

    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for _ in range(rounds):
                device.open()
                device.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=churn) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    _expect(not errors, f"device: concurrent open/close failed: {errors[:1]}")
    _expect(device.is_open, "device: concurrent open/close pairs closed the runtime's own open")


def check_device_lifecycle(device: Any) -> None:
    """``device`` is a fresh, unopened device: open, nest, close fully, reopen."""
    _expect(not device.is_open, "device: a new device must not be open before open()")
    device.open()
    device.open()
    device.close()
    _expect(device.is_open, "device: one close() after two open() must leave it open")
    device.close()
    _expect(not device.is_open, "device: the last close() must release it")
    device.open()
    _expect(device.is_open, "device: it must open again after a full close")
    device.close()
