"""Prompt attention on the host CPU: the native prompt kernel of ops=cpu against the two ways it replaced, in turns.

One sequence's new tokens attend over its paged K/V (the 0.5B workload's
heads: 14 query heads over 2 KV heads, head size 64; blocks of 16 tokens,
scattered over the cache). Three ways on the same inputs, each call timed in
turns with the others so that all meet the same minutes of the host:

- ``prompt kernel``: ``native/paged_prefill_attention.c`` (what ``ops=cpu``
  runs for every sequence with more than one new token);
- ``rows``: every query row as a decode query over the prefix it may see,
  through the native decode kernel (what served prompts of up to 512 tokens
  of context before);
- ``sdpa``: torch's ``scaled_dot_product_attention`` over the block-gathered
  K/V (what served longer prompts before, and what serves them without the
  native kernels).

Where the prompt kernel multiplies on the AMX tiles
(``cpu_attention.prompts_on_tiles``) that is printed beside the kernel set.

The shapes: whole prompts of 16–2048 tokens, a 256-token chunk after a
cached prefix of 768, and 5 speculative drafts over 1000 tokens. Printed per
shape and dtype: milliseconds of each way (medians), the prompt kernel's
useful GFLOP/s, and the ratios; with the CPU model, ISA flags, threads and
kernel set. ``KUNLUN_INFER_CPU_ISA=avx2`` measures the AVX2 kernel set on a
newer CPU. Example::

    python benchmarks/prompt_attention.py --json benchmarks/results/prompt_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kunlun_infer.ops import reference
from kunlun_infer.plugins import cpu_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  (a sibling file: what every benchmark records of the machine)

#: (context, new tokens): whole prompts, a chunk after a cached prefix, speculative drafts
SHAPES = [(16, 16), (64, 64), (256, 256), (512, 512), (1024, 1024), (2048, 2048), (1024, 256), (1000, 5)]
#: the 0.5B workload's attention: query heads, KV heads; head size; tokens per cache block
HEADS, HEAD_SIZE, BLOCK_SIZE = (14, 2), 64, 16


def inputs(ctx: int, new: int, hq: int, hk: int, d: int, block_size: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(ctx * 7 + new)
    blocks = -(-ctx // block_size)
    table = torch.randperm(blocks + 8, generator=g)[:blocks].to(torch.int32).unsqueeze(0)
    k_cache = torch.randn(blocks + 8, block_size, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks + 8, block_size, hk, d, generator=g).to(dtype)
    q = torch.randn(new, hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor([ctx], dtype=torch.int32)


def ways(q, k_cache, v_cache, table, lens, scale):
    ctx, new = int(lens[0]), q.shape[0]
    out = torch.empty_like(q)
    row_lens = torch.arange(ctx - new + 1, ctx + 1, dtype=torch.int32)
    row_tables = table.expand(new, -1).contiguous()
    return {
        "prompt kernel": lambda: cpu_attention.native_prompt_attention(q, k_cache, v_cache, table, lens, [0], [new],
                                                                       out, scale) and out,
        "rows": lambda: cpu_attention.native_decode_attention(q, k_cache, v_cache, row_tables, row_lens, scale),
        "sdpa": lambda: cpu_attention.prefill_attention(q, k_cache, v_cache, table[0], ctx, scale),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rounds", type=int, default=7, help="turns of the three ways per shape (medians kept)")
    parser.add_argument("--heads", default=",".join(map(str, HEADS)), help="query heads, KV heads")
    parser.add_argument("--head-size", type=int, default=HEAD_SIZE)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", help="also append the figures, as one JSON object, to this file (one per line)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hq, hk = (int(x) for x in args.heads.split(","))
    d = args.head_size
    facts = machine.facts()
    print(machine.describe(facts))
    tiles = {name: cpu_attention.prompts_on_tiles(getattr(torch, name), d) for name in args.dtypes.split(",")}
    print("prompt kernel on the AMX tiles: " + ", ".join(f"{name} {'yes' if on else 'no'}"
                                                          for name, on in tiles.items()))
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for ctx, new in SHAPES:
            q, k_cache, v_cache, table, lens = inputs(ctx, new, hq, hk, d, BLOCK_SIZE, dtype)
            scale = d ** -0.5
            fns = ways(q, k_cache, v_cache, table, lens, scale)
            want = reference.paged_attention(q, k_cache, v_cache, table, lens, torch.tensor([0, new]), scale)
            tol = 2e-2 if dtype is torch.bfloat16 else 2e-5
            for name, fn in fns.items():  # each way computes the same thing (and is warm)
                torch.testing.assert_close(fn().to(want.dtype), want, rtol=tol, atol=tol, msg=name)
            times: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            med = {name: statistics.median(t) for name, t in times.items()}
            pairs = sum(ctx - new + j + 1 for j in range(new))  # (query, key) pairs a causal mask lets through
            gflops = 4 * hq * d * pairs / med["prompt kernel"] / 1e9
            row = {"dtype": dtype_name, "context": ctx, "new_tokens": new,
                   **{f"{name}_ms": 1e3 * t for name, t in med.items()}, "prompt_kernel_gflops": gflops,
                   "rows_over_kernel": med["rows"] / med["prompt kernel"],
                   "sdpa_over_kernel": med["sdpa"] / med["prompt kernel"]}
            rows.append(row)
            print(f"{dtype_name:9s} context {ctx:5d}, new {new:5d}: prompt kernel {row['prompt kernel_ms']:8.3f} ms "
                  f"({gflops:4.0f} GFLOP/s), rows {row['rows_ms']:8.3f} ({row['rows_over_kernel']:.2f}x), "
                  f"sdpa {row['sdpa_ms']:8.3f} ({row['sdpa_over_kernel']:.2f}x)")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"machine": facts, "heads": [hq, hk], "head_size": d, "rounds": args.rounds,
                                "prompt_kernel_on_tiles": tiles, "results": rows}) + "\n")


if __name__ == "__main__":
    main()
