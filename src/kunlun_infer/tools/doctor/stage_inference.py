"""Stage 3: single-device inference of a tiny model with the chosen ops equals the reference ops.

First every op the plugin serves is checked against its reference on the
conformance suite's sample inputs, in every dtype the device supports, and
so is its attention backend (when it has one) against the reference
backend. Then a tiny random Llama (written in-process) runs a scripted batch
with the plugin's ops and attention backend and with the reference ones and
the logits are compared; when they differ, the part at fault is found by
swapping plugin ops (or the backend) in one at a time. Last, the engine
generates greedily both ways and the tokens must agree. Every failure names
the op or backend and writes a pytest repro.
"""

from __future__ import annotations

from typing import Any

import torch

from kunlun_infer.dtypes import dtype_name
from kunlun_infer.engine.engine import LLMEngine
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.ops import OP_SPECS, TOLERANCES
from kunlun_infer.runtime import Runtime
from kunlun_infer.testing import ConformanceError, check_attention_backend, check_op
from kunlun_infer.tools.doctor.context import DoctorContext
from kunlun_infer.tools.doctor.model_check import (ATTENTION_UNIT, OpsRuntime, compare_logits, find_culprit,
                                                   mixed_table, plugin_serves_attention, run_logits)
from kunlun_infer.tools.doctor.report import Failure, StageFailed, StageResult
from kunlun_infer.tools.memory_plan import with_overrides
from kunlun_infer.tools.repro import Repro, write_repro

NAME = "single-device inference of a tiny model equals the reference ops"
PROMPTS = ([3, 14, 15, 92, 65], list(range(40, 80)), [2, 7, 1, 8, 2, 8, 1, 8, 2, 8])
MAX_TOKENS = 8


def _shapes(op: str, dtype: torch.dtype, device: torch.device, seed: int) -> list[str]:
    args, _ = OP_SPECS[op].sample(dtype, device, torch.Generator().manual_seed(seed))
    return [f"{tuple(a.shape)} {dtype_name(a.dtype)}" if isinstance(a, torch.Tensor) else repr(a) for a in args]


def _op_failure(ctx: DoctorContext, op: str, message: str, repro: Repro) -> StageFailed:
    plugin = ctx.runtime.plugin_for("ops")
    path = write_repro(repro, ctx.repro_dir)
    return StageFailed(Failure(
        layer="plugin", plugin=plugin, hook=f"ops.{op}", message=message, repro=str(path),
        next_steps=[f"compare plugin '{plugin}''s {op} with kunlun_infer.ops.reference.{op} (the op's definition)",
                    f"until it is fixed, run on the reference: leave '{op}' out of the plugin's supports()"]))


def _repro(ctx: DoctorContext, kind: str, op: str, summary: str, constants: dict[str, Any],
           tensors: dict[str, torch.Tensor] | None = None) -> Repro:
    return Repro(kind=kind, stage=3, stage_name=NAME, subject=op, summary=summary, layer="plugin",
                 plugin=ctx.runtime.plugin_for("ops"), hook=f"ops.{op}", overrides=list(ctx.overrides),
                 modules=list(ctx.modules), versions=ctx.plugin_versions(), constants=constants, tensors=tensors)


def _check_ops(ctx: DoctorContext, served: list[str], result: StageResult) -> None:
    device = ctx.runtime.device
    dtypes = [d for d in TOLERANCES if d in device.supported_dtypes()]
    for op in served:
        for dtype in dtypes:
            try:
                check_op(ctx.runtime.ops, op, dtype, device.torch_device, seed=ctx.seed)
            except Exception as exc:  # noqa: BLE001 - a mismatch or a crash of the kernel, both the op's fault
                text = str(exc) if isinstance(exc, ConformanceError) else f"{type(exc).__name__}: {exc}"
                constants = {"OP": op, "DTYPE": dtype_name(dtype), "SEED": ctx.seed,
                             "SHAPES": _shapes(op, dtype, torch.device("cpu"), ctx.seed)}
                raise _op_failure(ctx, op, f"on the conformance sample inputs: {text}",
                                  _repro(ctx, "op", op, text, constants)) from exc
    result.details.append(f"{len(served)} plugin op(s) match their references in "
                          f"{', '.join(dtype_name(d) for d in dtypes)}")


def _attention_failure(ctx: DoctorContext, message: str, repro: Repro) -> StageFailed:
    plugin = ctx.runtime.plugin_for("ops")
    path = write_repro(repro, ctx.repro_dir)
    return StageFailed(Failure(
        layer="plugin", plugin=plugin, hook="ops.attention_backend", message=message, repro=str(path),
        next_steps=[f"compare plugin '{plugin}''s attention backend with the reference backend "
                    f"(kunlun_infer.ops.reference_attention) on kunlun_infer.testing.check_attention_backend",
                    "until it is fixed, run on the reference backend: return None from the provider's "
                    "attention_backend()"]))


def _check_attention(ctx: DoctorContext, result: StageResult) -> None:
    device = ctx.runtime.device
    dtypes = [d for d in TOLERANCES if d in device.supported_dtypes()]
    for dtype in dtypes:
        try:
            checked = check_attention_backend(ctx.runtime.ops, device, dtypes=[dtype], seed=ctx.seed)
        except Exception as exc:  # noqa: BLE001 - a mismatch or a crash of the backend, both its fault
            text = str(exc) if isinstance(exc, ConformanceError) else f"{type(exc).__name__}: {exc}"
            constants = {"DTYPE": dtype_name(dtype), "SEED": ctx.seed}
            raise _attention_failure(ctx, f"on the conformance suite's script: {text}",
                                     _repro(ctx, "attention", "attention backend", text, constants)) from exc
        if checked:
            result.details.append(f"attention backend matches the reference backend in {dtype_name(dtype)} "
                                  f"({len(checked)} head shape(s))")


