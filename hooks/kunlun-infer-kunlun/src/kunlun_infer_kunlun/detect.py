"""Find the Kunlun stack: the control node, the card (``xpu-smi``), and the versions of what is installed.

A Kunlun host has ``/dev/xpuctrl`` beside ``/dev/xpuN`` (the vendor's
container guides pass both through); ``xpu-smi`` alone proves nothing, since
another vendor ships a tool of the same name. The card's facts come from
``xpu-smi -i N -q``, a ``Key : value`` report indented by section::

    Driver Version                            : 5.0.21.26
    XPU-RT Version                            : 5.0.21
    XPU 00000000:01:00.0
        Product Name                          : P800 OAM
        Memory Usage
            Total                             : 98304 MiB

(``xpu_smi`` on older drivers; when ``-q`` is refused, the versions are read
from the header of the plain table, ``Driver Version: … XPU-RT Version: …``).
Package versions come from the installed distributions' metadata
(``importlib.metadata``): ``torch``, the xpytorch build, ``kunlun_ops``,
``xspeedgate_ops``, ``cocopod``. The collective library (XCCL/BKCL) reports
its version through no published interface, so it stays unknown.

Everything reaches the system through a :class:`StackProbe` — how to run a
tool, import a module, read a distribution's version, and where the file
system starts — so detection is tested with fakes, and nothing here runs at
import time. A fact that cannot be found is ``None``; the version matrix then
skips the rules that need it and says so.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kunlun_infer.version import distribution_version
from kunlun_infer_cuda.device import run_tool

SMI_TOOLS = ("xpu-smi", "xpu_smi")
#: the control node every Kunlun host has (relative to the probe's root)
CONTROL_NODE = "dev/xpuctrl"
#: the module the xpytorch build installs
STACK_MODULE = "torch_xmlir"
#: component -> distribution names to try, in order (the xpytorch build's name differs between releases)
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "xpytorch": ("xpytorch", "torch_xmlir", "xmlir"),
    "kunlun_ops": ("kunlun_ops",),
    "xspeedgate_ops": ("xspeedgate_ops",),
    "cocopod": ("cocopod",),
}
#: components no installed artefact reports (listed so the matrix can say why a rule is unchecked)
UNREADABLE = {"xccl": "no published interface reports the collective library's version"}

_HEADER_VERSION = re.compile(r"(Driver|XPU-RT)\s+Version\s*:\s*(\S+)", re.IGNORECASE)
_QUERY_LINE = re.compile(r"^(?P<indent>\s*)(?P<key>\S.*?)\s+:\s*(?P<value>.*?)\s*$")
_MIB = re.compile(r"^(\d+)\s*MiB$", re.IGNORECASE)
_TABLE_ROW = re.compile(r"^\|\s*(\d+)\s+(.+?)\s{2,}\S+\s*\|\s*([0-9A-Fa-f]{4,}:[0-9A-Fa-f]{2}:[0-9A-Fa-f.]+)")
_TABLE_MEMORY = re.compile(r"(\d+)\s*MiB\s*/\s*(\d+)\s*MiB")


@dataclasses.dataclass(frozen=True)
class StackProbe:
    """How detection touches the system; tests replace each part."""

    run: Callable[[list[str]], str | None] = run_tool
    import_module: Callable[[str], Any] = importlib.import_module
    environ: Mapping[str, str] = dataclasses.field(default_factory=lambda: os.environ)
    version_of: Callable[[str], str | None] = distribution_version
    #: where the file system starts (``/dev/xpuctrl`` is looked up under it)
    root: Path = Path("/")


@dataclasses.dataclass
class SmiReport:
    """What ``xpu-smi`` said: the two versions, and the queried card's facts (empty when unknown)."""

    driver: str | None = None
    runtime: str | None = None
    card: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Detection:
    """The stack as found: is this a Kunlun host, what ``xpu-smi`` said, versions by component, what is missing."""

    control_node: bool
    smi: SmiReport | None
    stack_module: Any
    versions: dict[str, str | None]
    problems: list[str]

    @property
    def usable(self) -> bool:
        """True on a Kunlun host whose xpytorch build imports (the device can then be opened)."""
        return self.control_node and self.stack_module is not None


def _version_value(text: str) -> str | None:
    text = text.strip()
    return None if not text or text.upper() in ("N/A", "NA", "NONE") else text


