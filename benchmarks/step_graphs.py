"""Decode steps replayed from captures (``ops.step_graphs``) against the same steps run eagerly, in one process.

Two engines on the same weights (``perf_cpu``'s Qwen2-shaped 0.5B model,
random weights): one with every step eager (``ops.step_graphs=0``), one
replaying captured decode steps (the default). Each decodes ``batch``
sequences; their steps are timed in turns — a block of steps of one engine,
then of the other, ``--rounds`` times — so both meet the same minutes of
the host's memory bandwidth, which on a shared machine moves by 2× within
minutes. Reported per dtype and batch: the mean step of each, the ratio, and
where a replayed step's time goes, each part the best of five back to back:
the captured kernels (made from C, one ctypes call, where ``replay.c``
can), the same calls made one by one from Python, the GEMM calls among them
alone, the others alone, the
LM head, and the rest of the step (scheduling, inputs, embedding, sampling)
against the best step; beside the memory read bandwidth probed in the same
rounds. Prints
the CPU model, ISA flags, threads and kernel set; writes
``benchmarks/results/step_graphs.json``::

    python benchmarks/step_graphs.py
    python benchmarks/step_graphs.py --dtypes float32 --batches 1 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  (a sibling file: what every benchmark records of the machine)
import perf_cpu  # noqa: E402  (the workload model and the engine settings its decode figures use)

RESULTS = Path(__file__).resolve().parent / "results" / "step_graphs.json"


def start(llm: Any, batch: int, vocab: int, max_tokens: int) -> None:
    """``batch`` fresh 64-token prompts, prefilled (what follows are pure decode steps)."""
    import kunlun_infer as ki

    g = torch.Generator().manual_seed(7)
    for _ in range(batch):
        llm.engine.add_request(torch.randint(0, vocab, (64,), generator=g).tolist(),
                               ki.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    for _ in range(3):  # the prefill, the first decode step (and, with captures, the capture)
        llm.engine.step()


def timed_steps(llm: Any, steps: int) -> float:
    begin = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    return (time.perf_counter() - begin) / steps


def breakdown(llm: Any, batch: int) -> dict[str, float]:
    """Milliseconds of one replay (its calls made from C by replay.c where it can), of the same calls made one by one
    from Python, of its GEMM calls alone, of the rest of its calls alone (best of 5 each; the parts from Python)."""
    captured = llm.engine.runner.graphs.captured_step(batch)
    captured.replay()  # bound to the arena
    calls = captured._ready  # the cpu ops' (function, arguments, checked) of each recorded call
    gemms = [c for c in calls if "gemm" in c[0].__name__]
    others = [c for c in calls if "gemm" not in c[0].__name__]

    def run(part: list) -> None:
        for function, args, _ in part:
            function(*args)

    return {"replay_ms": machine.best_time(captured.replay, 5) * 1e3, "replay_from_c": captured.from_c,
            "calls_from_python_ms": machine.best_time(lambda: run(calls), 5) * 1e3,
            "gemm_calls_ms": machine.best_time(lambda: run(gemms), 5) * 1e3,
            "other_calls_ms": machine.best_time(lambda: run(others), 5) * 1e3,
            "calls": len(calls), "gemm_calls": len(gemms)}


def lm_head_ms(llm: Any, batch: int) -> float:
    model = llm.engine.runner.model
    hidden = torch.randn(batch, model.config.hidden_size).to(llm.engine.dtype)
    with torch.inference_mode():
        return machine.best_time(lambda: model.compute_logits(hidden), 5) * 1e3


def measure(folder: Path, shape: perf_cpu.Shape, dtype: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    eager = perf_cpu.open_engine(folder, dtype, ["ops.step_graphs=0"])
    graphs = perf_cpu.open_engine(folder, dtype, [])
    steps = args.steps
    max_tokens = 3 + args.rounds * steps + 16
    for llm in (eager, graphs):
        start(llm, batch, shape.vocab, max_tokens)
    times: dict[str, float] = {"eager": 0.0, "graphs": 0.0}
    probes = []
    for _ in range(args.rounds):
        probes.append(perf_cpu.read_bandwidth())
        times["eager"] += timed_steps(eager, steps)
        times["graphs"] += timed_steps(graphs, steps)
    captured = graphs.engine.runner.graphs
    if captured.replays < args.rounds * steps:
        raise RuntimeError(f"{dtype} batch {batch}: only {captured.replays} of {args.rounds * steps} steps replayed "
                           f"(refused: {captured.refused})")
    eager_ms, graphs_ms = times["eager"] / args.rounds * 1e3, times["graphs"] / args.rounds * 1e3
    parts = breakdown(graphs, batch)
    head = lm_head_ms(graphs, batch)
    best_step = machine.best_time(graphs.engine.step, 5) * 1e3  # timed like the parts: best of 5, back to back
    for llm in (eager, graphs):
        llm.close()
    return {"dtype": dtype, "batch": batch, "eager_step_ms": eager_ms, "replayed_step_ms": graphs_ms,
            "replayed_over_eager": graphs_ms / eager_ms, "lm_head_ms": head,
            "best_replayed_step_ms": best_step, "rest_of_step_ms": best_step - parts["replay_ms"] - head,
            "read_gb_s": [round(p / 1e9, 1) for p in probes],
            **parts}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="bfloat16,float32,int8")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="steps per engine per round")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/kunlun_infer_perf_cpu"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    shape = perf_cpu.SHAPES["0.5b"]
    folder = perf_cpu.build_model(shape, args.model_dir / "0.5b")
    facts = machine.facts()
    print(machine.describe(facts))
    rows = []
    for dtype in args.dtypes.split(","):
        for batch in map(int, args.batches.split(",")):
            row = measure(folder, shape, dtype, batch, args)
            rows.append(row)
            print(f"{dtype:9s} b{batch}: eager {row['eager_step_ms']:6.2f} ms, replayed {row['replayed_step_ms']:6.2f} "
                  f"ms ({row['replayed_over_eager']:.2f}x); replay {row['replay_ms']:.2f} "
                  f"{'from C' if row['replay_from_c'] else 'from Python'} (from Python "
                  f"{row['calls_from_python_ms']:.2f} = GEMM calls "
                  f"{row['gemm_calls_ms']:.2f} + other {row['calls'] - row['gemm_calls']} calls "
                  f"{row['other_calls_ms']:.2f} + loop); best step {row['best_replayed_step_ms']:.2f} = replay + LM "
                  f"head {row['lm_head_ms']:.2f} + rest {row['rest_of_step_ms']:.2f}; read {min(row['read_gb_s'])}-{max(row['read_gb_s'])} GB/s",
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": facts, "results": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
