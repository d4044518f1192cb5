"""CPU performance of kunlun_infer against transformers' ``generate``, and against the machine itself.

One command measures, in one run, on the same random-weight models and the
same requests:

- Workload A: a Qwen2-shaped model of ~0.5B parameters (hidden 896, 24
  layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied
  embeddings) in bfloat16; 32 requests, prompt lengths uniform in [32, 256],
  output lengths uniform in [32, 128], seed 0, EOS ignored, greedy.
- Workload B: the same shape family at ~11M parameters (hidden 256, 4 layers,
  8 heads, 2 KV heads, intermediate 768, vocab 32000): the regime where the
  per-step overhead shows.

For each workload kunlun_infer serves every request with continuous batching
and transformers gets one static left-padded batch with ``max_new_tokens`` =
the longest output; both are credited only with the useful tokens (each
request's own output length); each gets the same number of timed runs and
the fastest counts (prefix caching is off, so a repeat recomputes its
prompts). The machine's bf16 matmul throughput (the best of ``F.linear``,
oneDNN and kunlun_infer's own GEMM on large GEMMs) and memory read bandwidth
are measured at the start and at the end of the run, and the better figure
is the machine's. The engine's decode step at batch 32 on A is reported as a
fraction of that matmul roofline, and its per-token latency at batch 1
against the weight-streaming bound (bytes of the weights one decode step
reads / bandwidth). Prints one table and writes JSON::

    python benchmarks/perf_cpu.py                 # the full benchmark (several minutes on 2 cores)
    python benchmarks/perf_cpu.py --quick         # fewer requests, for iterating
    python benchmarks/perf_cpu.py --workloads B --no-transformers ops=torch

Trailing arguments are kunlun_infer Hydra overrides (e.g. ``ops=torch``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results" / "perf_cpu.json"


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Qwen2-shaped model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def linear_params_per_layer(self) -> int:
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        return qkv + self.heads * self.head_dim * self.hidden + 3 * self.hidden * self.intermediate

    def streamed_params(self) -> int:
        """Parameters one decode step multiplies with: every linear weight and the (tied) LM head."""
        return self.layers * self.linear_params_per_layer() + self.vocab * self.hidden

    def decode_flops(self, context: int) -> float:
        """FLOPs of one decoded token with ``context`` tokens of context (matmuls and attention)."""
        attention = self.layers * 4 * context * self.heads * self.head_dim
        return 2.0 * self.streamed_params() + attention


WORKLOADS = {
    "A": Shape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936),
    "B": Shape(hidden=256, layers=4, heads=8, kv_heads=2, intermediate=768, vocab=32000),
}
#: timed runs per workload (the fastest counts, for both engines): the machine is shared, a neighbour's job
#: can only slow a run down; B's run takes well under a second
REPEATS = {"A": 2, "B": 3}
TARGETS = {"A_speedup": 2.0, "B_speedup": 2.0, "decode_b32_roofline_fraction": 0.60, "batch1_ms_per_token": 45.0}


# ---------------------------------------------------------------------- models and requests

def build_model(shape: Shape, folder: Path) -> Path:
    """A random-weight Qwen2 checkpoint of ``shape`` in bfloat16 (built once, then reused)."""
    import transformers

    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    config = transformers.Qwen2Config(
        hidden_size=shape.hidden, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, intermediate_size=shape.intermediate, vocab_size=shape.vocab,
        tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=1_000_000.0)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@dataclasses.dataclass
class Requests:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)


def make_requests(num: int, vocab: int, seed: int, prompt_range=(32, 256), output_range=(32, 128)) -> Requests:
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(prompt_range[0], prompt_range[1] + 1, (num,), generator=g).tolist()
    output_lens = torch.randint(output_range[0], output_range[1] + 1, (num,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    return Requests(prompts, output_lens)


# ---------------------------------------------------------------------- the two engines

def open_engine(folder: Path, overrides: list[str], max_num_seqs: int, num_blocks: int) -> Any:
    import kunlun_infer as ki

    # no prefix caching: a repeated run must compute its prompts again, as transformers does
    return ki.LLM(model=str(folder), overrides=[
        "model.dtype=bfloat16", f"scheduler.max_num_seqs={max_num_seqs}", f"cache.num_blocks={num_blocks}",
        "cache.prefix_caching=false", *overrides])


def run_kunlun(llm: Any, requests: Requests, repeats: int = 1) -> dict[str, float]:
    """Serve every request at once (continuous batching); the fastest of ``repeats`` runs."""
    import kunlun_infer as ki

    params = [ki.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in requests.output_lens]
    llm.generate(requests.prompts[:2], ki.SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(requests.prompts, params, use_tqdm=False)
        runs.append(time.perf_counter() - start)
        produced = [len(o.token_ids) for o in outputs]
        assert produced == requests.output_lens, "every request must produce exactly its output length"
    return {"seconds": min(runs), "all_seconds": runs, "useful_tokens": requests.useful_tokens,
            "tokens_per_s": requests.useful_tokens / min(runs)}


def run_transformers(folder: Path, requests: Requests, repeats: int = 1) -> dict[str, float]:
    """One static left-padded batch, ``max_new_tokens`` = the longest output; the fastest of ``repeats``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    pad = 0
    width = max(len(p) for p in requests.prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in requests.prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in requests.prompts])
    longest = max(requests.output_lens)
    kwargs = dict(do_sample=False, pad_token_id=pad, eos_token_id=None)
    runs = []
    with torch.inference_mode():
        model.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=4, **kwargs)  # warm
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                 **kwargs)
            runs.append(time.perf_counter() - start)
            assert out.shape[1] - width == longest
    del model
    return {"seconds": min(runs), "all_seconds": runs, "useful_tokens": requests.useful_tokens,
            "tokens_per_s": requests.useful_tokens / min(runs)}


