"""``kunlun-infer doctor``: six bring-up stages, in order, stopping at the first failure.

1 device opens, a tensor round-trips, memory allocates and frees · 2 chosen
plugins load, versions and hook API match (version matrix, op coverage) ·
3 tiny-model inference with the chosen ops equals the reference ops · 4
collectives exact on every rank · 5 multi-device inference equals
single-device · 6 batch-size sweep and suggested ``scheduler.max_num_seqs``.
:func:`run_doctor` returns a :class:`DoctorReport`; a failing stage names
layer, plugin and hook, says what to check next and writes a pytest repro.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kunlun_infer.runtime import PluginManager
from kunlun_infer.tools.doctor import (stage_collectives, stage_device, stage_inference, stage_parallel,
                                       stage_plugins, stage_tuning)
from kunlun_infer.tools.doctor.blame import blame
from kunlun_infer.tools.doctor.context import DoctorContext
from kunlun_infer.tools.doctor.report import (FAIL, NOT_APPLICABLE, PASS, DoctorReport, Failure, NotApplicable,
                                              StageFailed, StageResult)
from kunlun_infer.tools.plugin_modules import register_modules
from kunlun_infer.tools.repro import Repro, default_repro_dir, write_repro

#: (number, name, run) of every stage, in order
STAGES: tuple[tuple[int, str, Callable[[DoctorContext, StageResult], None]], ...] = (
    (1, stage_device.NAME, stage_device.run),
    (2, stage_plugins.NAME, stage_plugins.run),
    (3, stage_inference.NAME, stage_inference.run),
    (4, stage_collectives.NAME, stage_collectives.run),
    (5, stage_parallel.NAME, stage_parallel.run),
    (6, stage_tuning.NAME, stage_tuning.run),
)

__all__ = ["STAGES", "DoctorReport", "Failure", "StageResult", "run_doctor"]


def _run_stage(ctx: DoctorContext, result: StageResult, run: Callable[[DoctorContext, StageResult], None]) -> None:
    started = time.perf_counter()
    try:
        run(ctx, result)
        result.status = PASS
    except NotApplicable as na:
        result.status, result.reason = NOT_APPLICABLE, str(na)
    except StageFailed as failed:
        result.status, result.failure = FAIL, failed.failure
    except Exception as exc:  # noqa: BLE001 - any other error is this stage's failure, attributed
        result.status = FAIL
        if result.number == 1 and ctx.manager.load_errors and ctx.cfg is None:
            result.failure = stage_plugins.loading_failure(ctx, exc)
        else:
            result.failure = blame(exc)
    finally:
        result.seconds = time.perf_counter() - started
    if result.failure is not None and result.failure.repro is None and result.number in _GENERIC_REPROS:
        result.failure.repro = _write_generic_repro(ctx, result)


#: repro kinds for stages whose checks need no recorded inputs
_GENERIC_REPROS = {1: "device", 2: "plugins"}


def _write_generic_repro(ctx: DoctorContext, result: StageResult) -> str | None:
    f = result.failure
    repro = Repro(kind=_GENERIC_REPROS[result.number], stage=result.number, stage_name=result.name,
                  subject=f.plugin or _GENERIC_REPROS[result.number], summary=f.message, layer=f.layer,
                  plugin=f.plugin, hook=f.hook, overrides=list(ctx.overrides), modules=list(ctx.modules),
                  versions=ctx.plugin_versions())
    try:
        return str(write_repro(repro, ctx.repro_dir))
    except OSError:  # an unwritable repro folder must not hide the finding itself
        return None


def run_doctor(overrides: Sequence[str] = (), *, modules: Sequence[str] = (), plugin_manager: Any = None,
               repro_dir: str | Path | None = None, sweep_values: Sequence[int] = (1, 2, 4, 8, 16),
               last_stage: int = 6, progress: bool | None = None, seed: int = 0,
               on_stage: Callable[[StageResult], None] | None = None) -> DoctorReport:
    """Run stages 1..``last_stage`` for the config of ``overrides``; stop at the first failure.

    ``modules``: import paths of plugin modules registered by code (a
    module that does not fit is stage 2's finding). ``plugin_manager``: use
    this one instead of loading the installed plugins. ``repro_dir``: where
    repros of failures go (default: a folder under the system temp dir).
    ``on_stage`` is called after each stage (for live output).
    """
    manager = plugin_manager if plugin_manager is not None else PluginManager.load(strict=False)
    register_modules(manager, modules, strict=False)
    ctx = DoctorContext(overrides=[str(o) for o in overrides], modules=list(modules), manager=manager,
                        repro_dir=Path(repro_dir) if repro_dir is not None else default_repro_dir(),
                        sweep_values=tuple(sweep_values), progress=progress, seed=seed)
    results = [StageResult(number, name) for number, name, _ in STAGES if number <= last_stage]
    report = DoctorReport(results)
    try:
        ctx.compose()
        if ctx.cfg is not None:
            report.config = {c: str(ctx.cfg[c].name) for c in ("device", "memory", "ops", "comm", "streams")}
        for result, (_, _, run) in zip(results, STAGES):
            _run_stage(ctx, result, run)
            if on_stage is not None:
                on_stage(result)
            if result.status == FAIL:
                break
    finally:
        ctx.close()
    return report

