"""``kunlun-infer plugins``: the installed plugins — versions, API ranges, capabilities, load errors.

The table (or ``--json``, the version matrix) is always printed, even when a
plugin is broken: a broken plugin is a row with its error, never a crash.
"""

from __future__ import annotations

import json
from typing import Any

from kunlun_infer.commands.base import Command, Flag, Invocation
from kunlun_infer.commands.coverage import coverage_table, ops_coverage
from kunlun_infer.hookspecs import CAPABILITIES, HOOK_API_VERSION_STR


def matrix(manager: Any) -> dict[str, Any]:
    """Everything ``--json`` prints."""
    from kunlun_infer import __version__

    return {
        "framework": {"name": "kunlun-infer", "version": __version__, "hook_api": HOOK_API_VERSION_STR},
        "capabilities": {c: {opt: manager.factory(c, opt)[0] for opt in manager.options(c)} for c in CAPABILITIES},
        "plugins": manager.describe(),
        "skipped": [{"name": name, "reason": reason} for name, reason in manager.skipped],
        "ops_coverage": ops_coverage(manager),
    }


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def run(inv: Invocation) -> int:
    manager = inv.plugin_manager(strict=False)
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
    return 0


COMMAND = Command(
    name="plugins",
    summary="List installed plugins: versions, hook-API ranges, capabilities and options, load errors.",
    run=run,
    flags=(Flag("json", "print the version matrix as JSON (plugins, stack versions, load errors)"),),
    takes_overrides=False,
)
