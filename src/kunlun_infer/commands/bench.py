"""``kunlun-infer bench [num_prompts=…] [input_len=…] [output_len=…] [--sweep KEY=V1,V2,…] [overrides…]``.

Offline throughput and latency: a seeded synthetic workload (lengths ``N`` or
``LOW:HIGH``) or the prompts of a JSONL file (``prompts_file=``), all sent at
once, greedy, EOS ignored. Prints input and output tokens/s, time to first
token and per-token latency at p50/p90/p99, peak memory and KV utilization.
``--sweep`` runs the workload at each value of a config key, prints a table,
finds the knee and writes ``<out>/bench-sweep.json`` and ``bench-sweep.png``.
Every engine first serves an untimed warm-up of the same lengths with other
tokens (compiles, graph captures and first allocations are not measured);
``--no-warmup`` measures from cold.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kunlun_infer.commands.base import Command, Flag, Invocation, Param, UsageError
from kunlun_infer.engine.parallel.placement import resolve_parallel_config, torchrun_place
from kunlun_infer.engine.parallel.worker import serve_torchrun_worker
from kunlun_infer.engine.startup import model_dir
from kunlun_infer.models import load_model_config
from kunlun_infer.runtime import Runtime
from kunlun_infer.tools.bench.plot import plot_sweep
from kunlun_infer.tools.bench.run import run_bench
from kunlun_infer.tools.bench.sweep import parse_sweep, run_sweep, sweep_table
from kunlun_infer.tools.bench.workload import LengthRange, jsonl_workload, synthetic_workload
from kunlun_infer.tools.plugin_modules import REGISTER_PARAM, register_modules
from kunlun_infer.tools.sizes import format_bytes


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError("expected a fraction in (0, 1], e.g. 0.9")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("expected a positive integer")
    return value


def _workload(inv: Invocation, cfg: Any) -> Any:
    p = inv.params
    output_len = LengthRange.parse(p["output_len"], what="output_len")
    if p["prompts_file"]:
        return jsonl_workload(p["prompts_file"], output_len, seed=p["seed"], num_prompts=p["num_prompts"])
    vocab = load_model_config(model_dir(cfg.model.path)).vocab_size
    return synthetic_workload(p["num_prompts"] or 64, LengthRange.parse(p["input_len"], what="input_len"),
                              output_len, vocab_size=vocab, seed=p["seed"])


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f} ms"


def _render(result: Any, workload: Any) -> list[str]:
    d = result.to_dict()
    warmup = ("none: measured from cold" if d["warmup_s"] is None else
              f"{d['num_requests']} requests of the same lengths, untimed, in {d['warmup_s']:.2f} s")
    lines = [f"workload: {workload.description}", f"warm-up: {warmup}",
             f"requests: {d['num_requests']} in {d['elapsed_s']:.2f} s ({d['requests_per_s']:.2f} req/s, "
             f"{d['num_steps']} steps, {d['num_preemptions']} preemptions)",
             f"throughput: {d['input_tokens_per_s']:.1f} input tokens/s, {d['output_tokens_per_s']:.1f} output "
             f"tokens/s ({d['input_tokens']} in, {d['output_tokens']} out)"]
    for name, key in (("time to first token", "ttft_s"), ("per-token latency", "per_token_s")):
        lines.append(f"{name}: " + ", ".join(f"{p} {_ms(v)}" for p, v in d[key].items()))
    lines.append(f"peak memory: {format_bytes(d['peak_memory'])} (weights {format_bytes(d['weight_bytes'])} + "
                 f"allocator peak {format_bytes(d['allocator_peak'])})")
    lines.append(f"KV cache utilization: peak {d['kv_utilization_peak']:.0%}, mean {d['kv_utilization_mean']:.0%} of "
                 f"{d['kv_blocks_total']} blocks")
    return lines


def _runtime_for(inv: Invocation, cfg: Any) -> Any:
    """One runtime shared by every run of a single-device bench (one device open, one warm allocator)."""
    if int(cfg.parallel.tensor_size) != 1:
        return None
    return Runtime.from_config(cfg, plugin_manager=inv.plugin_manager())


def run(inv: Invocation) -> int:
    register_modules(inv.plugin_manager(), inv.params["register"], strict=True)
    place = torchrun_place()
    if inv.flags["sweep"] is not None and place is not None and place.world_size > 1:
        raise UsageError("--sweep starts one engine per value, but the ranks torchrun started serve a single "
                         "engine: run bench under torchrun without --sweep, or sweep without torchrun "
                         "(parallel.tensor_size=N spawns the ranks for every engine)")
    if serve_torchrun_worker(inv.config()):  # under torchrun, ranks above 0 serve rank 0's engine until it closes
        return 0
    cfg = resolve_parallel_config(inv.config())
    workload = _workload(inv, cfg)
    progress = False if inv.flags["no-progress"] else None
    warmup = not inv.flags["no-warmup"]
    out_dir = Path(inv.flags["out"] or ".")
    runtime = _runtime_for(inv, cfg)
    try:
        if inv.flags["sweep"] is None:
            result = run_bench(cfg, workload, runtime=runtime, progress=progress, progress_stream=inv.stderr,
                               warmup=warmup)
            data = {"workload": workload.description, "overrides": inv.overrides, **result.to_dict()}
            if inv.flags["out"]:
                out_dir.mkdir(parents=True, exist_ok=True)
                (out_dir / "bench.json").write_text(json.dumps(data, indent=2))
            inv.print(json.dumps(data, indent=2) if inv.flags["json"] else "\n".join(_render(result, workload)))
            return 0
        key, values = parse_sweep(inv.flags["sweep"])
        sweep = run_sweep(inv.overrides, key, values, workload, plugin_manager=inv.plugin_manager(),
                          runtime=runtime, fraction=inv.params["knee"], progress=progress,
                          progress_stream=inv.stderr, warmup=warmup)
    finally:
        if runtime is not None:
            runtime.close()
    sweep["overrides"] = inv.overrides
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / "bench-sweep.json", out_dir / "bench-sweep.png"
    json_path.write_text(json.dumps(sweep, indent=2))
    plot_sweep(sweep, png_path)
    if inv.flags["json"]:
        inv.print(json.dumps(sweep, indent=2))
    else:
        inv.print("\n".join([f"workload: {workload.description}", *sweep_table(sweep),
                             f"wrote {json_path} and {png_path}"]))
    return 0


def _check_sweep(text: str) -> str:
    if "=" not in text:
        raise UsageError(f"--sweep {text!r}: write KEY=V1,V2,… (e.g. scheduler.max_num_seqs=1,2,4,8,16)")
    return text


COMMAND = Command(
    name="bench",
    summary="Offline throughput and latency; --sweep a config key to find the knee (JSON + PNG plot).",
    run=run,
    params=(Param("num_prompts", "number of requests (default 64; for a prompts file: the first N)",
                  type=_positive),
            Param("input_len", "prompt length of synthetic requests: N or LOW:HIGH (default 128)", default="128"),
            Param("output_len", "tokens to generate: N or LOW:HIGH (default 64)", default="64"),
            Param("prompts_file", "JSONL prompts: {\"prompt\": …} or {\"prompt_token_ids\": […]}, optional "
                                  "\"max_tokens\""),
            Param("seed", "seed of the synthetic workload (default 0)", type=int, default=0),
            Param("knee", "knee = smallest value reaching this fraction of the best throughput (default 0.9)",
                  type=_fraction, default=0.9),
            REGISTER_PARAM),
    flags=(Flag("sweep", "sweep a config key: KEY=V1,V2,… (e.g. scheduler.max_num_seqs=1,2,4,8,16)",
                takes_value=True, type=_check_sweep),
           Flag("out", "folder for bench.json / bench-sweep.json and bench-sweep.png (default: current folder)",
                takes_value=True),
           Flag("json", "print the results as JSON"),
           Flag("no-warmup", "measure from a cold engine: kernel compiles, graph captures and first allocations "
                             "count (by default an untimed warm-up of the same lengths runs first)"),
           Flag("no-progress", "no progress bars")),
)