def _check_model(ctx: DoctorContext, served: list[str], plugin_attention: bool, result: StageResult) -> None:
    folder = ctx.tiny_model(1)
    reference = run_logits(ctx.runtime, folder, mixed_table(ctx.runtime, ()), seed=ctx.seed)
    chosen = run_logits(ctx.runtime, folder, mixed_table(ctx.runtime, tuple(served)), seed=ctx.seed,
                        plugin_attention=plugin_attention)
    difference = compare_logits(chosen, reference)
    if difference is None:
        result.details.append("tiny model: logits with the plugin's ops" + (" and attention backend" if
                              plugin_attention else "") + " equal the reference (chunked prefill and decode "
                              "over the paged KV cache)")
        return
    unit, unit_difference, capture = find_culprit(ctx.runtime, ctx.tiny_model(1), reference, served, seed=ctx.seed,
                                                  plugin_attention=plugin_attention)
    if unit is None:
        raise StageFailed(Failure(
            layer="plugin", plugin=ctx.runtime.plugin_for("ops"), hook="ops (combination)",
            message=f"tiny model: {difference}; no single plugin op causes it alone",
            next_steps=["look for ops that share state (caches written by store_kv, read by paged_attention)"]))
    if unit == ATTENTION_UNIT:
        message = f"tiny model with only the plugin's attention backend (reference ops): {unit_difference}"
        raise _attention_failure(ctx, message, _repro(ctx, "attention_model", "attention backend model", message,
                                                      {"SEED": ctx.seed}))
    op = unit[-1] if capture is None else capture.op
    message = f"tiny model with only '{' + '.join(unit)}' from the plugin: {unit_difference}"
    if capture is not None:
        tensors, spec = capture.tensors_and_spec()
        message += f"\nfirst differing call: {capture.message}"
        shapes = [f"{tuple(t.shape)} {dtype_name(t.dtype)}" for t in tensors.values()]
        repro = _repro(ctx, "op_inputs", op, message, {"OP": op, "DTYPE": dtype_name(torch.float32), "ARGS": spec,
                                                       "SHAPES": shapes}, tensors)
    else:
        repro = _repro(ctx, "op", op, message, {"OP": op, "DTYPE": "float32", "SEED": ctx.seed,
                                                "SHAPES": _shapes(op, torch.float32, torch.device("cpu"), ctx.seed)})
    raise _op_failure(ctx, op, message, repro)


def tiny_config(ctx: DoctorContext, folder: Any, **extra: Any) -> Any:
    """The run's config with the tiny model and a small engine (cache fixed, float32)."""
    keys = {"model__path": str(folder), "model__dtype": "float32", "model__max_model_len": 256,
            "model__tokenizer": None, "cache__num_blocks": 64, "cache__block_size": 16,
            "scheduler__max_num_seqs": 4, "scheduler__max_num_batched_tokens": 64, "parallel__tensor_size": 1}
    keys.update(extra)
    return with_overrides(ctx.cfg, **keys)


def greedy_tokens(cfg: Any, runtime: Runtime | None = None, prompts: Any = PROMPTS) -> list[list[int]]:
    """Greedy tokens of ``prompts`` from an engine on ``cfg`` (on ``runtime`` when given)."""
    engine = LLMEngine(cfg, runtime=runtime)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(list(p), params) for p in prompts]
        done: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        return [done[i] for i in ids]
    finally:
        engine.close()


def _check_engine(ctx: DoctorContext, result: StageResult) -> None:
    cfg = tiny_config(ctx, ctx.tiny_model(1))
    chosen = greedy_tokens(cfg, ctx.runtime)
    reference = greedy_tokens(cfg, OpsRuntime(ctx.runtime, mixed_table(ctx.runtime, ())))
    if chosen != reference:
        first = next(i for i, (a, b) in enumerate(zip(chosen, reference)) if a != b)
        raise StageFailed(Failure(
            layer="framework", plugin=None, hook=None,
            message=f"engine run: prompt {first} gives tokens {chosen[first]} with the chosen plugins and "
                    f"{reference[first]} with the reference ops, although the model's logits agree",
            next_steps=["check the memory plugin (KV cache tensors must not overlap) and the streams plugin",
                        "rerun with --debug and report it with the output"]))
    result.details.append(f"engine: greedy tokens of {len(PROMPTS)} prompts equal the reference-op run")


def run(ctx: DoctorContext, result: StageResult) -> None:
    coverage = {op: ctx.runtime.resolve_ops(list(OP_SPECS)).source(op) for op in OP_SPECS}
    served = [op for op, src in coverage.items() if src != "reference"]
    plugin_attention = plugin_serves_attention(ctx.runtime, ctx.tiny_model(1))
    result.data["served_ops"] = served
    result.data["attention_backend"] = "plugin" if plugin_attention else "reference"
    if served:
        _check_ops(ctx, served, result)
    else:
        result.details.append("the ops plugin serves no op: every op is the reference")
    _check_attention(ctx, result)
    _check_model(ctx, served, plugin_attention, result)
    _check_engine(ctx, result)
