"""Stage 5: multi-device inference equals single-device inference.

A tiny random Llama whose heads split over ``parallel.tensor_size`` ranks is
run greedily by the engine at that size and at size 1, with the same chosen
plugins; the generated tokens must be identical. With one rank there is
nothing to compare.
"""

from __future__ import annotations

from kunlun_infer.tools.doctor.blame import blame
from kunlun_infer.tools.doctor.context import DoctorContext
from kunlun_infer.tools.doctor.report import Failure, NotApplicable, StageFailed, StageResult
from kunlun_infer.tools.doctor.stage_inference import MAX_TOKENS, PROMPTS, greedy_tokens, tiny_config
from kunlun_infer.tools.repro import Repro, write_repro

NAME = "multi-device inference equals single-device"


def run(ctx: DoctorContext, result: StageResult) -> None:
    world = ctx.world_size
    if world <= 1:
        raise NotApplicable("world size 1 (set parallel.tensor_size=N to compare N devices with one)")
    folder = ctx.tiny_model(world)
    single = greedy_tokens(tiny_config(ctx, folder), ctx.runtime)
    try:
        multi = greedy_tokens(tiny_config(ctx, folder, parallel__tensor_size=world))
    except Exception as exc:  # noqa: BLE001 - attributed below
        raise StageFailed(blame(exc, next_steps=[
            f"run stage 4 alone to see whether the collectives work: kunlun-infer doctor parallel.tensor_size={world}",
            "rerun with --debug for the worker's traceback"])) from exc
    if multi != single:
        first = next(i for i, (a, b) in enumerate(zip(multi, single)) if a != b)
        message = (f"prompt {first}: tensor_size={world} generates {multi[first]}, tensor_size=1 generates "
                   f"{single[first]} (greedy, same model and plugins)")
        repro = Repro(kind="tensor_parallel", stage=5, stage_name=NAME, subject=f"tp{world}", summary=message,
                      layer="framework", plugin=None, hook=None, overrides=list(ctx.overrides),
                      modules=list(ctx.modules), versions=ctx.plugin_versions(),
                      constants={"WORLD_SIZE": world, "SEED": ctx.seed, "MAX_TOKENS": MAX_TOKENS,
                                 "PROMPTS": [list(p) for p in PROMPTS]})
        path = write_repro(repro, ctx.repro_dir)
        comm = ctx.runtime.plugin_for("comm")
        raise StageFailed(Failure(
            layer="framework", message=message, repro=str(path), next_steps=[
                "rerun with ops=torch (plain-torch kernels): if that passes, the ops plugin misbehaves on sharded "
                "shapes",
                f"check comm.accumulate_dtype and the comm plugin '{comm}''s all_reduce on larger tensors"]))
    result.details.append(f"greedy tokens of {len(PROMPTS)} prompts identical at tensor_size={world} and 1")
