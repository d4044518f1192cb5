"""Built-in device plugin ``cpu``: the host CPU through plain torch.

Identity comes from the platform and ``/proc/cpuinfo``; the dtypes offered are
float32 plus each low-precision dtype that the CPU accelerates (AVX512-BF16 /
AMX, AVX512-FP16 / F16C) or that torch at least computes correctly here;
``mem_get_info`` reads ``/proc/meminfo`` (psutil elsewhere).
"""

from __future__ import annotations

import os
import platform
import threading
from typing import Any

import torch

from kunlun_infer.version import __version__
from kunlun_infer.capabilities import Device
from kunlun_infer.errors import ConfigError
from kunlun_infer.hookspecs import PluginInfo, hookimpl

PLUGIN_NAME = "cpu"
_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}
_FP16_FLAGS = {"avx512_fp16", "amx_fp16", "f16c"}


def _cpuinfo() -> dict[str, str]:
    """First processor's fields of ``/proc/cpuinfo`` (empty off Linux)."""
    facts: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                facts[key.strip()] = value.strip()
    except OSError:
        pass
    return facts


def cpu_vendor() -> str:
    """The CPU's vendor as the OS reports it (``GenuineIntel``, ``AuthenticAMD``; empty where unknown)."""
    return _cpuinfo().get("vendor_id", "")


def cpu_model() -> str:
    """The CPU's model as the OS names it, with vendor, family and model numbers (a hypervisor may show two
    generations under one name): ``AMD EPYC (AuthenticAMD family 25 model 17)``."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine()
    numbers = " ".join(f"{key.split()[-1]} {info[key]}" for key in ("cpu family", "model") if key in info)
    vendor = info.get("vendor_id", "")
    return f"{name} ({vendor} {numbers})" if vendor or numbers else name


#: env var capping the instruction sets the host kernels may use, to run (and test) the kernels another CPU gets
ISA_ENV = "KUNLUN_INFER_CPU_ISA"
#: cap -> flag prefixes it hides
_ISA_CAPS = {"native": (), "avx512": ("amx",), "avx512-vnni": ("amx", "avx512_bf16"),
             "avx512-core": ("amx", "avx512_bf16", "avx512_vnni"), "avx2-vnni": ("avx512", "amx"),
             "avx2": ("avx512", "amx", "avx_vnni")}


def cpu_flags() -> frozenset[str]:
    """CPU feature flags (``avx2``, ``avx512_bf16`` …) as the OS reports them, less those ``$KUNLUN_INFER_CPU_ISA`` hides.

    ``KUNLUN_INFER_CPU_ISA=avx2`` makes an AVX-512 machine choose the kernels of an AVX2-only one
    (AVX-VNNI hidden too); ``avx2-vnni`` keeps AVX-VNNI; ``avx512`` hides AMX; ``avx512-vnni`` hides AMX and
    AVX512-BF16 too (a Cascade Lake or Ice Lake Xeon's kernels), ``avx512-core`` AVX512-VNNI as well (a
    Skylake Xeon's); ``native`` (or unset) hides nothing.
    """
    info = _cpuinfo()
    flags = frozenset((info.get("flags") or info.get("Features") or "").split())
    cap = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if cap not in _ISA_CAPS:
        raise ConfigError(f"{ISA_ENV}={cap!r} is not a known instruction-set cap; use one of {sorted(_ISA_CAPS)}")
    return frozenset(f for f in flags if not f.startswith(_ISA_CAPS[cap]))


def _dtype_works(dtype: torch.dtype) -> bool:
    """True when a small matmul + softmax in ``dtype`` matches float32 here."""
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(8, 16, generator=g), torch.randn(16, 8, generator=g)
        got = torch.softmax((a.to(dtype) @ b.to(dtype)).float(), -1)
        return bool(torch.allclose(got, torch.softmax(a @ b, -1), atol=5e-2))
    except (RuntimeError, TypeError):
        return False


def mem_info() -> tuple[int, int]:
    """``(available, total)`` bytes of host memory."""
    try:
        fields: dict[str, int] = {}
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        return fields.get("MemAvailable", fields["MemFree"]), fields["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)


class CpuDevice(Device):
    """The host CPU. ``open``/``close`` are reference counted under a lock."""

    name = PLUGIN_NAME

    def __init__(self, *, index: int = 0) -> None:
        self.index = index
        self._lock = threading.Lock()
        self._opens = 0
        self._dtypes: frozenset[torch.dtype] | None = None

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def open(self) -> None:
        with self._lock:
            self._opens += 1

    def close(self) -> None:
        with self._lock:
            if self._opens == 0:
                raise RuntimeError("cpu device closed more often than opened")
            self._opens -= 1

    @property
    def is_open(self) -> bool:
        return self._opens > 0

    def identity(self) -> dict[str, Any]:
        info = _cpuinfo()
        flags = cpu_flags()
        return {
            "name": self.name, "index": self.index,
            "vendor": info.get("vendor_id") or platform.processor() or "unknown",
            "model": info.get("model name") or platform.processor() or platform.machine(),
            "arch": platform.machine(), "cores": os.cpu_count() or 1,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_native": bool(flags & _BF16_FLAGS), "fp16_native": bool(flags & _FP16_FLAGS),
        }

    def supported_dtypes(self) -> frozenset[torch.dtype]:
        if self._dtypes is None:
            flags = cpu_flags()
            found = {torch.float32}
            if flags & _BF16_FLAGS or _dtype_works(torch.bfloat16):
                found.add(torch.bfloat16)
            if flags & _FP16_FLAGS or _dtype_works(torch.float16):
                found.add(torch.float16)
            self._dtypes = frozenset(found)
        return self._dtypes

    def mem_get_info(self) -> tuple[int, int]:
        return mem_info()

    def stack_versions(self) -> dict[str, str]:
        return stack_versions()


def stack_versions() -> dict[str, str]:
    """Versions of what the CPU plugins run on."""
    return {"torch": torch.__version__, "python": platform.python_version(),
            "os": platform.platform(terse=True), "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def make_cpu_device(*, config: Any, local_rank: int = 0) -> CpuDevice:
    index = config.get("index") if config is not None else None
    return CpuDevice(index=local_rank if index is None else int(index))


@hookimpl
def kunlun_infer_plugin_info() -> PluginInfo:
    return PluginInfo(name=PLUGIN_NAME, version=__version__, api=">=1.0,<2", capabilities=("device",),
                      stack=stack_versions(), description="the host CPU through plain torch")


@hookimpl
def kunlun_infer_device_factories() -> dict[str, Any]:
    return {"cpu": make_cpu_device}
