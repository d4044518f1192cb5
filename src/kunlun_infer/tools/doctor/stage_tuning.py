"""Stage 6: a short batch-size sweep and the ``scheduler.max_num_seqs`` it suggests.

The configured model is used when its folder has weights, the tiny model
otherwise (then the figures show the framework's overhead, not the model's
speed). The suggestion is the sweep's knee: the smallest value reaching 90 %
of the best output throughput.
"""

from __future__ import annotations

from pathlib import Path

from kunlun_infer.engine.startup import model_dir
from kunlun_infer.models import load_model_config
from kunlun_infer.tools.bench.sweep import run_sweep, sweep_table
from kunlun_infer.tools.bench.workload import LengthRange, synthetic_workload
from kunlun_infer.tools.doctor.context import DoctorContext
from kunlun_infer.tools.doctor.report import StageResult

NAME = "tuning hint: batch-size sweep and knee"
OUTPUT_LEN = 16


def _model(ctx: DoctorContext) -> tuple[list[str], Path, bool]:
    """Overrides for the sweep, the model folder, and whether it is the configured model."""
    try:
        folder = model_dir(ctx.cfg.model.path)
        if any(folder.glob("*.safetensors")):
            return list(ctx.overrides), folder, True
    except Exception:  # noqa: BLE001 - no usable model: the tiny one stands in
        pass
    folder = ctx.tiny_model(ctx.world_size)
    tiny = [f"model.path={folder}", "model.dtype=float32", "model.max_model_len=256", "model.tokenizer=null"]
    return [*ctx.overrides, *tiny], folder, False


def run(ctx: DoctorContext, result: StageResult) -> None:
    overrides, folder, configured = _model(ctx)
    vocab = load_model_config(folder).vocab_size
    values = sorted(set(ctx.sweep_values))
    workload = synthetic_workload(2 * max(values), LengthRange(16, 48), LengthRange(OUTPUT_LEN, OUTPUT_LEN),
                                  vocab_size=vocab, seed=ctx.seed)
    sweep = run_sweep(overrides, ctx.sweep_key, values, workload, plugin_manager=ctx.manager, runtime=ctx.runtime,
                      progress=ctx.progress)
    result.data["sweep"] = sweep
    result.data["suggested"] = {ctx.sweep_key: sweep["knee"]["value"]}
    result.details.append(f"model: {folder}" + ("" if configured else
                                                 " (tiny stand-in: no weights configured; figures show overhead)"))
    result.details += sweep_table(sweep)
    result.details.append(f"suggested: {ctx.sweep_key}={sweep['knee']['value']}")
