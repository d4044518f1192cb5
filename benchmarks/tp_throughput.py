"""Tensor- or pipeline-parallel speed on this host: one rank against N ranks, same model, same requests, same
tokens, in turns.

Every setting gets the same torch threads from the caller: one rank uses them all, N ranks started by the engine
take an equal share each (and of the host's CPUs, bound there: ``engine/parallel/cores.py``), so the comparison is
of the same cores either way. Each turn opens a fresh engine per setting and measures a batch-1 decode (ms a token,
from one prompt) and a batch of requests (generated tokens a second), greedy with EOS ignored; the medians of the
turns are printed beside the machine (CPU model, ISA, threads, kernel set, NUMA nodes, each rank's CPUs), with how
many of the tokens the settings agree on.

    python benchmarks/tp_throughput.py [--kind tensor|pipeline] [--shape 0.5b|tiny] [--dtype bfloat16] [--ranks 2]
                                       [--turns 3] [--requests 8] [--length 64] [--max-tokens 32] [--json FILE]

``--kind pipeline`` holds ``parallel.pipeline_size=N`` (one rank a stage) against one rank instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import machine  # noqa: E402
import perf_cpu  # noqa: E402

from kunlun_infer import LLM, SamplingParams  # noqa: E402
from kunlun_infer.engine.parallel import cores  # noqa: E402
from tests.engine.tiny_models import build_tiny_model  # noqa: E402


def build(shape: str, folder: Path) -> Path:
    """The model measured: the 0.5B Qwen2 shape of the CPU benchmarks, or a tiny Llama (hidden 256, 4 layers)."""
    if shape == "0.5b":
        return perf_cpu.build_model(perf_cpu.SHAPES["0.5b"], folder / "0.5b")
    return build_tiny_model(folder / "tiny", "llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, initializer_range=0.05)


def run(folder: Path, ranks: int, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """One fresh engine of ``ranks`` ranks: its batch-1 decode and its batch of requests, and their tokens."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    overrides = [f"parallel.{args.kind}_size={ranks}", f"model.dtype={args.dtype}", "model.max_model_len=1024",
                 f"scheduler.max_num_seqs={max(8, args.requests)}"]
    with LLM(model=str(folder), overrides=overrides) as llm:
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        one = machine.best_time(lambda: llm.generate(prompts[:1], params, use_tqdm=False), repeats=3, warm=False)
        begin = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - begin
    tokens = [o.token_ids for o in outputs]
    return {"b1_ms_per_token": 1e3 * one / args.max_tokens, "tok_s": sum(map(len, tokens)) / elapsed,
            "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["tensor", "pipeline"], default="tensor",
                        help="what N ranks split: each layer (tensor) or the layers into stages (pipeline)")
    parser.add_argument("--shape", choices=["0.5b", "tiny"], default="0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ranks", type=int, default=2, help="the parallel setting held against one rank")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--length", type=int, default=64, help="prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, help="also append the figures, as one JSON object, to this file")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(args.shape, Path(tmp))
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        prompts = [torch.randint(0, vocab, (args.length,), generator=g).tolist() for _ in range(args.requests)]
        facts = machine.facts()
        threads = torch.get_num_threads()
        share, shares = cores.rank_shares(threads, args.ranks)
        print(f"{machine.describe(facts)}; NUMA nodes {[cores.format_cpu_list(n) for n in cores.numa_nodes()]}")
        print(f"{args.shape} in {args.dtype}; 1 rank of {threads} threads against {args.ranks} {args.kind}-parallel "
              f"ranks of {share} each, on CPUs "
              f"{' | '.join(map(cores.format_cpu_list, shares)) if shares else '(not bound)'}; "
              f"{args.requests} requests of {args.length} + {args.max_tokens} tokens; {args.turns} turns")
        turns: dict[int, list[dict]] = {1: [], args.ranks: []}
        for _ in range(args.turns):
            for ranks in turns:
                turns[ranks].append(run(folder, ranks, args, prompts))
    result = {"machine": facts, "kind": args.kind, "shape": args.shape, "dtype": args.dtype, "rank_threads": share,
              "rank_cpus": shares, "settings": {}}
    for ranks, runs in turns.items():
        b1 = statistics.median(r["b1_ms_per_token"] for r in runs)
        tok_s = statistics.median(r["tok_s"] for r in runs)
        result["settings"][str(ranks)] = {"b1_ms_per_token": [r["b1_ms_per_token"] for r in runs],
                                         "tok_s": [r["tok_s"] for r in runs]}
        each_b1 = ", ".join(f"{r['b1_ms_per_token']:.1f}" for r in runs)
        each_tok_s = ", ".join(f"{r['tok_s']:.1f}" for r in runs)
        print(f"{ranks} rank(s): batch-1 decode {b1:6.1f} ms/token, {args.requests} requests {tok_s:7.1f} tok/s "
              f"(turns: {each_b1} ms; {each_tok_s} tok/s)")
    # every turn of a setting writes the same tokens; the settings agree as far as their sums' order lets them (a
    # shard's partial sums added up differ in the last bits: exact in float32 on the tiny model, near in bf16)
    steady = all(r["tokens"] == runs[0]["tokens"] for runs in turns.values() for r in runs)
    ones, many = turns[1][0]["tokens"], turns[args.ranks][0]["tokens"]
    agree = sum(a == b for x, y in zip(ones, many) for a, b in zip(x, y)) / max(1, sum(map(len, ones)))
    result.update(same_tokens_every_turn=steady, tokens_agreeing=agree)
    print(f"the same tokens turn after turn: {steady}; {args.ranks} ranks' tokens agreeing with one rank's: "
          f"{agree:.0%}")
    if args.json:
        with args.json.open("a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
