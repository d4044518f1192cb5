"""Host memory between steps: the ``caching`` memory plugin against ``simple``, separate processes in turns.

The ``caching`` plugin has glibc keep the memory torch's host tensors free
(``cpu_memory.keep_freed_host_memory``), so that a step's activations reuse
the pages of the step before; with ``simple`` the C library keeps its own
policy, under which a step's larger blocks are mapped afresh and every page
faulted in again. Each turn starts one process per plugin, in turns, on the
workload model of ``perf_cpu.py`` (built once under ``--model-dir``); each
process opens the engine and measures one workload:

- ``prefill``: the 32 prompts of ``perf_cpu``'s 32 requests (4369 tokens,
  steps of 2048) with one output token each, best of three;
- ``serve``: ``--requests`` of ``perf_cpu``'s requests at once, best of two
  (useful output tokens a second).

``--thread`` runs the workload in a thread of its own, as the server's engine
loop and a fleet replica's do: there glibc's arena of the thread grows in
heaps of 64 MiB, and blocks larger than that (the gate-up outputs of a 2048-
token step of ``--model 1.5b`` in bf16, 73 MB) are what the ``caching``
plugin's kept mappings (``cpu_memory.LargeHostBlocks``) serve.

Printed and stored (``--out``): each run's tokens a second, its minor page
faults, and the process's resident memory after start-up and after the work,
with the machine beside them. Medians over the turns and their ratios.

Example::

    python benchmarks/host_memory.py --dtypes bfloat16,float32 --turns 4 --out host_memory.json
    python benchmarks/host_memory.py --model 1.5b --thread --work prefill --turns 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import machine
import perf_cpu

PLUGINS = ("simple", "caching")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One process: open the engine with ``memory=<plugin>`` and measure one workload."""
    import kunlun_infer as ki

    shape = perf_cpu.SHAPES[args.model]
    llm = perf_cpu.open_engine(Path(args.model_dir) / args.model, args.dtype, [f"memory={args.plugin}"])
    started = rss()
    if args.work == "prefill":
        requests = perf_cpu.make_requests(32, shape.vocab, args.seed)
        requests.output_lens = [1] * len(requests.prompts)
        tokens, repeats = sum(map(len, requests.prompts)), 3
    else:
        requests = perf_cpu.make_requests(args.requests, shape.vocab, args.seed)
        tokens, repeats = requests.useful_tokens, 2
    params = [ki.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in requests.output_lens]
    rates, counts = [], []

    def work() -> None:
        for _ in range(repeats):
            before, start = faults(), time.perf_counter()
            llm.generate(requests.prompts, params, use_tqdm=False)
            rates.append(tokens / (time.perf_counter() - start))
            counts.append(faults() - before)

    if args.thread:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    else:
        work()
    return {"tokens_per_s": max(rates), "tokens_per_s_repeats": rates, "minor_faults_repeats": counts,
            "rss_after_start": started, "rss_after_work": rss()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="bfloat16", help="comma-separated: bfloat16,float32,int8")
    parser.add_argument("--work", default="prefill,serve", help="comma-separated: prefill,serve")
    parser.add_argument("--requests", type=int, default=32, help="serve: how many of perf_cpu's requests")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--model", default="0.5b", choices=sorted(perf_cpu.SHAPES),
                        help="the workload model: perf_cpu's shape of that name")
    parser.add_argument("--thread", action="store_true",
                        help="run the workload in a thread other than the main one (as the server does)")
    parser.add_argument("--model-dir", default="/tmp/perfmodel", help="the workload model is built in <model>/ here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="JSON results file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plugin", choices=PLUGINS, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    facts = machine.facts()
    print(machine.describe(facts))
    perf_cpu.build_model(perf_cpu.SHAPES[args.model], Path(args.model_dir) / args.model)  # once, for every child
    results: dict[str, Any] = {"machine": facts, "model": args.model, "thread": args.thread,
                               "requests": args.requests, "runs": {}}
    for dtype in args.dtypes.split(","):
        for work in args.work.split(","):
            case = f"{work} {dtype}" + (f" {args.requests} requests" if work == "serve" else "")
            runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PLUGINS}
            for _ in range(args.turns):
                for plugin in PLUGINS:
                    done = subprocess.run(
                        [sys.executable, __file__, "--child", "--plugin", plugin, "--dtype", dtype, "--work", work,
                         "--requests", str(args.requests), "--model", args.model, "--model-dir", args.model_dir,
                         "--seed", str(args.seed), *(["--thread"] if args.thread else [])],
                        capture_output=True, text=True, check=True)
                    runs[plugin].append(json.loads(done.stdout.strip().splitlines()[-1]))
            results["runs"][case] = runs
            rate = {p: statistics.median(r["tokens_per_s"] for r in runs[p]) for p in PLUGINS}
            pairs = [c["tokens_per_s"] / s["tokens_per_s"] for s, c in zip(runs["simple"], runs["caching"])]
            print(f"{case}: tok/s simple {rate['simple']:.1f}, caching {rate['caching']:.1f} "
                  f"(x{rate['caching'] / rate['simple']:.2f}; turns {', '.join(f'{r:.2f}' for r in pairs)})")
            for p in PLUGINS:
                last = [r["minor_faults_repeats"][-1] for r in runs[p]]
                print(f"  {p}: minor faults of a process's last run {statistics.median(last):.0f}, resident after "
                      f"start-up {statistics.median(r['rss_after_start'] for r in runs[p]) / 2**20:.0f} MiB, "
                      f"after the work {statistics.median(r['rss_after_work'] for r in runs[p]) / 2**20:.0f} MiB")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