# ---------------------------------------------------------------------- the machine

def _best_time(fn, repeats: int, inner: int = 1) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def measure_matmul_roofline() -> dict[str, Any]:
    """Best bf16 matmul throughput (FLOP/s) over large model-like GEMMs: ``F.linear``, oneDNN with a
    prepacked weight, and kunlun_infer's own bf16 GEMM where this machine builds it — whichever is fastest."""
    try:
        from kunlun_infer.plugins import cpu_gemm
    except ImportError:  # an older kunlun_infer without it
        cpu_gemm = None
    results = {}
    for m, n, k in ((512, 4864, 896), (1024, 2048, 2048)):
        x = torch.randn(m, k).to(torch.bfloat16)
        w = torch.randn(n, k).to(torch.bfloat16)
        flops = 2.0 * m * n * k
        results[f"F.linear {m}x{n}x{k}"] = flops / _best_time(lambda: F.linear(x, w), 10)
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
            run = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
            results[f"oneDNN {m}x{n}x{k}"] = flops / _best_time(run, 10)
        except (AttributeError, RuntimeError):
            pass
        if cpu_gemm is not None and cpu_gemm.available():
            tiled = cpu_gemm.pack(w)
            results[f"kunlun bf16 GEMM {m}x{n}x{k}"] = flops / _best_time(lambda: cpu_gemm.linear(x, tiled), 10)
    best = max(results, key=results.get)
    return {"flops_per_s": results[best], "best": best, "all": results}


def measure_machine() -> dict[str, Any]:
    roofline = measure_matmul_roofline()
    return {"matmul_flops_per_s": roofline["flops_per_s"], "matmul_best": roofline["best"],
            "matmul_all": roofline["all"], "read_bytes_per_s": measure_read_bandwidth()}


