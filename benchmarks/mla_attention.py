"""MLA decode attention on the host CPU: the ``torch-mla`` backend of ops=cpu against the reference, in one run.

A batch of decode tokens (one per sequence) attends over a paged latent
cache of DeepSeek-V2-Lite's sizes (16 heads, latent 512 + rotary key 64,
nope 128, value 128). The reference backend decompresses every sequence's
whole context into per-head keys and values at every step; ``torch-mla``
folds the up-projection into the queries and attends over the latent
itself. Both run on the same inputs and must agree; printed: milliseconds
per layer-step for each, their ratio, and the cache bytes per token and
layer against per-head K/V. Example::

    python benchmarks/mla_attention.py --batch 32 --context 1024 --dtype bfloat16

``benchmarks/results/mla_attention.json`` holds a run of the development
machine (one JSON object per line, with the CPU, ISA, threads and load).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kunlun_infer.ops.attention import mla_spec
from kunlun_infer.ops.attention_step import AttentionStep
from kunlun_infer.ops.reference_mla import ReferenceMLABackend
from kunlun_infer.plugins.torch_mla import TorchMLABackend

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  (a sibling file: what every benchmark records of the machine)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", help="also append the figures, as one JSON object per line, to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    spec = mla_spec(num_heads=args.heads, qk_nope_head_dim=128, qk_rope_head_dim=64, kv_lora_rank=512,
                    v_head_dim=128, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    bs, ctx, batch = args.block_size, args.context, args.batch
    blocks_per_seq = -(-ctx // bs)
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(batch)]
    slots = [tables[i][(ctx - 1) // bs] * bs + (ctx - 1) % bs for i in range(batch)]
    step = AttentionStep(bs, [1] * batch, [ctx - 1] * batch, tables, slots)
    reference, mine = ReferenceMLABackend(spec), TorchMLABackend(spec)
    (cache_spec,) = mine.kv_cache_tensors(num_blocks, bs)
    cache = (0.5 * torch.randn(cache_spec.shape, generator=g)).to(dtype)
    q_nope = torch.randn(batch, args.heads, 128, generator=g).to(dtype)
    q_rope = torch.randn(batch, args.heads, 64, generator=g).to(dtype)
    latent, k_rope = cache.view(-1, 576)[slots, :512], cache.view(-1, 576)[slots, 512:]
    kv_up = (torch.randn(args.heads, 256, 512, generator=g) / 512 ** 0.5).to(dtype)
    scale = 192 ** -0.5

    def run(backend):
        meta = backend.build_metadata(step)
        return backend.attend_latent(q_nope, q_rope, latent, k_rope, (cache,), meta, kv_up=kv_up, scale=scale)

    with torch.inference_mode():
        want, got = run(reference), run(mine)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        t_ref, t_mine = timed(lambda: run(reference), args.repeats), timed(lambda: run(mine), args.repeats)
    latent_bytes = cache_spec.nbytes // (num_blocks * bs)
    per_head_bytes = 2 * args.heads * 192 * cache.element_size()
    facts = machine.facts()
    print(f"CPU: {machine.describe(facts)}; torch {torch.__version__}, "
          f"torch CPU capability {facts['torch_cpu_capability']}")
    print(f"MLA decode, {batch} sequences x {ctx} tokens of context, {args.heads} heads, latent 512 + rope 64, "
          f"{args.dtype}: max relative difference {err:.2e}")
    print(f"  reference-mla (decompress each context): {1e3 * t_ref:8.2f} ms per layer-step")
    print(f"  torch-mla (absorbed, attend the latent): {1e3 * t_mine:8.2f} ms per layer-step")
    print(f"  speed-up: {t_ref / t_mine:.1f}x")
    print(f"cache per token and layer: {latent_bytes} B (latent + rotary key) vs {per_head_bytes} B for per-head K/V "
          f"of the same heads ({per_head_bytes / latent_bytes:.1f}x)")
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps({"machine": facts, "dtype": args.dtype, "batch": batch, "context": ctx,
                                "heads": args.heads, "reference_ms": 1e3 * t_ref, "torch_mla_ms": 1e3 * t_mine,
                                "speedup": t_ref / t_mine, "max_relative_difference": err,
                                "cache_bytes_per_token_layer": latent_bytes,
                                "per_head_kv_bytes_per_token_layer": per_head_bytes}) + "\n")


if __name__ == "__main__":
    main()
