"""The simulated chip as a :class:`~kunlun_infer.capabilities.Device`.

Opening the device reserves its memory arena; the last close releases it.
Tensors live on the host (``torch_device`` is the CPU) but the chip keeps its
own identity, its own dtype set (float32 and bfloat16, no float16) and its own
memory accounting: ``mem_get_info`` reports the arena, not the host's RAM.
Streams created for this device register with it, so ``synchronize`` waits
for all of them, as a real device-wide synchronize would.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

import kunlun_infer_simchip
from kunlun_infer.capabilities import Device
from kunlun_infer.errors import PluginError

from kunlun_infer_simchip import CHIP_NAME
from kunlun_infer_simchip.arena import Arena
from kunlun_infer_simchip.config import ALIGNMENT, DEFAULT_CAPACITY, GRANULARITY, parse_capacity

SUPPORTED_DTYPES = frozenset({torch.float32, torch.bfloat16})


def config_value(config: Any, key: str, default: Any) -> Any:
    """``config.key`` from a DictConfig, a mapping or an object, else ``default``."""
    if config is None:
        return default
    if hasattr(config, "get"):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    return default if value is None else value


class SimchipDevice(Device):
    """One simulated chip with a fixed-capacity arena; reference-counted, thread-safe open/close."""

    name = CHIP_NAME

    def __init__(self, *, capacity: int, index: int = 0) -> None:
        self.capacity = capacity
        self.index = index
        self._lock = threading.Lock()
        self._opens = 0
        self._arena: Arena | None = None
        self._streams: weakref.WeakSet[Any] = weakref.WeakSet()

    @classmethod
    def from_config(cls, config: Any, local_rank: int = 0) -> SimchipDevice:
        """Build from the composed ``device`` node (``capacity``, ``index``)."""
        capacity = parse_capacity(config_value(config, "capacity", DEFAULT_CAPACITY))
        return cls(capacity=capacity, index=int(config_value(config, "index", local_rank)))

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def open(self) -> None:
        with self._lock:
            if self._opens == 0:
                self._arena = Arena(self.capacity, alignment=ALIGNMENT, granularity=GRANULARITY)
            self._opens += 1

    def close(self) -> None:
        with self._lock:
            if self._opens == 0:
                raise PluginError("simchip device closed more often than opened", plugin=CHIP_NAME,
                                  hook="Device.close")
            self._opens -= 1
            if self._opens > 0:
                return
            # queued work may still write into the arena: let it drain before the memory goes
            for stream in list(self._streams):
                stream.drain()
            self._arena = None

    @property
    def is_open(self) -> bool:
        return self._opens > 0

    @property
    def arena(self) -> Arena:
        """The memory arena; only while the device is open."""
        arena = self._arena
        if arena is None:
            raise PluginError("simchip device is not open: open() it before allocating memory",
                              plugin=CHIP_NAME, hook="Device.open", layer="hardware")
        return arena

    def identity(self) -> dict[str, Any]:
        return {"name": CHIP_NAME, "vendor": "kunlun_infer (simulated)", "model": "SimChip-1",
                "index": self.index, "capacity": self.capacity, "alignment": ALIGNMENT,
                "granularity": GRANULARITY}

    def supported_dtypes(self) -> frozenset[torch.dtype]:
        return SUPPORTED_DTYPES

    def mem_get_info(self) -> tuple[int, int]:
        arena = self._arena
        return (self.capacity if arena is None else arena.free_bytes), self.capacity

    def stack_versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "simchip": kunlun_infer_simchip.__version__}

    def register_stream(self, stream: Any) -> None:
        """Include ``stream`` in device-wide ``synchronize``."""
        self._streams.add(stream)

    def synchronize(self) -> None:
        for stream in list(self._streams):
            stream.synchronize()
