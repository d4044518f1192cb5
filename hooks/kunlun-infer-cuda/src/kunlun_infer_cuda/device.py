"""``device=cuda``: one GPU through ``torch.cuda``.

The physical device is ``device.index`` when set, else the process's local
rank (one process per GPU). Nothing touches the GPU before ``open``: the
factory is cheap and works on a machine without one, and ``open`` on such a
machine fails with one line saying what is missing. The CUDA API is reached
through ``self.api`` (``torch.cuda`` by default), so stacks that expose their
device through the same API reuse this class, and tests can pass a fake.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from typing import Any

import torch

import kunlun_infer_cuda
from kunlun_infer.capabilities import Device
from kunlun_infer.errors import PluginError

from kunlun_infer_cuda.config import DEVICE


def config_value(config: Any, key: str, default: Any) -> Any:
    """``config.key`` from a DictConfig, a mapping or an object; ``default`` when absent or None."""
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def run_tool(argv: list[str], timeout_s: float = 10.0) -> str | None:
    """stdout of a command-line tool, or None when it is absent or fails."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


class CudaDevice(Device):
    """A GPU reached through torch's CUDA API; reference-counted, thread-safe open/close."""

    name = DEVICE
    vendor = "NVIDIA"
    #: what to check when no device is visible (said in the error)
    hint = "check `nvidia-smi`, the driver, CUDA_VISIBLE_DEVICES, and that torch is a CUDA build"

    def __init__(self, *, index: int, allow_tf32: bool = False, api: Any = None) -> None:
        self.index = index
        self.allow_tf32 = allow_tf32
        self.api = torch.cuda if api is None else api
        self._lock = threading.Lock()
        self._opens = 0

    @classmethod
    def from_config(cls, config: Any, local_rank: int = 0, **kwargs: Any) -> CudaDevice:
        return cls(index=int(config_value(config, "index", local_rank)),
                   allow_tf32=bool(config_value(config, "allow_tf32", False)), **kwargs)

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.index)

    # ------------------------------------------------------------------ lifecycle

    def check_visible(self) -> None:
        """Raise a ``hardware`` :class:`PluginError` unless device ``index`` is usable."""
        if not self.api.is_available():
            raise PluginError(
                f"device={self.name}: no {self.vendor} device is visible to torch {torch.__version__} "
                f"(built with CUDA {torch.version.cuda or 'none'}); {self.hint}",
                plugin=self.name, hook="Device.open", layer="hardware")
        count = self.api.device_count()
        if not 0 <= self.index < count:
            raise PluginError(
                f"device={self.name}: device.index={self.index} but only {count} device(s) are visible "
                f"(indices 0..{count - 1}); set device.index or run fewer ranks per host",
                plugin=self.name, hook="Device.open", layer="hardware")

    def prepare(self) -> None:
        """Work before the first open touches the device (a subclass sets up its vendor stack here)."""

    def open(self) -> None:
        with self._lock:
            if self._opens == 0:
                self.prepare()
                self.check_visible()
                self.api.set_device(self.index)
                torch.backends.cuda.matmul.allow_tf32 = self.allow_tf32
                torch.backends.cudnn.allow_tf32 = self.allow_tf32
            self._opens += 1

    def close(self) -> None:
        with self._lock:
            if self._opens == 0:
                raise PluginError(f"device={self.name} closed more often than opened", plugin=self.name,
                                  hook="Device.close")
            self._opens -= 1
            if self._opens == 0:
                self.api.synchronize(self.index)

    @property
    def is_open(self) -> bool:
        return self._opens > 0

    # ------------------------------------------------------------------ facts

    def identity(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"name": self.name, "vendor": self.vendor, "index": self.index}
        if self.api.is_available() and self.index < self.api.device_count():
            props = self.api.get_device_properties(self.index)
            facts.update(model=props.name, total_memory=int(props.total_memory),
                         capability=f"{props.major}.{props.minor}",
                         multiprocessors=int(getattr(props, "multi_processor_count", 0)))
            uuid = getattr(props, "uuid", None)
            if uuid is not None:
                facts["uuid"] = str(uuid)
        return facts

    def supported_dtypes(self) -> frozenset[torch.dtype]:
        dtypes = {torch.float32, torch.float16}
        if self.api.is_available() and self.index < self.api.device_count():
            if self.api.get_device_properties(self.index).major >= 8:  # bf16 arithmetic from Ampere on
                dtypes.add(torch.bfloat16)
        return frozenset(dtypes)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self.api.mem_get_info(self.index)
        return int(free), int(total)

    def stack_versions(self) -> dict[str, str]:
        versions = {"torch": torch.__version__, "cuda runtime": str(torch.version.cuda or "none"),
                    self.plugin_key(): kunlun_infer_cuda.__version__}
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if cudnn:
            versions["cudnn"] = str(cudnn)
        nccl = getattr(getattr(self.api, "nccl", None), "version", None)
        if callable(nccl) and self.api.is_available():
            try:
                versions["nccl"] = ".".join(str(p) for p in nccl())
            except Exception:  # noqa: BLE001 - a version fact is never worth failing for
                pass
        driver = self.driver_version()
        if driver:
            versions["driver"] = driver
        return versions

    def plugin_key(self) -> str:
        return "kunlun-infer-cuda"

    def driver_version(self) -> str | None:
        out = run_tool(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        return out.strip().splitlines()[0].strip() if out and out.strip() else None

    def synchronize(self) -> None:
        self.api.synchronize(self.index)
