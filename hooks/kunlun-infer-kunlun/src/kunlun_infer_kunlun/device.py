"""``device=kunlun``: one Kunlun XPU, opened through the vendor's torch stack.

Before the first open: export ``device.visible_devices`` as
``XPU_VISIBLE_DEVICES`` (refused once the device runtime has started), map
the logical index to a physical card, detect the host and the stack
(``/dev/xpuctrl``, ``xpu-smi -i N -q``, the installed distributions), warn
about environment settings that work against this plugin, and check the
version matrix (``device.version_check``: ``warn`` logs a combination the
observed deployments contradict, ``error`` refuses it, ``off`` skips the
check). Then the device is driven through torch's CUDA API, which the
xpytorch build points at the XPU — so lifecycle and memory queries are
:class:`kunlun_infer_cuda.device.CudaDevice`'s.

What the card *is* comes from ``xpu-smi`` (or, without it,
``torch_xmlir.xpu.get_device_properties``), never from the CUDA-compatibility
layer, which names every card "GPU" with compute capability 8.6.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

import torch

import kunlun_infer_kunlun
from kunlun_infer.errors import ConfigError, PluginError

from kunlun_infer_cuda.device import CudaDevice, config_value
from kunlun_infer_kunlun.config import DEVICE, VERSION_CHECK_MODES
from kunlun_infer_kunlun.detect import UNREADABLE, Detection, StackProbe, detect
from kunlun_infer_kunlun.environment import environment_warnings
from kunlun_infer_kunlun.matrix import check_matrix
from kunlun_infer_kunlun.visible import VISIBLE_ENV, apply_visible_devices, physical_id

log = logging.getLogger("kunlun_infer.plugin.kunlun")


class KunlunDevice(CudaDevice):
    """A Kunlun XPU; the vendor stack exposes it through torch's CUDA API."""

    name = DEVICE
    vendor = "Kunlunxin"
    hint = ("check `xpu-smi`, the driver, /dev/xpuctrl and /dev/xpuN in the container, XPU_VISIBLE_DEVICES, and "
            "that the vendor's xpytorch build for this torch is installed")

    def __init__(self, *, index: int, visible_devices: str | None = None, version_check: str = "warn",
                 probe: StackProbe | None = None, api: Any = None,
                 environ: MutableMapping[str, str] | None = None) -> None:
        super().__init__(index=index, api=api)
        if version_check not in VERSION_CHECK_MODES:
            raise ConfigError(f"device.version_check={version_check!r}: choose one of {', '.join(VERSION_CHECK_MODES)}")
        self.visible_devices = visible_devices
        self.version_check = version_check
        self.environ = os.environ if environ is None else environ
        self.probe = probe or StackProbe(environ=self.environ)
        self.physical_id: int | None = None
        self.detection: Detection | None = None
        self.environment_warnings: list[str] = []

    @classmethod
    def from_config(cls, config: Any, local_rank: int = 0, **kwargs: Any) -> KunlunDevice:
        return cls(index=int(config_value(config, "index", local_rank)),
                   visible_devices=config_value(config, "visible_devices", None),
                   version_check=str(config_value(config, "version_check", "warn")), **kwargs)

    # ------------------------------------------------------------------ bring-up

    def runtime_started(self) -> bool:
        """Whether the device runtime has started (and read the visible-devices variables)."""
        started = getattr(self.api, "is_initialized", None)
        return bool(started()) if callable(started) else False

    def prepare(self) -> None:
        visible = apply_visible_devices(self.visible_devices, self.environ, self.runtime_started)
        self.physical_id = physical_id(self.index, visible)
        self.environment_warnings = environment_warnings(self.environ)
        for warning in self.environment_warnings:
            log.warning("device=%s: %s", self.name, warning)
        self.detection = detection = detect(self.probe, self.physical_id)
        if not detection.usable:
            raise PluginError(f"device={self.name}: the Kunlun stack is not usable: {'; '.join(detection.problems)}",
                              plugin=self.name, hook="Device.open", layer="hardware")
        self.check_versions(detection)

    def check_versions(self, detection: Detection) -> None:
        """Apply ``device.version_check`` to the version matrix."""
        if self.version_check == "off":
            return
        result = check_matrix(self.versions(detection), unknown_why=UNREADABLE)
        for note in result.unchecked:
            log.info("version matrix rule not checked: %s", note)
        if result.ok:
            return
        message = (f"device={self.name}: this combination of the Kunlun stack was not seen working: "
                   f"{'; '.join(result.mismatches)}")
        if self.version_check == "error":
            raise PluginError(message + ". Install a combination a vendor deployment uses, or set "
                              "device.version_check=warn to go on", plugin=self.name, hook="Device.open",
                              layer="hardware")
        log.warning("%s (going on: device.version_check=warn)", message)

    def versions(self, detection: Detection) -> dict[str, str | None]:
        return {**detection.versions, "kunlun-infer-kunlun": kunlun_infer_kunlun.__version__}

    # ------------------------------------------------------------------ facts

    def _stack_properties(self) -> dict[str, Any]:
        """The card's name and memory from ``torch_xmlir.xpu.get_device_properties`` (empty when unavailable)."""
        try:
            props = self.probe.import_module("torch_xmlir").xpu.get_device_properties(self.index)
        except Exception:  # noqa: BLE001 - a fact we cannot read is left out, never invented
            return {}
        facts = {"model": getattr(props, "name", None), "total_memory": getattr(props, "total_memory", None)}
        return {k: v for k, v in facts.items() if v is not None}

    def identity(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"name": self.name, "vendor": self.vendor, "index": self.index,
                                 "physical_id": self.physical_id, "visible_devices": self.environ.get(VISIBLE_ENV)}
        card = dict(self.detection.smi.card) if self.detection and self.detection.smi else {}
        if card:
            facts.update(card)
            facts["source"] = "xpu-smi"
            if "memory_total_mb" in card:
                facts["total_memory"] = card["memory_total_mb"] * 2**20
        else:
            props = self._stack_properties()
            if props:
                facts.update(props)
                facts["source"] = "torch_xmlir.xpu.get_device_properties"
        return facts

    def supported_dtypes(self) -> frozenset[torch.dtype]:
        return frozenset({torch.float32, torch.float16, torch.bfloat16})

    def stack_versions(self) -> dict[str, str]:
        detection = self.detection or detect(self.probe, self.physical_id or 0)
        found = {k: v for k, v in self.versions(detection).items() if v is not None}
        return {"torch": torch.__version__, **found}

    def driver_version(self) -> str | None:
        detection = self.detection or detect(self.probe, self.physical_id or 0)
        return detection.versions.get("driver")
