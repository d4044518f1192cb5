"""Stage 2: every chosen plugin loads, its hook-API range admits this framework, the runtime composes.

Prints the version matrix (framework, then per capability: option, plugin,
version, distribution, API range, the stack beneath) and the op coverage:
which ops the ops plugin serves and which fall back to the plain-torch
reference. A plugin that failed to load is at fault when the config chose
one of its options; broken plugins the config does not use are listed as
warnings.
"""

from __future__ import annotations

from typing import Any

from kunlun_infer.hookspecs import CAPABILITIES, HOOK_API_VERSION_STR
from kunlun_infer.ops import OP_SPECS
from kunlun_infer.runtime import Runtime
from kunlun_infer.runtime.versions import api_range_admits
from kunlun_infer.tools.doctor.blame import blame
from kunlun_infer.tools.doctor.context import DoctorContext, capability_choices
from kunlun_infer.tools.doctor.report import Failure, StageFailed, StageResult
from kunlun_infer.version import __version__

NAME = "chosen plugins load; versions and hook API match"


def _culprit(ctx: DoctorContext) -> Any:
    """The load error behind a failed composition, and the capability choice it breaks (if one does)."""
    for capability, option in capability_choices(ctx.overrides).items():
        if option not in ctx.manager.options(capability):
            error = ctx.manager.load_error_for(option) or ctx.manager.load_errors[0]
            return capability, option, error
    return None, None, ctx.manager.load_errors[0]


def loading_failure(ctx: DoctorContext, cause: BaseException | None = None) -> Failure:
    """The failure for a config that cannot compose because a plugin did not load."""
    capability, option, error = _culprit(ctx)
    plugin = error.error.plugin or error.name
    dist = f"{error.distribution} {error.distribution_version}" if error.distribution else "registered by code"
    chosen = f"the config chooses {capability}={option}, but " if capability else ""
    message = f"{chosen}plugin '{plugin}' ({dist}) did not load: {error.message}"
    if cause is not None:
        message += f"\ncomposition: {cause}"
    steps = [f"install a release of '{plugin}' that supports hook API {HOOK_API_VERSION_STR} "
             f"(kunlun-infer plugins shows every plugin's API range)"]
    if capability:
        others = ctx.manager.options(capability)
        steps.append(f"or choose another {capability} option: {', '.join(others) or 'none available'}")
    if error.distribution is not None:
        steps.append(f"or leave it out with KUNLUN_INFER_DISABLE_PLUGINS={error.name}")
    return Failure(layer="plugin", message=message, plugin=plugin, hook=error.error.hook or "load",
                   next_steps=steps)


def version_matrix(ctx: DoctorContext) -> list[dict[str, Any]]:
    """One row per capability: the chosen option and everything known about its plugin."""
    rows = []
    for capability in CAPABILITIES:
        option = str(ctx.cfg[capability].name)
        name, _ = ctx.manager.factory(capability, option)
        p = ctx.manager.plugins[name]
        rows.append({"capability": capability, "option": option, "plugin": p.name, "version": p.info.version,
                     "distribution": f"{p.distribution} {p.distribution_version}" if p.distribution else p.source,
                     "api": p.info.api, "api_ok": api_range_admits(p.info.api), "stack": dict(p.info.stack)})
    return rows


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def op_coverage(runtime: Runtime) -> dict[str, str]:
    """``{op: source}`` for every op of the table: the ops plugin's name, or ``reference``."""
    table = runtime.resolve_ops(list(OP_SPECS))
    return {op: table.source(op) for op in OP_SPECS}


def run(ctx: DoctorContext, result: StageResult) -> None:
    if ctx.cfg is None:
        raise StageFailed(loading_failure(ctx, ctx.compose_error))
    matrix = version_matrix(ctx)
    result.data["framework"] = {"version": __version__, "hook_api": HOOK_API_VERSION_STR}
    result.data["matrix"] = matrix
    result.details.append(f"kunlun-infer {__version__}, hook API {HOOK_API_VERSION_STR}")
    rows = [["CAPABILITY", "OPTION", "PLUGIN", "VERSION", "FROM", "API", "STACK"]]
    rows += [[r["capability"], r["option"], r["plugin"], r["version"], r["distribution"],
              r["api"] + ("" if r["api_ok"] else " (MISMATCH)"),
              ", ".join(f"{k} {v}" for k, v in r["stack"].items()) or "-"] for r in matrix]
    result.details += _table(rows)
    for row in matrix:
        if not row["api_ok"]:
            raise StageFailed(Failure(
                layer="plugin", plugin=row["plugin"], hook="kunlun_infer_plugin_info",
                message=f"plugin '{row['plugin']}' {row['version']} supports hook API '{row['api']}', this "
                        f"framework offers {HOOK_API_VERSION_STR}",
                next_steps=[f"install a release of '{row['plugin']}' that supports hook API {HOOK_API_VERSION_STR}"]))
    chosen = {r["plugin"] for r in matrix}
    unused = [e for e in ctx.manager.load_errors if e.name not in chosen]
    result.data["unused_load_errors"] = [{"name": e.name, "error": e.message} for e in unused]
    result.details += [f"warning: plugin '{e.name}' (not chosen) did not load: {e.message}" for e in unused]
    try:
        ctx.runtime = Runtime.from_config(ctx.cfg, plugin_manager=ctx.manager)
    except Exception as exc:  # noqa: BLE001 - attributed below
        raise StageFailed(blame(exc, next_steps=["run the conformance suite for this plugin: pytest --pyargs "
                                                 "kunlun_infer.testing.suite --kunlun-plugin '<overrides>'"])) from exc
    try:
        coverage = op_coverage(ctx.runtime)
    except Exception as exc:  # noqa: BLE001 - ops.strict refusals and broken supports()
        raise StageFailed(blame(exc, plugin=ctx.runtime.plugin_for("ops"), hook="ops.supports",
                                next_steps=["set ops.strict=false to run on reference fallbacks, or choose an "
                                            "ops plugin that covers the model's ops"])) from exc
    result.data["op_coverage"] = coverage
    ops_plugin = ctx.runtime.plugin_for("ops")
    served = [op for op, src in coverage.items() if src != "reference"]
    fallback = [op for op, src in coverage.items() if src == "reference"]
    result.details.append(f"op coverage: {len(served)} of {len(coverage)} ops from plugin '{ops_plugin}': "
                          f"{', '.join(served) or 'none'}")
    result.details.append(f"reference fallbacks (plain torch): {', '.join(fallback) or 'none'}")

