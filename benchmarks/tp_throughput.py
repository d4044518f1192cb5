"""Tensor-parallel throughput on this machine: one rank vs two, same model, same workload, same tokens.

Builds a random Llama (default hidden 256, 4 layers, float32) and runs a
batch of prompts through ``LLM.generate`` (greedy, ``ignore_eos``) with
``parallel.tensor_size=1`` and ``=2``, after one warm-up batch each. One rank
is measured with as many torch threads as the two ranks use together and with
one thread, so the comparison is fair either way. Prints generated tokens per
second and checks that every setting produced the same tokens.

    python benchmarks/tp_throughput.py [--prompts 16] [--length 128] [--max-tokens 64] [--threads 1]
                                       [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kunlun_infer import LLM, SamplingParams  # noqa: E402
from tests.engine.tiny_models import build_tiny_model  # noqa: E402

def model_config(hidden: int, layers: int) -> dict:
    return dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64, initializer_range=0.05)


def run(folder: Path, prompts: list[list[int]], max_tokens: int, tensor_size: int, threads: int,
        extra: list[str]) -> tuple[float, float, list[list[int]]]:
    """(seconds to start, seconds to generate, tokens) for one setting; threads per rank."""
    torch.set_num_threads(threads)  # spawned ranks take the caller's thread count
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    with LLM(model=str(folder), overrides=[f"parallel.tensor_size={tensor_size}", *extra]) as llm:
        ready = time.perf_counter()
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        begin = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - begin
    return ready - started, elapsed, [o.token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank with two ranks")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (args.length,), generator=g).tolist() for _ in range(args.prompts)]
    extra = ["model.max_model_len=512", f"scheduler.max_num_seqs={args.prompts}",
             f"scheduler.max_num_batched_tokens={max(512, args.prompts * args.length)}"]
    settings = [("1 rank", 1, 2 * args.threads), ("1 rank", 1, args.threads), ("2 ranks", 2, args.threads)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model(Path(tmp) / "model", "llama", **model_config(args.hidden, args.layers))
        print(f"hidden {args.hidden}, {args.layers} layers; "
              f"{args.prompts} prompts x {args.length} tokens, {args.max_tokens} new tokens each; "
              f"{torch.get_num_threads()} cores visible to torch")
        results = []
        for name, tensor_size, threads in settings:
            start_s, gen_s, tokens = run(folder, prompts, args.max_tokens, tensor_size, threads, extra)
            results.append(tokens)
            generated = sum(len(t) for t in tokens)
            print(f"{name:>8}, {threads} thread(s) per rank: start {start_s:5.1f} s, generate {gen_s:6.2f} s, "
                  f"{generated / gen_s:8.1f} tokens/s")
        print("same tokens in every setting:", all(r == results[0] for r in results))


if __name__ == "__main__":
    main()
