"""Soak: thousands of random requests through one engine under KV pressure; nothing crashes, leaks or drifts.

Requests of random prompt and output lengths arrive while others run (more
in flight than ``scheduler.max_num_seqs``, so a queue forms), about one in ten
is aborted a random number of steps after it arrived, and the KV cache is
small enough that running sequences are preempted again and again. Prompts
come from a pool in which many share prefixes, so the prefix cache is hit
and evicted all along. Most requests are greedy; some draw with a seed; a few
ask for two samples.

At the end the soak checks and reports:

- every KV block is free again (and, every ``--audit-every`` steps, free +
  used == total);
- resident memory after the warm-up (the first tenth of the requests) grew
  less than ``--max-rss-growth``;
- every request that was not aborted produced exactly what the same prompt
  produces alone on an unloaded engine (greedy, and seeded sampling too),
  each unique prompt computed once.

Run (builds a tiny random model unless ``--model`` names one)::

    python benchmarks/soak.py --requests 5000 [--json soak.json] [hydra overrides ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

#: the engine under load: a queue (in flight > max_num_seqs) and a KV cache that forces preemption
LOADED = {"scheduler.max_num_seqs": 16, "scheduler.max_num_batched_tokens": 128, "cache.block_size": 8,
          "cache.num_blocks": 40, "model.max_model_len": 128}
#: the reference engine: one request at a time, room to spare
UNLOADED = {"scheduler.max_num_seqs": 1, "scheduler.max_num_batched_tokens": 128, "cache.block_size": 8,
            "cache.num_blocks": 32, "model.max_model_len": 128, "cache.prefix_caching": "false"}


@dataclasses.dataclass
class Planned:
    """One request of the workload, decided up front from the seed."""

    prompt: int  # index into the prompt pool
    max_tokens: int
    seed: int | None  # None = greedy
    n: int
    abort_after_steps: int | None  # None = left to finish


@dataclasses.dataclass(slots=True)
class Final:
    """What the soak keeps of a final output (not the whole snapshot, so memory measures the engine)."""

    index: int
    token_ids: list[int]
    finish_reason: str
    error: str | None


@dataclasses.dataclass
class SoakReport:
    requests: int
    aborted: int
    finished: dict[str, int]
    steps: int
    preemptions: int
    prefix_cache_hit_tokens: int
    generated_tokens: int
    wall_s: float
    tokens_per_s: float
    kv_blocks_total: int
    kv_blocks_free_at_end: int
    kv_audits: int
    rss_after_warm_up_mib: float
    rss_at_end_mib: float
    rss_peak_mib: float
    rss_growth: float
    checked_against_reference: int
    unique_references: int
    mismatches: list[dict[str, Any]]

    @property
    def ok(self) -> bool:
        return (not self.mismatches and self.kv_blocks_free_at_end == self.kv_blocks_total
                and self.finished.get("error", 0) == 0)


# ---------------------------------------------------------------------------- workload


def prompt_pool(rng: random.Random, size: int, vocab: int, max_len: int) -> list[list[int]]:
    """Random prompts; about half start with a prefix of an earlier one (shared KV blocks)."""
    pool: list[list[int]] = []
    for _ in range(size):
        length = rng.randint(1, max_len)
        if pool and rng.random() < 0.5:
            base = rng.choice(pool)
            head = base[:rng.randint(1, len(base))]
            pool.append((head + [rng.randrange(vocab) for _ in range(length)])[:max_len])
        else:
            pool.append([rng.randrange(vocab) for _ in range(length)])
    return pool


def plan(rng: random.Random, num_requests: int, pool_size: int, max_tokens: int,
         abort_fraction: float) -> list[Planned]:
    requests = []
    for _ in range(num_requests):
        kind = rng.random()
        seed = rng.randrange(2**31) if kind < 0.2 else None
        n = 2 if 0.2 <= kind < 0.25 else 1
        abort = rng.randint(0, 12) if rng.random() < abort_fraction else None
        requests.append(Planned(rng.randrange(pool_size), rng.randint(1, max_tokens), seed, n, abort))
    return requests


def params_for(ki: Any, p: Planned, max_tokens: int | None = None) -> Any:
    if p.seed is None:
        return ki.SamplingParams(max_tokens=max_tokens or p.max_tokens, temperature=0.0, n=p.n)
    return ki.SamplingParams(max_tokens=max_tokens or p.max_tokens, temperature=0.9, top_p=0.95, top_k=50,
                             seed=p.seed, n=p.n)


# ---------------------------------------------------------------------------- the run


def audit_kv(engine: Any) -> None:
    """Every block is free or held by a running sequence; free + used == total."""
    used = {b for seq in engine.scheduler.running for b in seq.block_table}
    stats = engine.stats()
    if stats["kv_blocks_free"] + len(used) != stats["kv_blocks_total"]:
        raise AssertionError(f"KV ledger broken: {stats['kv_blocks_free']} free + {len(used)} used != "
                             f"{stats['kv_blocks_total']} total")


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def run_soak(model: str | Path, *, num_requests: int, seed: int = 0, abort_fraction: float = 0.1,
             max_in_flight: int = 24, max_tokens: int = 24, max_prompt_len: int = 64, pool_size: int | None = None,
             audit_every: int = 1, overrides: list[str] = (), progress: bool = False) -> SoakReport:
    """Run the soak on ``model`` and return the report (see the module docstring)."""
    import kunlun_infer as ki
    from kunlun_infer.runtime import compose_config

    rng = random.Random(seed)
    cfg = compose_config([f"model.path={model}", *_overrides(LOADED), *overrides])
    pool_size = pool_size or max(8, num_requests // 12)
    with ki.LLM.from_config(cfg) as llm:
        engine = llm.engine
        vocab = engine.vocab_size
        pool = prompt_pool(rng, pool_size, vocab, max_prompt_len)
        planned = plan(rng, num_requests, pool_size, max_tokens, abort_fraction)
        finals: dict[str, list[Any]] = {}
        by_id: dict[str, Planned] = {}
        abort_at: dict[int, list[str]] = {}
        aborted: set[str] = set()
        live: set[str] = set()
        warm_up_at = max(1, num_requests // 10)
        rss_warm = rss_peak = 0
        next_request = audits = step = 0
        started = time.perf_counter()
        while next_request < num_requests or engine.has_unfinished():
            room = max_in_flight - len(live)
            for _ in range(min(room, rng.randint(0, 4), num_requests - next_request)):
                p = planned[next_request]
                request_id = engine.add_request(pool[p.prompt], params_for(ki, p))
                by_id[request_id] = p
                finals[request_id] = []
                live.add(request_id)
                if p.abort_after_steps is not None:
                    abort_at.setdefault(step + p.abort_after_steps, []).append(request_id)
                next_request += 1
                if next_request == warm_up_at:
                    rss_warm = rss()
            for request_id in abort_at.pop(step, ()):
                if engine.abort(request_id):
                    aborted.add(request_id)
            for out in engine.step():
                if out.finished:
                    finals[out.request_id].append(Final(out.index, out.token_ids, out.finish_reason, out.error))
                    if len(finals[out.request_id]) == by_id[out.request_id].n:
                        live.discard(out.request_id)
            step += 1
            if audit_every and step % audit_every == 0:
                audit_kv(engine)
                audits += 1
            if step % 500 == 0:
                rss_peak = max(rss_peak, rss())
                if progress:
                    print(f"  step {step}: {next_request}/{num_requests} requests in, "
                          f"{engine.stats()['num_preemptions']} preemptions", file=sys.stderr)
        wall = time.perf_counter() - started
        rss_end = rss()
        stats = engine.stats()
    reasons = Counter(o.finish_reason if o.error is None else "error" for outs in finals.values() for o in outs)
    mismatches, checked, references = check_against_reference(model, pool, by_id, finals, aborted, overrides)
    generated = sum(len(o.token_ids) for outs in finals.values() for o in outs)
    return SoakReport(
        requests=num_requests, aborted=len(aborted), finished=dict(reasons), steps=stats["num_steps"],
        preemptions=stats["num_preemptions"], prefix_cache_hit_tokens=stats["prefix_cache_hit_tokens"],
        generated_tokens=generated, wall_s=round(wall, 2), tokens_per_s=round(generated / wall, 1),
        kv_blocks_total=stats["kv_blocks_total"], kv_blocks_free_at_end=stats["kv_blocks_free"], kv_audits=audits,
        rss_after_warm_up_mib=round(rss_warm / 2**20, 1), rss_at_end_mib=round(rss_end / 2**20, 1),
        rss_peak_mib=round(max(rss_peak, rss_end) / 2**20, 1), rss_growth=round((rss_end - rss_warm) / rss_warm, 4),
        checked_against_reference=checked, unique_references=references, mismatches=mismatches)


def check_against_reference(model: str | Path, pool: list[list[int]], by_id: dict[str, Planned],
                            finals: dict[str, list[Any]], aborted: set[str],
                            overrides: list[str]) -> tuple[list[dict[str, Any]], int, int]:
    """Compare every request that was not aborted with its prompt run alone (each unique prompt once).

    The reference engine runs one request at a time, without prefix caching,
    for the longest output any request asked of that prompt (and seed).
    """
    import kunlun_infer as ki
    from kunlun_infer.runtime import compose_config

    wanted: dict[tuple[int, int | None], int] = {}  # (prompt, seed) -> the longest output asked of it
    for request_id, p in by_id.items():
        if request_id not in aborted:
            key = (p.prompt, p.seed)
            wanted[key] = max(wanted.get(key, 0), p.max_tokens)
    cfg = compose_config([f"model.path={model}", *_overrides(UNLOADED), *overrides])
    reference: dict[tuple[int, int | None], list[int]] = {}
    with ki.LLM.from_config(cfg) as alone:
        for (prompt, seed), longest in wanted.items():
            params = params_for(ki, Planned(prompt, longest, seed, 1, None))
            reference[(prompt, seed)] = alone.generate([pool[prompt]], params, use_tqdm=False)[0].token_ids
    mismatches, checked = [], 0
    for request_id, p in by_id.items():
        if request_id in aborted:
            continue
        expected = reference[(p.prompt, p.seed)][:p.max_tokens]
        outs = finals[request_id]
        if len(outs) != p.n:
            mismatches.append({"request": request_id, "problem": f"{len(outs)} final outputs for n={p.n}"})
            continue
        for out in outs:
            checked += 1
            if out.token_ids != expected or out.error is not None:
                mismatches.append({"request": request_id, "seed": p.seed, "index": out.index,
                                   "expected": expected, "got": out.token_ids, "error": out.error})
    return mismatches, checked, len(reference)


def _overrides(keys: dict[str, Any]) -> list[str]:
    return [f"{k}={v}" for k, v in keys.items()]


def build_tiny_model(folder: Path) -> Path:
    """A random-weight Llama (hidden 64, 2 layers, vocabulary 512) saved as safetensors, without tokenizer."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      eos_token_id=1, bos_token_id=0, tie_word_embeddings=False,
                                      initializer_range=0.2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model folder (default: a tiny random Llama)")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--abort-fraction", type=float, default=0.1)
    parser.add_argument("--max-in-flight", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--audit-every", type=int, default=1, help="steps between KV ledger audits (0 = never)")
    parser.add_argument("--max-rss-growth", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny models gain nothing from more)")
    parser.add_argument("--json", help="write the report here as JSON")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both engines")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or build_tiny_model(Path(scratch) / "tiny-llama")
        report = run_soak(model, num_requests=args.requests, seed=args.seed, abort_fraction=args.abort_fraction,
                          max_in_flight=args.max_in_flight, max_tokens=args.max_tokens,
                          audit_every=args.audit_every, overrides=list(args.overrides), progress=True)
    summary = dataclasses.asdict(report)
    summary["mismatches"] = summary["mismatches"][:10]
    summary["num_mismatches"] = len(report.mismatches)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    ok = report.ok and report.rss_growth < args.max_rss_growth
    print("soak", "PASSED" if ok else "FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
