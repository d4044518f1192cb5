"""The config options simchip adds to the Hydra groups, and the size syntax of ``device.capacity``.

``device=simchip`` takes one key of its own, ``capacity``: the bytes of the
chip's memory arena, written as a plain number of bytes or with a binary unit
(``4GiB``, ``512MiB``, ``64M``). The arena must hold at least one 2 MiB
granule; sizes are rounded down to whole granules.
"""

from __future__ import annotations

import dataclasses
import re

from kunlun_infer.config import DeviceConfig, MemoryConfig, OpsConfig, PlatformConfig, StreamsConfig
from kunlun_infer.errors import ConfigError
from kunlun_infer.hookspecs import ConfigOption

from kunlun_infer_simchip import CHIP_NAME

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

#: every allocation's start address is a multiple of this (a page of the simulated chip)
ALIGNMENT = 4 * KIB
#: every allocation's size is a multiple of this (the chip's memory granule)
GRANULARITY = 2 * MIB
DEFAULT_CAPACITY = "4GiB"

_UNITS = {"": 1, "b": 1, "k": KIB, "kb": KIB, "kib": KIB, "m": MIB, "mb": MIB, "mib": MIB,
          "g": GIB, "gb": GIB, "gib": GIB, "t": 1024 * GIB, "tb": 1024 * GIB, "tib": 1024 * GIB}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


@dataclasses.dataclass
class SimchipDeviceConfig(DeviceConfig):
    """``device=simchip``: the simulated chip; ``capacity`` sizes its memory arena."""

    name: str = CHIP_NAME
    #: arena size: bytes (``268435456``) or with a binary unit (``256MiB``, ``4GiB``)
    capacity: str = DEFAULT_CAPACITY


def parse_capacity(value: object, *, key: str = "device.capacity") -> int:
    """Bytes of ``value`` rounded down to whole granules; :class:`ConfigError` naming ``key`` when unusable."""
    match = _SIZE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{key}={value!r} is not a size: write bytes (268435456) or a number with a "
                          f"binary unit (256MiB, 4GiB)")
    nbytes = int(float(match.group(1)) * _UNITS[unit])
    granules = nbytes // GRANULARITY
    if granules < 1:
        raise ConfigError(f"{key}={value!r} is smaller than one {GRANULARITY // MIB} MiB granule of simchip "
                          f"memory; give at least 2MiB")
    return granules * GRANULARITY


def config_options() -> list[ConfigOption]:
    """The options simchip contributes: ``device``, ``memory``, ``ops`` and ``streams`` = ``simchip``."""
    return [
        ConfigOption(group="device", name=CHIP_NAME, node=SimchipDeviceConfig),
        ConfigOption(group="memory", name=CHIP_NAME, node=MemoryConfig(name=CHIP_NAME)),
        ConfigOption(group="ops", name=CHIP_NAME, node=OpsConfig(name=CHIP_NAME)),
        ConfigOption(group="streams", name=CHIP_NAME, node=StreamsConfig(name=CHIP_NAME)),
        # platform=simchip: the four above; collectives through torch.distributed (single, gloo with TP)
        ConfigOption(group="platform", name=CHIP_NAME,
                     node=PlatformConfig(name=CHIP_NAME, device=CHIP_NAME, memory=CHIP_NAME, ops=CHIP_NAME,
                                         comm="single", streams=CHIP_NAME)),
    ]
