"""Pipeline-parallel throughput: two stages with one batch in flight vs two, and one rank for reference.

Builds a random Llama (default hidden 1024, 8 layers, float32) and runs a
batch of prompts through ``LLM.generate`` (greedy, ``ignore_eos``) in these
settings, each after a warm-up batch, one torch thread per rank:

- ``parallel.pipeline_size=2 parallel.pipeline_batches=1``: the stages take
  turns — while one computes the other waits;
- ``parallel.pipeline_size=2 parallel.pipeline_batches=2``: two batches in
  flight, each with half of the sequences, so both stages compute at once;
- one rank (``pipeline_size=1``) with one thread, and with two threads (as
  many cores as the two stages use together).

Prints generated tokens per second per setting, the ratio that two batches
in flight buy over one, the CPU model and ISA flags, checks that every
setting produced the same tokens, and writes the figures to
``benchmarks/results/pipeline.json``.

    python benchmarks/pipeline.py [--prompts 16] [--length 64] [--max-tokens 32] [--hidden 1024] [--layers 8]
                                  [--repeats 3] [--out benchmarks/results/pipeline.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kunlun_infer import LLM, SamplingParams  # noqa: E402
from tests.engine.tiny_models import build_tiny_model  # noqa: E402
import machine  # noqa: E402  (a sibling file: what every benchmark records of the machine)

#: (label, pipeline_size, pipeline_batches, torch threads per rank)
SETTINGS = [("PP=2, 1 batch in flight", 2, 1, 1), ("PP=2, 2 batches in flight", 2, 2, 1),
            ("PP=1, 1 thread", 1, 1, 1), ("PP=1, 2 threads", 1, 1, 2)]


def run(folder: Path, prompts: list[list[int]], max_tokens: int, stages: int, batches: int, threads: int,
        repeats: int, extra: list[str]) -> tuple[float, list[list[int]]]:
    """(best seconds to generate over ``repeats``, tokens) for one setting."""
    torch.set_num_threads(threads)  # spawned ranks take the caller's thread count
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    overrides = [f"parallel.pipeline_size={stages}", f"parallel.pipeline_batches={batches}", *extra]
    with LLM(model=str(folder), overrides=overrides) as llm:
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
        best, tokens = float("inf"), []
        for _ in range(repeats):
            begin = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - begin)
            tokens = [o.token_ids for o in outputs]
    return best, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "pipeline.json"))
    args = parser.parse_args()
    facts = machine.facts()
    print(f"{facts['cpu_model']}; ISA {' '.join(facts['isa_flags'])}; {facts['cores']} cores; kernel set "
          f"{facts['kernel_set']}; load average {facts['load_average'][0]:.1f}")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (args.length,), generator=g).tolist() for _ in range(args.prompts)]
    extra = ["model.max_model_len=512", f"scheduler.max_num_seqs={args.prompts}",
             f"scheduler.max_num_batched_tokens={max(512, args.prompts * args.length)}"]
    results, tokens = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model(Path(tmp) / "model", "llama", hidden_size=args.hidden,
                                  intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                                  num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
                                  initializer_range=0.05)
        print(f"random Llama: hidden {args.hidden}, {args.layers} layers, float32; {args.prompts} prompts x "
              f"{args.length} tokens, {args.max_tokens} new tokens each")
        for label, stages, batches, threads in SETTINGS:
            seconds, got = run(folder, prompts, args.max_tokens, stages, batches, threads, args.repeats, extra)
            generated = sum(len(t) for t in got)
            results.append({"setting": label, "pipeline_size": stages, "pipeline_batches": batches,
                            "threads_per_rank": threads, "seconds": round(seconds, 3),
                            "tokens_per_s": round(generated / seconds, 1)})
            tokens.append(got)
            print(f"{label:>28}: {seconds:6.2f} s, {generated / seconds:8.1f} generated tokens/s")
    same = all(t == tokens[0] for t in tokens)
    gain = results[1]["tokens_per_s"] / results[0]["tokens_per_s"]
    print(f"two batches in flight vs one: {gain:.2f}x; same tokens in every setting: {same}")
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    report = {"benchmark": "pipeline", "date": now,
              "machine": facts, "workload": vars(args) | {"out": None}, "results": results,
              "two_in_flight_vs_one": round(gain, 3), "same_tokens": same}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