def parse_smi_query(text: str) -> SmiReport:
    """The versions and the card's facts from ``xpu-smi -i N -q``."""
    report = SmiReport()
    sections: list[tuple[int, str]] = []  # (indent, name) of the enclosing section headers
    values: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip() or line.strip().startswith("="):
            continue
        indent = len(line) - len(line.lstrip())
        while sections and sections[-1][0] >= indent:
            sections.pop()
        match = _QUERY_LINE.match(line)
        if match is None:  # a section header: "Memory Usage", "XPU 00000000:01:00.0"
            sections.append((indent, line.strip()))
            continue
        path = "/".join([name for _, name in sections if not name.startswith("XPU ")] + [match["key"]])
        values.setdefault(path, match["value"])
    report.driver = _version_value(values.get("Driver Version", ""))
    report.runtime = _version_value(values.get("XPU-RT Version", ""))
    card: dict[str, Any] = {}
    for key, field in (("Product Name", "model"), ("Product Architecture", "architecture"),
                       ("Serial Number", "serial"), ("XPU UUID", "uuid"), ("PCI/Bus Id", "pci"),
                       ("Minor Number", "minor")):
        if values.get(key):
            card[field] = values[key]
    for key, field in (("Memory Usage/Total", "memory_total_mb"), ("Memory Usage/Used", "memory_used_mb")):
        mib = _MIB.match(values.get(key, ""))
        if mib:
            card[field] = int(mib.group(1))
    report.card = card
    return report


def parse_smi_table(text: str, physical_id: int) -> SmiReport:
    """The versions from the plain table's header, and card ``physical_id``'s name, bus and memory."""
    report = SmiReport()
    for label, value in _HEADER_VERSION.findall(text):
        setattr(report, "driver" if label.lower() == "driver" else "runtime", _version_value(value))
    lines = text.splitlines()
    for i, line in enumerate(lines):
        row = _TABLE_ROW.match(line.strip())
        if row is None or int(row.group(1)) != physical_id:
            continue
        report.card = {"model": row.group(2).strip(), "pci": row.group(3)}
        memory = _TABLE_MEMORY.search(lines[i + 1]) if i + 1 < len(lines) else None
        if memory:
            report.card["memory_used_mb"], report.card["memory_total_mb"] = int(memory.group(1)), int(memory.group(2))
        break
    return report


def read_smi(probe: StackProbe, physical_id: int) -> SmiReport | None:
    """``xpu-smi``'s report on card ``physical_id``, or None when no such tool runs here."""
    for tool in SMI_TOOLS:
        out = probe.run([tool, "-i", str(physical_id), "-q"])
        if out and "Version" in out:
            return parse_smi_query(out)
        out = probe.run([tool])
        if out:
            return parse_smi_table(out, physical_id)
    return None


def package_versions(probe: StackProbe) -> dict[str, str | None]:
    """``component -> version`` from the installed distributions (None when not installed)."""
    found: dict[str, str | None] = {}
    for component, names in DISTRIBUTIONS.items():
        found[component] = next((v for v in map(probe.version_of, names) if v), None)
    return found


def control_node_present(probe: StackProbe) -> bool:
    return (Path(probe.root) / CONTROL_NODE).exists()


def detect(probe: StackProbe | None = None, physical_id: int = 0) -> Detection:
    """Look for the host, the card and the stack; never raises for a missing piece, records it instead."""
    probe = probe or StackProbe()
    problems: list[str] = []
    control = control_node_present(probe)
    if not control:
        problems.append(f"{Path(probe.root) / CONTROL_NODE} does not exist: this is not a Kunlun host, or the "
                        f"container was started without --device=/dev/xpuctrl")
    smi = read_smi(probe, physical_id) if control else None
    if control and smi is None:
        problems.append("xpu-smi did not run: the Kunlun driver's tools are not on PATH (containers mount "
                        "/usr/local/bin/xpu-smi from the host)")
    try:
        module = probe.import_module(STACK_MODULE)
    except Exception as exc:  # noqa: BLE001 - an absent or broken vendor stack is a finding, not a crash
        module = None
        problems.append(f"{STACK_MODULE} is not importable ({type(exc).__name__}: {exc}); install the vendor's "
                        f"xpytorch build for this torch")
    versions: dict[str, str | None] = {"driver": smi.driver if smi else None,
                                       "runtime": smi.runtime if smi else None,
                                       **package_versions(probe),
                                       **{component: None for component in UNREADABLE}}
    return Detection(control_node=control, smi=smi, stack_module=module, versions=versions, problems=problems)
