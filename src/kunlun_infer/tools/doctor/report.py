"""What a doctor run found: one result per stage, and for a failure who is at fault and what to check.

A failure names the *layer* (``framework``, ``plugin`` or ``hardware``), the
plugin and the hook at fault, the facts (``message``), the next things to
check, and the path of the pytest repro written for it. The report renders
as text for people and as a dict for ``--json``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

LAYERS = ("framework", "plugin", "hardware")
PASS, FAIL, NOT_APPLICABLE, NOT_RUN = "pass", "fail", "not applicable", "not run"


@dataclasses.dataclass
class Failure:
    """Why a stage failed and where to look."""

    layer: str
    message: str
    plugin: str | None = None
    hook: str | None = None
    next_steps: list[str] = dataclasses.field(default_factory=list)
    repro: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class StageFailed(Exception):
    """Raised by a stage to stop the run with a :class:`Failure`."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class NotApplicable(Exception):
    """Raised by a stage that does not apply to this configuration; the message says why."""


@dataclasses.dataclass
class StageResult:
    """The outcome of one stage: status, seconds, what it saw (``details``, ``data``) and any failure."""

    number: int
    name: str
    status: str = NOT_RUN
    seconds: float = 0.0
    details: list[str] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    failure: Failure | None = None
    reason: str | None = None  #: why a stage is not applicable

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, "name": self.name, "status": self.status,
                "seconds": round(self.seconds, 4), "details": list(self.details), "data": self.data,
                "reason": self.reason, "failure": self.failure.to_dict() if self.failure else None}


@dataclasses.dataclass
class DoctorReport:
    """Every stage, in order; stages after the first failure are ``not run``."""

    stages: list[StageResult]
    config: dict[str, str] = dataclasses.field(default_factory=dict)  #: capability → chosen option

    @property
    def ok(self) -> bool:
        return all(s.status in (PASS, NOT_APPLICABLE) for s in self.stages)

    @property
    def failed(self) -> StageResult | None:
        return next((s for s in self.stages if s.status == FAIL), None)

    def to_dict(self) -> dict[str, Any]:
        failed = self.failed
        return {"ok": self.ok, "failed_stage": failed.number if failed else None, "config": dict(self.config),
                "stages": [s.to_dict() for s in self.stages]}

    def render(self) -> list[str]:
        """Human-readable lines: one headline per stage, its details, and the failure in full."""
        lines = []
        for s in self.stages:
            mark = {PASS: "PASS", FAIL: "FAIL", NOT_APPLICABLE: "N/A ", NOT_RUN: "----"}[s.status]
            took = f"{s.seconds:.2f} s" if s.seconds >= 1 else f"{s.seconds * 1e3:.0f} ms"
            timing = f" ({took})" if s.status in (PASS, FAIL, NOT_APPLICABLE) else ""
            suffix = f": {s.reason}" if s.status == NOT_APPLICABLE and s.reason else ""
            lines.append(f"[{mark}] stage {s.number}: {s.name}{timing}{suffix}")
            if s.status in (PASS, FAIL):
                lines += [f"       {d}" for d in s.details]
            if s.failure is not None:
                f = s.failure
                where = ", ".join(x for x in (f"layer: {f.layer}", f"plugin: {f.plugin}" if f.plugin else "",
                                              f"hook: {f.hook}" if f.hook else "") if x)
                lines.append(f"       failure ({where})")
                lines += [f"         {line}" for line in f.message.splitlines()]
                if f.next_steps:
                    lines.append("       check next:")
                    lines += [f"         - {step}" for step in f.next_steps]
                if f.repro:
                    lines.append(f"       repro: {f.repro}  (run: pytest {f.repro})")
        failed = self.failed
        lines.append("")
        lines.append("doctor: all stages passed" if failed is None else
                     f"doctor: stopped at stage {failed.number} ({failed.name})")
        return lines
