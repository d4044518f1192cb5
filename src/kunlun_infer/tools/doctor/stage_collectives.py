"""Stage 4: collectives across the configured world size give exact results on every rank.

``parallel.tensor_size`` processes are spawned, each building the runtime
from the same overrides and joining the comm group; all_reduce (float32,
int64, bf16/fp16 accumulated in float32), all_gather, broadcast and barrier
are checked exactly on every rank (the conformance suite's collective
checks). With one rank there is nothing to check.
"""

from __future__ import annotations

import re

from kunlun_infer.testing import check_collectives
from kunlun_infer.tools.doctor.context import DoctorContext
from kunlun_infer.tools.doctor.report import Failure, NotApplicable, StageFailed, StageResult
from kunlun_infer.tools.repro import Repro, write_repro

NAME = "collectives exact on every rank"
_COLLECTIVE = re.compile(r"comm: (\w+)\(([^)]*)\)")


def run(ctx: DoctorContext, result: StageResult) -> None:
    world = ctx.world_size
    if world <= 1:
        raise NotApplicable("world size 1 (set parallel.tensor_size=N to check N ranks)")
    plugin = ctx.runtime.plugin_for("comm")
    timeout = float(ctx.cfg.comm.timeout_s)
    try:
        check_collectives(ctx.overrides, world_size=world, modules=ctx.modules, timeout_s=timeout + 60)
    except Exception as exc:  # noqa: BLE001 - a wrong result, a crash or a hang on some rank
        text = str(exc).split("\nTraceback", 1)[0]  # the ranks' tracebacks point into the checker itself
        match = _COLLECTIVE.search(text)
        collective = match.group(1) if match else "collectives"
        hung = "within" in text and "reported" in text
        repro = Repro(kind="collectives", stage=4, stage_name=NAME, subject=collective, summary=text,
                      layer="hardware" if hung else "plugin", plugin=plugin, hook=f"comm.{collective}",
                      overrides=list(ctx.overrides), modules=list(ctx.modules), versions=ctx.plugin_versions(),
                      constants={"WORLD_SIZE": world, "COLLECTIVE": match.group(0) if match else None})
        path = write_repro(repro, ctx.repro_dir)
        steps = ["compare with the built-in gloo collectives: kunlun-infer doctor comm=gloo "
                 f"parallel.tensor_size={world}"]
        if hung:
            steps.insert(0, "a rank never reported: check the interconnect / network between the devices, "
                            "firewall on the rendezvous port, and that every rank sees its own device")
        raise StageFailed(Failure(layer=repro.layer, plugin=plugin, hook=f"comm.{collective}", message=text,
                                  next_steps=steps, repro=str(path))) from exc
    result.details.append(f"all_reduce (float32, int64, bf16/fp16 via float32), all_gather, broadcast, barrier "
                          f"exact on {world} ranks (comm plugin {plugin})")
