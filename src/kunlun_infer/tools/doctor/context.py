"""What the doctor's stages share: the overrides, the plugins, the composed config, the runtime, a scratch folder.

The config is composed once, leniently: when a chosen plugin failed to load,
composition fails, and that is stage 2's finding — stage 1 still checks the
device with the device and memory choices alone. The runtime is built by
stage 2 and used by the later stages; :meth:`DoctorContext.close` releases it
and the scratch folder.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from kunlun_infer.errors import ConfigError
from kunlun_infer.hookspecs import CAPABILITIES, HOOK_API_VERSION_STR
from kunlun_infer.runtime import Runtime, compose_config
from kunlun_infer.tools.tiny_model import write_tiny_model
from kunlun_infer.version import __version__


def capability_choices(overrides: list[str]) -> dict[str, str]:
    """``{"ops": "mine"}`` for overrides such as ``ops=mine`` (the group choices among the overrides)."""
    choices = {}
    for override in overrides:
        key, sep, value = override.lstrip("+").partition("=")
        if sep and key in CAPABILITIES:
            choices[key] = value
    return choices


def overrides_for(overrides: list[str], groups: tuple[str, ...]) -> list[str]:
    """The overrides that touch only ``groups`` (``device=x``, ``device.capacity=1GiB`` …)."""
    kept = []
    for override in overrides:
        key = override.lstrip("+~").partition("=")[0]
        if key.split(".", 1)[0] in groups:
            kept.append(override)
    return kept


@dataclasses.dataclass
class DoctorContext:
    """Shared state of one doctor run."""

    overrides: list[str]
    modules: list[str]
    manager: Any
    repro_dir: Path
    sweep_key: str = "scheduler.max_num_seqs"
    sweep_values: tuple[int, ...] = (1, 2, 4, 8, 16)
    progress: bool | None = None
    seed: int = 0
    cfg: DictConfig | None = None
    compose_error: ConfigError | None = None
    runtime: Runtime | None = None
    _scratch: Path | None = None
    _tiny: dict[int, Path] = dataclasses.field(default_factory=dict)

    def compose(self) -> None:
        """Compose the run's config; a failure is kept for stage 2 when a plugin failed to load."""
        try:
            self.cfg = compose_config(self.overrides, plugin_manager=self.manager)
        except ConfigError as exc:
            if not self.manager.load_errors:
                raise
            self.compose_error = exc

    @property
    def world_size(self) -> int:
        return int(self.cfg.parallel.tensor_size) if self.cfg is not None else 1

    @property
    def scratch(self) -> Path:
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="kunlun-infer-doctor-"))
        return self._scratch

    def tiny_model(self, tensor_size: int = 1) -> Path:
        """A tiny random Llama that splits over ``tensor_size`` ranks (written once per size)."""
        if tensor_size not in self._tiny:
            self._tiny[tensor_size] = write_tiny_model(self.scratch / f"tiny-tp{tensor_size}",
                                                       tensor_size=tensor_size, seed=self.seed)
        return self._tiny[tensor_size]

    def plugin_versions(self) -> dict[str, str]:
        """``capability -> "option: plugin version (distribution version)"`` for the chosen plugins."""
        versions = {"kunlun-infer": f"{__version__} (hook API {HOOK_API_VERSION_STR})"}
        if self.cfg is None:
            return versions
        for capability in CAPABILITIES:
            option = str(self.cfg[capability].name)
            try:
                p = self.manager.plugin_for(capability, option)
            except Exception:  # noqa: BLE001 - an unloaded plugin has no version to show
                versions[capability] = f"{option}: not loaded"
                continue
            dist = f" ({p.distribution} {p.distribution_version})" if p.distribution else ""
            versions[capability] = f"{option}: {p.name} {p.info.version}{dist}, API {p.info.api}"
        return versions

    def close(self) -> None:
        if self.runtime is not None:
            try:
                self.runtime.close()
            finally:
                self.runtime = None
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
