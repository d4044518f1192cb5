"""``fused_moe`` of ``ops=cpu`` against the reference loop, in one run, on a Qwen3-MoE-shaped layer.

One mixture-of-experts layer with random weights shaped like Qwen3-30B-A3B's
(hidden 2048, expert intermediate 768) but ``--experts`` experts (16) of
which each token takes ``--top-k`` (4), routed by ``moe_route`` from random
router logits. For each weight dtype and batch size the same tokens run
through the op table's reference ``fused_moe`` (a loop over the experts,
masking each one's tokens, ``F.linear`` on the stacked weights) and through
``ops=cpu``'s (the pairs grouped by expert once, each active expert's
weights packed at load for the native GEMM); the best of ``--repeats`` timed
calls is kept, and the outputs are checked to agree within the op's
conformance tolerance. Prints a table with the CPU model, ISA flags, kernel
set and threads, and writes ``benchmarks/results/moe.json``::

    python benchmarks/moe.py
    python benchmarks/moe.py --threads 1 --repeats 15    # steadier on a busy machine
    python benchmarks/moe.py --experts 64 --top-k 8 --batches 1 32 128 --dtypes bfloat16
    # as on an AVX2-only CPU (torch, oneDNN and the native kernels capped alike; results/moe_avx2.json)
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 KUNLUN_INFER_CPU_ISA=avx2 \
        python benchmarks/moe.py --threads 1 --repeats 10 --out benchmarks/results/moe_avx2.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from kunlun_infer.ops import TOLERANCES, reference
from kunlun_infer.plugins import cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  (a sibling file: what every benchmark records of the machine)

RESULTS = Path(__file__).resolve().parent / "results" / "moe.json"
GOAL = 3.0  # times faster than the reference at batch 32
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def run_case(dtype: torch.dtype, args: argparse.Namespace) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    e, h, i = args.experts, args.hidden, args.intermediate
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
    packed = cpu_kernels.pack_moe_weights(w13, w2)
    rows = []
    for batch in args.batches:
        x = torch.randn(batch, h, generator=g).to(dtype)
        weights, ids = reference.moe_route(torch.randn(batch, e, generator=g), args.top_k, renormalize=True)
        want = reference.fused_moe(x, (w13, w2), weights, ids)
        got = cpu_kernels.fused_moe(x, packed, weights, ids)
        rtol, atol = TOLERANCES[dtype]
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        t_ref = machine.best_time(lambda: reference.fused_moe(x, (w13, w2), weights, ids), args.repeats)
        t_cpu = machine.best_time(lambda: cpu_kernels.fused_moe(x, packed, weights, ids), args.repeats)
        active = len(set(ids.flatten().tolist()))
        weight_bytes = active * 3 * h * i * torch.empty((), dtype=dtype).element_size()
        rows.append({"dtype": str(dtype).removeprefix("torch."), "batch": batch, "active_experts": active,
                     "reference_ms": t_ref * 1e3, "cpu_ms": t_cpu * 1e3, "speedup": t_ref / t_cpu,
                     "cpu_weight_gb_s": weight_bytes / t_cpu / 1e9})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch (and native kernel) threads; default: torch's own. On a busy shared machine "
                             "1 thread measures steadier: a descheduled OpenMP thread stalls every GEMM's barrier")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    facts = machine.facts()
    print(f"{facts['cpu_model']}; ISA {' '.join(facts['isa_flags'])}; kernel set {facts['kernel_set']} "
          f"({facts['kernel_set_why']}); {facts['threads']} threads; torch {facts['torch']}; load average "
          f"{facts['load_average'][0]:.1f}")
    print(f"layer: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, expert intermediate "
          f"{args.intermediate}")
    rows = [row for name in args.dtypes for row in run_case(DTYPES[name], args)]
    print(f"{'dtype':>9} {'batch':>5} {'experts':>7} {'reference ms':>12} {'cpu ms':>8} {'speed-up':>8} "
          f"{'cpu GB/s':>8}")
    for r in rows:
        print(f"{r['dtype']:>9} {r['batch']:>5} {r['active_experts']:>7} {r['reference_ms']:>12.2f} "
              f"{r['cpu_ms']:>8.2f} {r['speedup']:>7.1f}x {r['cpu_weight_gb_s']:>8.1f}")
    at_32 = [r for r in rows if r["batch"] == 32]
    verdict = {r["dtype"]: r["speedup"] >= GOAL for r in at_32}
    if at_32:
        print("batch 32: " + ", ".join(f"{d} {'meets' if ok else 'misses'} the {GOAL:g}x goal"
                                      for d, ok in verdict.items()))
    result = {"machine": facts, "layer": {"experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
                                          "intermediate": args.intermediate},
              "repeats": args.repeats, "goal_at_batch_32": GOAL, "meets_goal": verdict, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
