"""Speculative decoding against plain decoding, in one run, on a repetitive workload.

The embedded default model continues files of its own training corpus (the
Python standard library): each prompt is the first ``--prompt-tokens``
tokens of a file, and the model writes ``--max-tokens`` more, greedily
(EOS ignored, so every run writes the same number of tokens). Code repeats
itself — names, idioms, the file's own lines — which is what prompt lookup
(``speculative.method=ngram``) feeds on. For each setting the same requests
run at batch 1 (one after another) and all at once; reported: output tokens
per second of wall time and of CPU time, the speed-up over plain decoding,
the share of drafts kept and the tokens a checked sequence gains per step.
Every speculative run's text is checked to be the plain run's. Prints a
table and writes ``benchmarks/results/speculative.json``::

    python benchmarks/speculative.py
    python benchmarks/speculative.py --files 8 --max-tokens 96 --num-tokens 3 5
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import sys
import time
from pathlib import Path
from typing import Any

import torch

import kunlun_infer as ki

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  (a sibling file: what every benchmark records of the machine)

RESULTS = Path(__file__).resolve().parent / "results" / "speculative.json"


def prompts(count: int, prompt_tokens: int, tokenizer: Any) -> list[list[int]]:
    """The first ``prompt_tokens`` tokens of ``count`` standard-library files (long enough ones, by name)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(stdlib.glob("*.py")):
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="ignore"))
        if len(ids) >= prompt_tokens * 2:
            found.append(ids[:prompt_tokens])
        if len(found) == count:
            break
    return found


def measure(overrides: list[str], requests: list[list[int]], params: ki.SamplingParams) -> dict[str, Any]:
    """Wall and CPU seconds at batch 1 and at full batch, the texts, and the engine's speculation counters."""
    with ki.LLM(overrides=["cache.prefix_caching=false", *overrides]) as llm:
        llm.generate(requests[:1], ki.SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
        result: dict[str, Any] = {}
        texts = {}
        for mode, groups in (("batch_1", [[r] for r in requests]), (f"batch_{len(requests)}", [requests])):
            cpu, wall = time.process_time(), time.perf_counter()
            outs = [o for group in groups for o in llm.generate(group, params, use_tqdm=False)]
            result[mode] = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                            "tokens": sum(len(o.token_ids) for o in outs)}
            texts[mode] = [o.token_ids for o in outs]
        stats = llm.engine.stats()
    result["texts"] = texts
    result["acceptance_rate"] = stats["spec_acceptance_rate"]
    result["tokens_per_step"] = stats["spec_tokens_per_step"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=192)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[3, 5], help="drafts per step to try")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tag", default="default", help="name of this run in the results file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with ki.LLM() as llm:
        requests = prompts(args.files, args.prompt_tokens, llm.engine.tokenizer)
    params = ki.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    runs = {"plain": measure([], requests, params)}
    for k in args.num_tokens:
        runs[f"ngram_k{k}"] = measure(["speculative.method=ngram", f"speculative.num_tokens={k}"], requests, params)
    base = runs["plain"]
    table, rows = {}, []
    for name, run in runs.items():
        if name != "plain" and run["texts"] != base["texts"]:
            raise SystemExit(f"{name}: the greedy text differs from plain decoding")
        entry = {"acceptance_rate": round(run["acceptance_rate"], 4), "tokens_per_step": round(run["tokens_per_step"], 3)}
        for mode in (m for m in run if m.startswith("batch_")):
            tokens = run[mode]["tokens"]
            entry[mode] = {"tokens_per_s_wall": round(tokens / run[mode]["wall_s"], 1),
                           "tokens_per_s_cpu": round(tokens / run[mode]["cpu_s"], 1),
                           "speedup_wall": round(base[mode]["wall_s"] / run[mode]["wall_s"], 3),
                           "speedup_cpu": round(base[mode]["cpu_s"] / run[mode]["cpu_s"], 3)}
            rows.append(f"  {name:10} {mode:9} {entry[mode]['tokens_per_s_wall']:9.1f} tok/s  "
                        f"x{entry[mode]['speedup_wall']:.2f} wall  x{entry[mode]['speedup_cpu']:.2f} cpu  "
                        f"accepted {entry['acceptance_rate']:.0%}  {entry['tokens_per_step']:.2f} tokens/step")
        table[name] = entry
    result = {"machine": machine.facts(), "workload": {"files": len(requests), "prompt_tokens": args.prompt_tokens,
                                          "max_tokens": args.max_tokens, "model": "embedded default model"},
              "runs": table}
    print(f"CPU: {machine.describe(result['machine'])}; {len(requests)} stdlib files, "
          f"{args.prompt_tokens}-token prompts, {args.max_tokens} greedy tokens each; texts equal to plain decoding")
    print("\n".join(rows))
    RESULTS.parent.mkdir(exist_ok=True)
    saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    saved[args.tag] = result
    RESULTS.write_text(json.dumps(saved, indent=2) + "\n")


if __name__ == "__main__":
    main()
