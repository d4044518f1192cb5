"""Find the Kunlun stack: the cards (``xpu-smi``), and the versions of driver, runtime, collective
library and ``torch_xmlir``.

Everything reaches the system through a :class:`StackProbe` — how to run a
tool, import a module and read the environment — so detection is tested with
fakes and nothing here runs at import time. A fact that cannot be found is
``None``; the version matrix then skips the rules that need it and says so.

``xpu-smi`` (``xpu_smi`` on older drivers) prints ``Driver Version: …`` and
``Runtime Version: …`` lines and a ``| DevID | … | Model | … | Memory |``
table; parsing keys on those labels, not on column positions.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kunlun_infer_cuda.device import run_tool

SMI_TOOLS = ("xpu-smi", "xpu_smi")
STACK_MODULE = "torch_xmlir"
_VERSION_LINE = re.compile(r"^\s*(Driver|Runtime)\s+Version\s*:\s*(\S+)", re.IGNORECASE | re.MULTILINE)
_LIBRARY_FILE = re.compile(r"^lib(bkcl|xccl)\.so\.(\d+(?:\.\d+)*)$")


@dataclasses.dataclass(frozen=True)
class StackProbe:
    """How detection touches the system; tests replace each part."""

    run: Callable[[list[str]], str | None] = run_tool
    import_module: Callable[[str], Any] = importlib.import_module
    environ: Mapping[str, str] = dataclasses.field(default_factory=lambda: os.environ)


@dataclasses.dataclass
class SmiReport:
    """What ``xpu-smi`` said: versions and one dict per card (``id``, ``model``, ``memory_total_mb`` …)."""

    driver: str | None = None
    runtime: str | None = None
    devices: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Detection:
    """The stack as found: cards, versions by component, and why something is missing."""

    smi: SmiReport | None
    stack_module: Any
    versions: dict[str, str | None]
    problems: list[str]

    @property
    def usable(self) -> bool:
        """True when the vendor's torch stack imported (the device can then be opened)."""
        return self.stack_module is not None


def parse_smi(text: str) -> SmiReport:
    """Versions and the device table from ``xpu-smi``'s output."""
    report = SmiReport()
    for label, value in _VERSION_LINE.findall(text):
        setattr(report, label.lower(), value)
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.strip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if any(c.lower() == "devid" for c in cells):
            header = [c.lower() for c in cells]
            continue
        if header is None or len(cells) != len(header) or not cells[0].isdigit():
            continue
        row = dict(zip(header, cells))
        device: dict[str, Any] = {"id": int(row["devid"]), "model": row.get("model")}
        memory = re.match(r"(\d+)\s*/\s*(\d+)\s*MB", row.get("memory", ""))
        if memory:
            device["memory_used_mb"], device["memory_total_mb"] = int(memory.group(1)), int(memory.group(2))
        if "pci addr" in row:
            device["pci"] = row["pci addr"]
        report.devices.append(device)
    return report


def read_smi(probe: StackProbe) -> SmiReport | None:
    """``xpu-smi``'s report, or None when no such tool runs here."""
    for tool in SMI_TOOLS:
        out = probe.run([tool])
        if out:
            return parse_smi(out)
    return None


def _module_version(module: Any, *names: str) -> str | None:
    for name in names:
        value = getattr(module, name, None)
        if value:
            return str(value() if callable(value) else value)
    return None


def collective_version(module: Any) -> str | None:
    """BKCL/XCCL version: an attribute of ``torch_xmlir`` if it has one, else a versioned library file in it."""
    found = _module_version(module, "__bkcl_version__", "bkcl_version", "__xccl_version__", "xccl_version")
    if found:
        return found
    folder = getattr(module, "__file__", None)
    if not folder:
        return None
    for path in sorted(Path(folder).parent.rglob("lib*.so.*")):
        match = _LIBRARY_FILE.match(path.name)
        if match:
            return match.group(2)
    return None


def detect(probe: StackProbe | None = None) -> Detection:
    """Look for the cards and the stack; never raises for a missing piece, records it instead."""
    probe = probe or StackProbe()
    problems: list[str] = []
    smi = read_smi(probe)
    if smi is None:
        problems.append("xpu-smi did not run: no Kunlun driver found on this host (or it is not on PATH)")
    elif not smi.devices:
        problems.append("xpu-smi lists no XPU devices")
    try:
        module = probe.import_module(STACK_MODULE)
    except Exception as exc:  # noqa: BLE001 - an absent or broken vendor stack is a finding, not a crash
        module = None
        problems.append(f"{STACK_MODULE} is not importable ({type(exc).__name__}: {exc}); install the vendor's "
                        f"xpytorch wheel built for this torch")
    versions: dict[str, str | None] = {
        "driver": smi.driver if smi else None,
        "runtime": (smi.runtime if smi else None) or _module_version(module, "__xre_version__", "xre_version"),
        "bkcl": collective_version(module) if module is not None else None,
        "torch_xmlir": _module_version(module, "__version__") if module is not None else None,
    }
    return Detection(smi=smi, stack_module=module, versions=versions, problems=problems)