def measure_read_bandwidth() -> float:
    """Memory read bandwidth (bytes/s): the best of a few sums over a buffer far larger than the caches."""
    buf = torch.ones(256 * 1024 * 1024 // 4, dtype=torch.float32)  # 256 MiB
    return buf.numel() * 4 / _best_time(lambda: buf.sum(), 16)


# ---------------------------------------------------------------------- engine-level probes

def decode_step_times(llm: Any, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> list[float]:
    """Seconds of each pure-decode step with ``batch`` sequences (prefill steps left out)."""
    import kunlun_infer as ki

    engine = llm.engine
    g = torch.Generator().manual_seed(1)
    params = ki.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params)
    times = []
    while engine.has_unfinished():
        prefilling = len(engine.scheduler.waiting) > 0 or any(
            s.num_computed_tokens < len(s) - 1 for s in engine.scheduler.running)
        running = len(engine.scheduler.running)
        start = time.perf_counter()
        engine.step()
        if not prefilling and running == batch:
            times.append(time.perf_counter() - start)
    return times


def probe_decode(llm: Any, shape: Shape, batch: int, prompt_len: int, new_tokens: int) -> dict[str, float]:
    times = decode_step_times(llm, batch, prompt_len, new_tokens, shape.vocab)
    step = statistics.median(times)
    context = prompt_len + new_tokens // 2
    return {"batch": batch, "steps_timed": len(times), "median_step_s": step,
            "ms_per_token": 1e3 * step / batch if batch == 1 else None,
            "flops_per_s": batch * shape.decode_flops(context) / step, "tokens_per_s": batch / step}


# ---------------------------------------------------------------------- report

def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(result: dict[str, Any]) -> str:
    rows = [("metric", "kunlun_infer", "transformers", "ratio / fraction", "target", "met")]
    for name in ("A", "B"):
        w = result["workloads"].get(name)
        if not w:
            continue
        ours = w["kunlun"]["tokens_per_s"]
        theirs = w.get("transformers", {}).get("tokens_per_s")
        ratio = ours / theirs if theirs else None
        rows.append((f"{name}: useful tokens/s ({w['num_requests']} req)", f"{ours:.1f}",
                     f"{theirs:.1f}" if theirs else "-", f"{ratio:.2f}x" if ratio else "-",
                     f">= {TARGETS[name + '_speedup']:.1f}x", _met(ratio, TARGETS[name + "_speedup"], True)))
    peak = result["machine"]["matmul_flops_per_s"]
    d32 = result.get("decode_b32")
    if d32:
        frac = d32["flops_per_s"] / peak
        rows.append(("A: decode b32 GFLOP/s vs matmul roofline", f"{d32['flops_per_s'] / 1e9:.0f}",
                     f"roofline {peak / 1e9:.0f}", f"{frac:.0%}", f">= {TARGETS['decode_b32_roofline_fraction']:.0%}",
                     _met(frac, TARGETS["decode_b32_roofline_fraction"], True)))
    b1 = result.get("decode_b1")
    if b1:
        bound = result["weight_streaming_bound_ms"]
        rows.append(("A: batch-1 ms/token vs weight streaming", f"{b1['ms_per_token']:.1f}",
                     f"bound {bound:.1f}", f"{b1['ms_per_token'] / bound:.2f}x bound",
                     f"<= {TARGETS['batch1_ms_per_token']:.0f} ms", _met(b1["ms_per_token"],
                                                                         TARGETS["batch1_ms_per_token"], False)))
    return table(rows)


def _met(value: float | None, target: float, higher_is_better: bool) -> str:
    if value is None:
        return "-"
    return "yes" if (value >= target if higher_is_better else value <= target) else "no"


# ---------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 requests per workload and shorter probes")
    parser.add_argument("--workloads", default="A,B", help="comma-separated subset of A,B")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--no-probes", action="store_true", help="skip the batch-32 / batch-1 decode probes")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "kunlun_infer_perf_cpu",
                        help="where the random-weight checkpoints are built (and reused)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    parser.add_argument("overrides", nargs="*", help="kunlun_infer Hydra overrides (e.g. ops=torch)")
    args = parser.parse_args()

    num_requests = 8 if args.quick else 32
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()
    result: dict[str, Any] = {
        "quick": args.quick, "overrides": args.overrides, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "load_average_start": load, "workloads": {}, "targets": TARGETS,
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load[0]:.2f}; "
          f"overrides {args.overrides or '(none)'}")
    machine_start = measure_machine()
    print(f"machine: bf16 matmul {machine_start['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s "
          f"({machine_start['matmul_best']}), memory read {machine_start['read_bytes_per_s'] / 1e9:.1f} GB/s")

    for name in args.workloads.split(","):
        shape = WORKLOADS[name]
        folder = build_model(shape, args.model_dir / name)
        requests = make_requests(num_requests, shape.vocab, args.seed)
        entry: dict[str, Any] = {"shape": dataclasses.asdict(shape), "num_requests": num_requests,
                                 "useful_tokens": requests.useful_tokens}
        result["workloads"][name] = entry
        blocks = num_requests * (-(-(256 + 128) // 16)) + 64
        with open_engine(folder, args.overrides, max_num_seqs=32, num_blocks=max(blocks, 32 * 24 + 64)) as llm:
            entry["kunlun"] = run_kunlun(llm, requests, repeats=REPEATS[name])
            print(f"{name}: kunlun_infer {entry['kunlun']['tokens_per_s']:.1f} useful tokens/s "
                  f"({entry['kunlun']['seconds']:.1f} s)")
            if name == "A" and not args.no_probes:
                new = 16 if args.quick else 32
                result["decode_b32"] = probe_decode(llm, shape, 32, 64, new)
                result["decode_b1"] = probe_decode(llm, shape, 1, 32, 2 * new)
                print(f"A: decode b32 {result['decode_b32']['flops_per_s'] / 1e9:.0f} GFLOP/s, "
                      f"b1 {result['decode_b1']['ms_per_token']:.1f} ms/token")
        if not args.no_transformers:
            entry["transformers"] = run_transformers(folder, requests, repeats=REPEATS[name])
            print(f"{name}: transformers {entry['transformers']['tokens_per_s']:.1f} useful tokens/s "
                  f"({entry['transformers']['seconds']:.1f} s)")
            entry["speedup"] = entry["kunlun"]["tokens_per_s"] / entry["transformers"]["tokens_per_s"]

    result["load_average_end"] = os.getloadavg()
    # the machine measured again at the end; its capability is the better of the two (a neighbour's job
    # can only slow a measurement down)
    machine_end = measure_machine()
    result["machine"] = {key: max(machine_start[key], machine_end[key]) for key in
                         ("matmul_flops_per_s", "read_bytes_per_s")}
    result["machine"]["matmul_best"] = max((machine_start, machine_end),
                                           key=lambda m: m["matmul_flops_per_s"])["matmul_best"]
    result["machine"]["start"], result["machine"]["end"] = machine_start, machine_end
    if "decode_b1" in result:
        shape = WORKLOADS["A"]
        bandwidth = result["machine"]["read_bytes_per_s"]
        result["weight_streaming_bound_ms"] = 1e3 * 2 * shape.streamed_params() / bandwidth
    print()
    print(report(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
