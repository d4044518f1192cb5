"""``kunlun-infer plan [device_memory=80GiB] [tensor_sizes=1,2,4,8] [overrides…]``: the memory plan.

Prints where the device memory goes — weights, activation peak, comm
buffers, reserve — and the KV blocks and concurrency what remains allows, as
the engine will size them. ``device_memory`` (or ``--device-memory``) plans
for a card you do not have; otherwise the chosen device's free memory is
used. ``tensor_sizes`` adds a comparison of tensor-parallel sizes.
``--json`` prints the figures.
"""

from __future__ import annotations

import json
from typing import Any

from kunlun_infer.commands.base import Command, Flag, Invocation, Param, UsageError
from kunlun_infer.runtime import Runtime
from kunlun_infer.tools.memory_plan import make_plan, with_overrides
from kunlun_infer.tools.plugin_modules import REGISTER_PARAM, register_modules
from kunlun_infer.tools.sizes import format_bytes, parse_size


def _sizes(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise ValueError("expected positive integers separated by commas, e.g. 1,2,4,8")
    return values


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _render(plan: Any) -> list[str]:
    d = plan.to_dict()
    kv = d["kv"]
    activation = ("warm-up step" if d["activation_source"] == "measured" else "estimated from shapes, step")
    lines = [f"memory plan: {d['architecture']} ({_count(d['num_params'])} params) in {d['dtype']}, "
             f"parallel.tensor_size={d['tensor_size']}, per rank",
             f"  model: {d['model']}", ""]
    rows = [
        ("device memory", d["device_memory"], d["device_memory_source"]),
        (f"reserve (1 - cache.memory_fraction={d['memory_fraction']})", d["reserve"], "left alone"),
        ("usable", d["usable"], "memory_fraction × device memory"),
        ("  weights", d["weights"], (f"{_count(d['params_per_rank'])} params, quantized to {d['quantization']}"
                                     if d["quantization"] else
                                     f"{_count(d['params_per_rank'])} params × {d['bytes_per_param']} B")
                                    + (" (as loaded)" if d["weight_source"] == "loaded" else "")),
        ("  activation peak", d["activations"], f"{activation} of {d['warm_up_tokens']} tokens"),
        ("  comm buffers", d["comm_buffers"], f"comm={d['comm']}"),
        ("  KV cache", d["kv_cache"], "what remains"),
    ]
    width = max(len(r[0]) for r in rows)
    lines += [f"  {name:<{width}}  {format_bytes(value):>12}  {why}" for name, value, why in rows]
    if kv["kind"] == "mla":
        tensors = ", ".join(f"{t['name']} {tuple(t['shape'])} {t['dtype']}" for t in kv["layer_tensors"])
        lines += ["", f"KV per token (multi-head latent attention, backend '{kv['attention_backend']}'): "
                      f"{kv['num_layers']} layers × ({kv['kv_lora_rank']} latent + {kv['qk_rope_head_dim']} rotary "
                      f"key) × {d['bytes_per_param']} B = {format_bytes(kv['bytes_per_token'])}; per block of "
                      f"{kv['block_size']} tokens: {format_bytes(kv['bytes_per_block'])}",
                  f"  one latent per token serves all {kv['num_heads_per_rank']} heads of this rank; layout per layer: "
                  f"{tensors}"]
    elif kv["attention_backend"] == "reference":
        lines += ["", f"KV per token: 2 × {kv['num_layers']} layers × {kv['num_kv_heads_per_rank']} KV heads × "
                      f"{kv['head_dim']} head dim × {d['bytes_per_param']} B = {format_bytes(kv['bytes_per_token'])}; "
                      f"per block of {kv['block_size']} tokens: {format_bytes(kv['bytes_per_block'])}"]
    else:
        tensors = ", ".join(f"{t['name']} {tuple(t['shape'])} {t['dtype']}" for t in kv["layer_tensors"])
        lines += ["", f"KV cache layout of attention backend '{kv['attention_backend']}', per layer: {tensors}",
                  f"KV per block of {kv['block_size']} tokens over {kv['num_layers']} layers: "
                  f"{format_bytes(kv['bytes_per_block'])} ({format_bytes(kv['bytes_per_token'])} per token)"]
    if d["fits"]:
        lines += [f"KV blocks: {d['num_blocks']} ({d['kv_tokens']} tokens) — memory allows {d['blocks_by_memory']}, "
                  f"scheduler.max_num_seqs={d['max_num_seqs']} × model.max_model_len={d['max_model_len']} uses at "
                  f"most {d['blocks_by_concurrency']}",
                  f"concurrency at model.max_model_len={d['max_model_len']}: {d['max_concurrency']} sequences"]
    else:
        lines += ["KV blocks: none fit — lower the weights (tensor_size, dtype), the activation peak "
                  "(scheduler.max_num_batched_tokens), or raise cache.memory_fraction"]
    if d["pipeline"]:
        lines += ["", f"pipeline stages (parallel.pipeline_layers overrides the split):",
                  *(f"  {line}" for line in d["pipeline"].splitlines()),
                  *(f"  stage {s['stage']}: weights {format_bytes(s['weights'])}, KV per block "
                    f"{format_bytes(s['kv_bytes_per_block'])}, room for {s['num_blocks']} blocks" for s in d["stages"])]
    lines += [f"note: {n}" for n in d["notes"]]
    return lines


def _comparison(plans: list[Any]) -> list[str]:
    header = ["TP", "WEIGHTS/RANK", "KV/TOKEN/RANK", "KV BLOCKS", "KV TOKENS", "CONCURRENCY"]
    rows = [header] + [[str(p.tensor_size), format_bytes(p.weight_bytes), format_bytes(p.kv_bytes_per_token),
                        str(p.budget.num_blocks), str(p.budget.num_blocks * p.layout.block_size),
                        str(p.budget.max_concurrency)] for p in plans]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["", "by tensor-parallel size (each rank with the same device memory):"] + [
        "  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]


def run(inv: Invocation) -> int:
    given = inv.flags["device-memory"] or inv.params["device_memory"]
    if inv.flags["device-memory"] and inv.params["device_memory"]:
        raise UsageError("give the device memory once: device_memory=… or --device-memory …")
    device_memory = parse_size(given, what="device_memory") if given else None
    manager = inv.plugin_manager()
    register_modules(manager, inv.params["register"], strict=True)
    cfg = inv.config()
    runtime = None
    try:
        runtime = Runtime.from_config(cfg, plugin_manager=manager)
    except Exception as exc:  # noqa: BLE001 - a card you do not have needs no runtime
        if device_memory is None:
            raise
        print(f"device '{cfg.device.name}' not available ({exc}); planning without it", file=inv.stderr)
    try:
        plan = make_plan(cfg, device_memory=device_memory, runtime=runtime, measure=not inv.flags["estimate"],
                         plugin_manager=manager)
        others = [make_plan(with_overrides(cfg, parallel__tensor_size=n), device_memory=device_memory,
                            runtime=runtime, measure=False, plugin_manager=manager)
                  for n in inv.params["tensor_sizes"] or ()]
    finally:
        if runtime is not None:
            runtime.close()
    if inv.flags["json"]:
        data = plan.to_dict()
        if others:
            data["by_tensor_size"] = [p.to_dict() for p in others]
        inv.print(json.dumps(data, indent=2))
    else:
        lines = _render(plan) + (_comparison(others) if others else [])
        inv.print("\n".join(lines))
    return 0 if plan.fits else 1


COMMAND = Command(
    name="plan",
    summary="Memory plan: weights, activations, comm buffers, reserve, and the KV blocks and concurrency left.",
    run=run,
    params=(Param("device_memory", "plan for this much memory per device (80GiB, 24GB, bytes) instead of the "
                                   "chosen device's free memory"),
            Param("tensor_sizes", "also compare these tensor-parallel sizes (1,2,4,8)", type=_sizes),
            REGISTER_PARAM),
    flags=(Flag("device-memory", "same as device_memory=…", takes_value=True),
           Flag("estimate", "estimate the activation peak from the model's shapes instead of a warm-up step"),
           Flag("json", "print the plan as JSON")),
    description="Exit code 1 when not even one KV block fits.",
)
