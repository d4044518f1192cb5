"""``kunlun-infer plugins``: the installed plugins — versions, API ranges, capabilities, load errors.

The table (or ``--json``, the version matrix) is always printed, even when a
plugin is broken: a broken plugin is a row with its error, never a crash.
``--matrix`` answers from the doctor record (:mod:`kunlun_infer.tools.matrix_record`)
whether each recorded config passed here before with the plugins installed
now, failed (at which stage), or is new; ``--export FILE`` / ``--import FILE``
share the record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kunlun_infer.commands.base import Command, Flag, Invocation
from kunlun_infer.commands.coverage import ATTENTION_PROBE, MLA_PROBE, coverage_table, ops_coverage
from kunlun_infer.hookspecs import CAPABILITIES, HOOK_API_VERSION_STR
from kunlun_infer.tools import matrix_record as mr
from kunlun_infer.version import __version__


def matrix(manager: Any) -> dict[str, Any]:
    """Everything ``--json`` prints."""
    return {
        "framework": {"name": "kunlun-infer", "version": __version__, "hook_api": HOOK_API_VERSION_STR},
        "capabilities": {c: {opt: manager.factory(c, opt)[0] for opt in manager.options(c)} for c in CAPABILITIES},
        "logits_processors": {opt: manager.factory("logits_processor", opt)[0]
                              for opt in manager.options("logits_processor")},
        "plugins": manager.describe(),
        "skipped": [{"name": name, "reason": reason} for name, reason in manager.skipped],
        "ops_coverage": ops_coverage(manager),
    }


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _config_text(config: dict[str, str]) -> str:
    return " ".join(f"{c}={o}" for c, o in config.items())


def _run_text(entry: dict[str, Any]) -> str:
    stages = entry.get("stages_run") or []
    span = f"stages {stages[0]}-{stages[-1]}" if len(stages) > 1 else f"stage {stages[0]}" if stages else "no stage"
    return f"{entry['when']} on {entry.get('host', '?')}, {span}"


def _status_lines(answer: Any) -> list[str]:
    """Two or three lines for one config of ``plugins --matrix``."""
    head = {"passed": "passed", "failed": "FAILED", "new": "new", "not installed": "n/a"}[answer.status]
    lines = [f"{head:<8}{_config_text(answer.config)}"]
    if answer.status in ("passed", "failed"):
        lines.append(f"        last run {_run_text(answer.last)}; {answer.passed_runs} of {answer.runs} run(s) "
                     f"with these plugins passed")
        failure = answer.last.get("failure") if answer.status == "failed" else None
        if failure:
            lines.append(f"        at stage {failure['stage']} ({failure['name']}), layer {failure['layer']}"
                         + (f", plugin {failure['plugin']}" if failure.get("plugin") else "")
                         + f": {failure['message']}")
    elif answer.status == "new":
        prev = answer.previous
        lines.append(f"        never run with the plugins installed now; its last run ({prev['outcome']}, "
                     f"{_run_text(prev)}) differs in:")
        lines += [f"          {change}" for change in answer.changes or ["(nothing the record can show)"]]
    else:
        lines.append(f"        cannot run here: no installed plugin serves {', '.join(answer.missing)}")
    return lines


def _record(inv: Invocation, manager: Any) -> int:
    """``--import``, ``--export`` and ``--matrix``, in that order."""
    path = mr.record_path(inv.flags["record"])
    if inv.flags["import"]:
        added, present = mr.import_record(path, Path(inv.flags["import"]).expanduser())
        inv.print(f"imported {added} doctor run(s) into {path} ({present} already there)")
    if inv.flags["export"]:
        count = mr.export_record(path, Path(inv.flags["export"]).expanduser())
        inv.print(f"exported {count} doctor run(s) from {path} to {inv.flags['export']}")
    if not inv.flags["matrix"]:
        return 0
    entries = mr.read_record(path)
    now = mr.installed(manager)
    answers = mr.matrix_status(entries, now)
    if inv.flags["json"]:
        inv.print(json.dumps({"record": str(path), "runs": len(entries), "installed": now,
                              "configs": [a.to_dict() for a in answers]}, indent=2, default=str))
        return 0
    fw = now["framework"]
    inv.print(f"doctor record: {path} ({len(entries)} run(s))")
    inv.print(f"installed now: kunlun-infer {fw['kunlun-infer']} (hook API {fw['hook_api']}), "
              + ", ".join(f"{name} {p['version'] or 'not loaded'}" for name, p in sorted(now["plugins"].items())))
    inv.print("")
    for answer in answers:
        inv.print("\n".join(_status_lines(answer)))
    if not answers:
        inv.print("no doctor run recorded yet: every config is new here.")
    inv.print("\na config not listed is new here: 'kunlun-infer doctor <overrides>' checks it and records the outcome")
    return 0


def run(inv: Invocation) -> int:
    manager = inv.plugin_manager(strict=False)
    if inv.flags["matrix"] or inv.flags["export"] or inv.flags["import"]:
        return _record(inv, manager)
    data = matrix(manager)
    if inv.flags["json"]:
        inv.print(json.dumps(data, indent=2, sort_keys=False))
        return 0
    fw = data["framework"]
    inv.print(f"kunlun-infer {fw['version']} (hook API {fw['hook_api']})\n")
    rows = [["PLUGIN", "VERSION", "DISTRIBUTION", "API", "PROVIDES", "STATUS"]]
    for p in data["plugins"]:
        provides = "; ".join(f"{c}={','.join(opts)}" for c, opts in p["options"].items()) or "-"
        dist = f"{p['distribution']} {p['distribution_version']}" if p["distribution"] else p["source"]
        status = "ok" if p["error"] is None else "FAILED"
        rows.append([p["name"], p["version"] or "-", dist, p["api"] or "-", provides, status])
    inv.print(_table(rows))
    stacks = [(p["name"], ", ".join(f"{k} {v}" for k, v in p["stack"].items())) for p in data["plugins"]
              if p["stack"]]
    if stacks:
        inv.print("\nwhat each plugin runs on (its stack):")
        for name, stack in stacks:
            inv.print(f"  {name}: {stack}")
    failed = [p for p in data["plugins"] if p["error"]]
    if failed:
        inv.print("\nload errors:")
        for p in failed:
            inv.print(f"  {p['name']}: {p['error']}")
    for s in data["skipped"]:
        inv.print(f"\nskipped: {s['name']} ({s['reason']})")
    coverage = data["ops_coverage"]
    if coverage:
        inv.print("\nop coverage (the plugin serving each op; 'reference' = plain-torch fallback):")
        inv.print(_table(coverage_table(coverage)))
        for option, entry in coverage.items():
            if entry["error"]:
                inv.print(f"  ops={option}: coverage unknown: {entry['error']}")
        probe = ATTENTION_PROBE
        inv.print(f"\nattention backend for {probe.num_heads} query / {probe.num_kv_heads} kv heads of "
                  f"{probe.head_dim}, {str(probe.dtype).removeprefix('torch.')} ('reference' = the op table's "
                  f"store_kv and paged_attention):")
        for option, entry in coverage.items():
            inv.print(f"  ops={option}: {'?' if entry['error'] else entry['attention']}")
        mla = MLA_PROBE
        inv.print(f"\nMLA attention (multi-head latent: {mla.num_heads} heads, latent {mla.kv_lora_rank} + rotary key "
                  f"{mla.qk_rope_head_dim}, {str(mla.dtype).removeprefix('torch.')}; 'reference' = the framework's "
                  f"plain-torch MLA backend):")
        for option, entry in coverage.items():
            inv.print(f"  ops={option}: {'?' if entry['error'] else entry['mla_attention']}")
    return 0


COMMAND = Command(
    name="plugins",
    summary="List installed plugins: versions, hook-API ranges, capabilities and options, load errors.",
    run=run,
    flags=(Flag("json", "print the version matrix as JSON (plugins, stack versions, load errors)"),
           Flag("matrix", "for the plugins installed now: did each config the doctor record knows pass here "
                          "before, fail (at which stage), or is it new"),
           Flag("export", "write the doctor record to FILE (JSON lines) to share it", takes_value=True),
           Flag("import", "add the runs of FILE (written by --export) to the doctor record", takes_value=True),
           Flag("record", "the doctor record to use (default: $KUNLUN_INFER_MATRIX_RECORD, else "
                          "$XDG_STATE_HOME/kunlun_infer/doctor-runs.jsonl)", takes_value=True)),
    takes_overrides=False,
)
