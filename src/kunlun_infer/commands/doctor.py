"""``kunlun-infer doctor [overrides…]``: the six bring-up stages, stopping at the first failure.

Each stage prints pass/fail and its time; a failure names the layer
(framework, plugin, hardware), the plugin and hook at fault, what to check
next, and the pytest repro it wrote. ``--json`` prints the whole report.
Exit code 1 when a stage fails. The outcome, with every plugin's and the
stack's versions, is appended to the doctor record (``--record FILE``,
``--no-record``; see :mod:`kunlun_infer.tools.matrix_record`), which
``kunlun-infer plugins --matrix`` reads.
"""

from __future__ import annotations

import json
from typing import Any

from kunlun_infer.commands.base import Command, Flag, Invocation, Param
from kunlun_infer.tools import matrix_record as mr
from kunlun_infer.tools.doctor import run_doctor
from kunlun_infer.tools.doctor.report import DoctorReport
from kunlun_infer.tools.plugin_modules import REGISTER_PARAM


def _values(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise ValueError("expected positive integers separated by commas, e.g. 1,2,4,8,16")
    return values


def _stage(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 6:
        raise ValueError("expected a stage number from 1 to 6")
    return value


def run(inv: Invocation) -> int:
    as_json = inv.flags["json"]

    def live(result) -> None:  # each stage as soon as it finishes
        if not as_json:
            inv.print("\n".join(DoctorReport([result]).render()[:-2]), flush=True)

    manager = inv.plugin_manager(strict=False)
    report = run_doctor(inv.overrides, modules=inv.params["register"], plugin_manager=manager,
                        repro_dir=inv.flags["repro-dir"], sweep_values=inv.params["sweep"] or (1, 2, 4, 8, 16),
                        last_stage=inv.params["stages"] or 6, progress=False if inv.flags["no-progress"] else None,
                        on_stage=live)
    recorded = None if inv.flags["no-record"] else _record(inv, report, manager)
    if as_json:
        inv.print(json.dumps({**report.to_dict(), "recorded_in": recorded}, indent=2, default=str))
    else:
        not_run = [s for s in report.stages if s.status == "not run"]
        inv.print("\n".join(DoctorReport(not_run).render()[:-2] + report.render()[-2:]))
        if recorded:
            inv.print(f"recorded in {recorded} ('kunlun-infer plugins --matrix' compares later installs with it)")
    return 0 if report.ok else 1


def _record(inv: Invocation, report: Any, manager: Any) -> str | None:
    """Append the outcome to the doctor record; a record that cannot be written is a warning, not a failure."""
    path = mr.record_path(inv.flags["record"])
    if not report.config:  # the config did not compose: there is no combination to remember
        return None
    try:
        mr.append_entries(path, [mr.entry_from_report(report, manager)])
    except mr.RecordError as exc:
        print(f"warning: {exc}", file=inv.stderr)
        return None
    return str(path)


COMMAND = Command(
    name="doctor",
    summary="Bring-up stages: device, plugins, single-device inference, collectives, multi-device, tuning hint.",
    run=run,
    params=(Param("sweep", "values of scheduler.max_num_seqs for the stage-6 sweep (default 1,2,4,8,16)",
                  type=_values),
            Param("stages", "run stages 1..N only (default 6)", type=_stage),
            REGISTER_PARAM),
    flags=(Flag("json", "print the report as JSON"),
           Flag("repro-dir", "where failing stages write their pytest repro (default: a folder under the "
                             "system temp dir)", takes_value=True),
           Flag("no-progress", "no progress bars"),
           Flag("record", "the doctor record to append the outcome to (default: $KUNLUN_INFER_MATRIX_RECORD, else "
                          "$XDG_STATE_HOME/kunlun_infer/doctor-runs.jsonl)", takes_value=True),
           Flag("no-record", "do not append this run to the doctor record")),
    description="Stops at the first failing stage; exit code 1 then. Stages that do not apply (one device) "
                "say so and count as passed.",
)
