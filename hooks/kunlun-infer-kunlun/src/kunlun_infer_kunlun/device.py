"""``device=kunlun``: one Kunlun XPU, opened through the vendor's torch stack.

Before the first open: export ``device.visible_devices`` as
``XPU_VISIBLE_DEVICES``, map the logical index to a physical card, detect the
stack (``xpu-smi``, ``torch_xmlir``) and check the version matrix
(``device.version_check``: ``error`` refuses a mismatch, ``warn`` logs it,
``off`` skips it). Then the device is driven through torch's CUDA API, which
``torch_xmlir`` points at the XPU — so everything after ``prepare`` is
:class:`kunlun_infer_cuda.device.CudaDevice`.
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
from kunlun_infer_kunlun.detect import Detection, StackProbe, detect
from kunlun_infer_kunlun.matrix import check_matrix
from kunlun_infer_kunlun.visible import VISIBLE_ENV, apply_visible_devices, physical_id

log = logging.getLogger("kunlun_infer.plugin.kunlun")


class KunlunDevice(CudaDevice):
    """A Kunlun XPU; the vendor stack exposes it through torch's CUDA API."""

    name = DEVICE
    vendor = "Kunlunxin"
    hint = ("check `xpu-smi`, the driver, XPU_VISIBLE_DEVICES, and that the vendor's torch_xmlir wheel "
            "is installed and imported")

    def __init__(self, *, index: int, visible_devices: str | None = None, version_check: str = "error",
                 probe: StackProbe | None = None, api: Any = None,
                 environ: MutableMapping[str, str] | None = None, modules: dict | None = None) -> None:
        super().__init__(index=index, api=api)
        if version_check not in VERSION_CHECK_MODES:
            raise ConfigError(f"device.version_check={version_check!r}: choose one of {', '.join(VERSION_CHECK_MODES)}")
        self.visible_devices = visible_devices
        self.version_check = version_check
        self.environ = os.environ if environ is None else environ
        self.probe = probe or StackProbe(environ=self.environ)
        self.modules = modules
        self.physical_id: int | None = None
        self.detection: Detection | None = None

    @classmethod
    def from_config(cls, config: Any, local_rank: int = 0, **kwargs: Any) -> KunlunDevice:
        return cls(index=int(config_value(config, "index", local_rank)),
                   visible_devices=config_value(config, "visible_devices", None),
                   version_check=str(config_value(config, "version_check", "error")), **kwargs)

    # ------------------------------------------------------------------ bring-up

    def prepare(self) -> None:
        visible = apply_visible_devices(self.visible_devices, self.environ, self.modules)
        self.physical_id = physical_id(self.index, visible)
        self.detection = detection = detect(self.probe)
        if not detection.usable:
            raise PluginError(f"device={self.name}: the Kunlun stack is not usable: {'; '.join(detection.problems)}",
                              plugin=self.name, hook="Device.open", layer="hardware")
        self.check_versions(detection)

    def check_versions(self, detection: Detection) -> None:
        """Apply ``device.version_check`` to the version matrix."""
        if self.version_check == "off":
            return
        result = check_matrix(self.versions(detection))
        for note in result.unchecked:
            log.info("version matrix rule not checked: %s", note)
        if result.ok:
            return
        message = (f"device={self.name}: the Kunlun stack's versions do not fit together: "
                   f"{'; '.join(result.mismatches)}. Install matching versions, or set "
                   f"device.version_check=warn to go on at your own risk")
        if self.version_check == "error":
            raise PluginError(message, plugin=self.name, hook="Device.open", layer="hardware")
        log.warning("%s", message)

    def versions(self, detection: Detection) -> dict[str, str | None]:
        return {**detection.versions, "kunlun-infer-kunlun": kunlun_infer_kunlun.__version__}

    # ------------------------------------------------------------------ facts

    def identity(self) -> dict[str, Any]:
        facts = super().identity()
        facts["physical_id"] = self.physical_id
        facts["visible_devices"] = self.environ.get(VISIBLE_ENV)
        smi = self.detection.smi if self.detection else None
        card = next((d for d in (smi.devices if smi else []) if d["id"] == self.physical_id), None)
        if card is not None:
            facts.setdefault("model", card.get("model"))
            facts["xpu_smi"] = card
        return facts

    def supported_dtypes(self) -> frozenset[torch.dtype]:
        return frozenset({torch.float32, torch.float16, torch.bfloat16})

    def stack_versions(self) -> dict[str, str]:
        detection = self.detection or detect(self.probe)
        found = {k: v for k, v in self.versions(detection).items() if v is not None}
        return {"torch": torch.__version__, **found}

    def driver_version(self) -> str | None:
        detection = self.detection or detect(self.probe)
        return detection.versions.get("driver")
