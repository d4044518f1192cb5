"""kunlun_infer on one NVIDIA GPU (``platform=cuda``) against transformers ``generate()``, lever by lever.

Models are built locally with transformers' config classes (random weights,
bfloat16, no hub): a Qwen2-shaped 0.5B (``perf_cpu``'s shape) and a
Llama-3.2-1B-shaped 1.2B. Per model, in one process:

- the memory bandwidth of the run (a device-to-device copy, bytes read plus
  written), and the weight-streaming bound of a batch-1 decode step at it;
- transformers ``generate()`` serving the requests as one static left-padded
  batch (every row as long as the longest output; only useful tokens count);
- kunlun_infer serving the same requests with the levers switched on one by
  one: the plugin as it was (SDPA over gathered K/V, torch norms, every step
  eager), then the Triton paged-attention backend, then the fused norms,
  rotary and SwiGLU, then decode steps replayed as CUDA graphs (the default). Each
  engine serves a warm-up burst first (Triton compiles for what it meets;
  the engine captured its graphs when it started) whose time is recorded
  apart; then the timed run;
- each variant's batch-1 decode step (median), beside the bound; with graphs,
  also the GPU time of the batch-1 capture's replay alone (the layers);
- each engine's start: seconds (loading, the KV cache, the start-up
  captures), GPU memory it holds once started and at its peak;
- with ``--steady N``, the same requests served again with at most ``N`` in
  flight, the next one added as soon as one finishes: a server's steady
  stream of arrivals, where new prompts join the decoding batch every few
  steps;
- ``--profile`` variants: decode steps at ``--profile-batches`` sizes under
  torch's profiler (the ops with the most host and device time, and how
  busy the device was).

The variants besides the levers take one out of the default: rotary by torch's
kernels (``graphs-torch-rotary``), an output at every token as a streaming
server asks instead of ``LLM.generate``'s outputs at the end
(``graphs-every-output``), decode steps run one after the other instead of
launched behind the step in flight (``graphs-sync``).

Requests: ``--requests`` (256) token-id prompts of 128-1024 tokens and
outputs of 64-512, greedy, EOS ignored. Writes ``--out`` (JSON) as it goes::

    python benchmarks/perf_gpu.py --out benchmarks/results/perf_gpu_h200.json
    python benchmarks/perf_gpu.py --models qwen2-0.5b --requests 64 --variants graphs
    python benchmarks/perf_gpu.py --models qwen2-0.5b --no-transformers --variants graphs,graphs  # twice
    python benchmarks/perf_gpu.py --no-transformers --variants fused,graphs,graphs-every-output --profile graphs

``--cpu-dry-run`` runs the same code path on the host CPU (``ops=cuda`` over
CPU tensors, Triton interpreted, float32; a tiny model and a few requests):
a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import perf_cpu  # noqa: E402  (a sibling file: the request sets and the batch-1 decode step)
import step_host  # noqa: E402  (a sibling file: the parts of a step)

from kunlun_infer.runtime.guard import unwrap  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "perf_gpu.json"


@dataclasses.dataclass(frozen=True)
class GpuModel:
    """A decoder of ``perf_cpu``'s :class:`~perf_cpu.Shape`, as a Qwen2 or a Llama (tied embeddings)."""

    family: str  # "qwen2" | "llama"
    shape: perf_cpu.Shape

    def config(self) -> Any:
        import transformers

        shape = self.shape
        common = {"hidden_size": shape.hidden, "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
                  "num_key_value_heads": shape.kv_heads, "intermediate_size": shape.intermediate,
                  "vocab_size": shape.vocab, "tie_word_embeddings": True, "max_position_embeddings": 4096}
        if self.family == "qwen2":
            return transformers.Qwen2Config(rope_theta=1_000_000.0, **common)
        return transformers.LlamaConfig(rope_theta=500_000.0, bos_token_id=None, eos_token_id=None, **common)

    @property
    def vocab(self) -> int:
        return self.shape.vocab

    def weight_bytes(self) -> int:
        """bf16 bytes a decode step reads: every layer's linear weights and the tied head (embedding rows aside)."""
        return 2 * self.shape.streamed_params()


MODELS = {"qwen2-0.5b": GpuModel("qwen2", perf_cpu.SHAPES["0.5b"]),
          "llama-1b": GpuModel("llama", perf_cpu.Shape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192,
                                                       vocab=128256)),
          "tiny": GpuModel("llama", perf_cpu.Shape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256,
                                                   vocab=1000))}

@dataclasses.dataclass(frozen=True)
class Variant:
    """One engine of the comparison: the label the report uses, the engine's overrides, fused ops left to the
    torch kernels (one lever taken out of the default, by the plugin's ``FUSED_OPS`` while that engine is built:
    no config key exists for it), and whether requests report only when they finish (``LLM.generate``) or at
    every token (as a streaming server asks)."""

    label: str
    overrides: tuple[str, ...] = ()
    torch_ops: tuple[str, ...] = ()
    final_only: bool = True


#: the levers, switched on one at a time (each variant keeps the ones before it), and the default with one taken
#: out: ``--variants`` name -> :class:`Variant`
VARIANTS: dict[str, Variant] = {
    "sdpa": Variant("plugin before (sdpa gather, torch norms, eager)",
                    ("ops.attention=sdpa", "ops.fused_kernels=off", "ops.step_graphs=0")),
    "triton": Variant("+ triton paged attention",
                      ("ops.attention=triton", "ops.fused_kernels=off", "ops.step_graphs=0")),
    "fused": Variant("+ fused norms, rotary and swiglu",
                     ("ops.attention=triton", "ops.fused_kernels=on", "ops.step_graphs=0")),
    "graphs": Variant("+ cuda graphs (default)"),
    "graphs-torch-rotary": Variant("default, but rotary by torch's kernels", torch_ops=("rotary_embedding",)),
    "graphs-every-output": Variant("default, but an output at every token", final_only=False),
    "graphs-sync": Variant("default, but steps not overlapped", ("scheduler.overlap_steps=off",)),
}


def build(model: GpuModel, folder: Path, device: torch.device) -> Path:
    import transformers

    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(model.config(), dtype=dtype)
    hf.config.dtype = dtype
    hf.save_pretrained(folder, safe_serialization=True)
    del hf
    torch.cuda.empty_cache()
    return folder


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes per second (read plus written) of a device-to-device copy, median of 10 after warm-up."""
    if device.type != "cuda":
        src = torch.rand(nbytes // 4)
        start = time.perf_counter()
        src.clone()
        return 2 * nbytes / (time.perf_counter() - start)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def engine_overrides(num_blocks: int, max_seqs: int, device: torch.device) -> list[str]:
    where = (["platform=cuda", "comm=single", "model.dtype=bfloat16"] if device.type == "cuda" else
             ["device=cpu", "memory=caching", "ops=cuda", "streams=sync", "comm=single", "model.dtype=float32"])
    return [*where, f"cache.num_blocks={num_blocks}",
            "cache.prefix_caching=false", "model.max_model_len=2048", f"scheduler.max_num_seqs={max_seqs}",
            "scheduler.max_num_batched_tokens=8192"]


def transformers_run(folder: Path, requests: perf_cpu.Requests, device: torch.device) -> dict[str, Any]:
    import transformers

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    perf_cpu.static_batch(hf, perf_cpu.Requests(requests.prompts[:4], [4] * 4), device)()  # warm
    once = perf_cpu.static_batch(hf, requests, device)
    sync(device)
    start = time.perf_counter()
    once()
    sync(device)
    seconds = time.perf_counter() - start
    kwargs = perf_cpu.HF_GREEDY
    with torch.inference_mode():
        b1 = torch.randint(0, 1000, (1, 64), device=device)
        hf.generate(b1, max_new_tokens=8, min_new_tokens=8, **kwargs)
        sync(device)
        start = time.perf_counter()
        hf.generate(b1, max_new_tokens=129, min_new_tokens=129, **kwargs)
        sync(device)
        b1_seconds = (time.perf_counter() - start) / 128  # the first token is the prefill's
    del hf
    torch.cuda.empty_cache()
    return {"seconds": seconds, "tokens_per_s": requests.useful_tokens / seconds, "batch1_ms": 1e3 * b1_seconds}


def warmup_requests(vocab: int, max_seqs: int) -> tuple[list[list[int]], list[int]]:
    """A burst whose decode batches shrink through every size from ``max_seqs`` to 1 (short prompts, outputs
    spread over 1..64): every captured batch size is met, every kernel compiled."""
    g = torch.Generator().manual_seed(99)
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 200, (max_seqs,), generator=g)]
    return prompts, [1 + (i * 64) // max_seqs for i in range(max_seqs)]


def replay_ms(captured: Any, device: torch.device, repeats: int = 50) -> float:
    """Median GPU milliseconds of one replay of a captured decode step (the layers alone: the step's host work,
    head and sampling are what ``batch1_ms`` adds). Its stores land in slots of finished sequences: free blocks."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        captured.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def serve(llm: Any, prompts: list[list[int]], params: list[Any], final_only: bool) -> list[list[int]]:
    """Each request's output tokens: through ``LLM.generate`` (outputs when requests finish), or through the
    engine's loop with an output at every token, as a streaming server asks for them."""
    if final_only:
        return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = llm.engine
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.token_ids)
    return [finished[request_id] for request_id in ids]


def serve_steady(llm: Any, prompts: list[list[int]], params: list[Any], concurrency: int) -> list[list[int]]:
    """Each request's output tokens, served with at most ``concurrency`` requests in the engine: the next one is
    added as soon as one finishes (outputs only when requests finish)."""
    engine = llm.engine
    queue = list(zip(prompts, params))
    queue.reverse()
    ids: list[str] = []
    finished: dict[str, list[int]] = {}
    while queue or engine.has_unfinished():
        while queue and len(ids) - len(finished) < concurrency:
            prompt, p = queue.pop()
            ids.append(engine.add_request(prompt, p, final_only=True))
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.token_ids)
    return [finished[request_id] for request_id in ids]


def gib(nbytes: int) -> float:
    return round(nbytes / 2**30, 3)


def ours(folder: Path, model: GpuModel, requests: perf_cpu.Requests, variant: Variant, overrides: list[str],
         num_blocks: int, device: torch.device, profile_steps: int = 0,
         profile_batches: tuple[int, ...] = (1,), steady: int = 0) -> dict[str, Any]:
    import kunlun_infer as ki
    from kunlun_infer_cuda import ops as cuda_ops

    max_seqs = len(requests.prompts)
    out: dict[str, Any] = {"overrides": overrides, **({"torch_ops": list(variant.torch_ops)}
                                                      if variant.torch_ops else {}),
                           "outputs": "final" if variant.final_only else "every"}
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    fused = cuda_ops.FUSED_OPS
    cuda_ops.FUSED_OPS = tuple(op for op in fused if op not in variant.torch_ops)
    start = time.perf_counter()
    try:
        llm = ki.LLM(model=str(folder), overrides=[*engine_overrides(num_blocks, max_seqs, device), *overrides])
    finally:
        cuda_ops.FUSED_OPS = fused
    out["start_seconds"] = time.perf_counter() - start  # loading, the KV cache, the start-up captures
    with llm:
        graphs = getattr(llm.engine.runner, "graphs", None)
        if graphs is not None:
            out["captured_at_start"] = list(graphs.batch_sizes)
        if on_gpu:  # what the engine holds once started: weights, KV cache, the captures' pool
            out["memory_after_start_gib"] = {"allocated": gib(torch.cuda.memory_allocated(device) - before),
                                             "reserved": gib(torch.cuda.memory_reserved(device))}
        describe = getattr(unwrap(llm.engine.runtime.ops), "describe", None)
        out["kernels"] = describe() if callable(describe) else None
        prompts, lens = warmup_requests(model.vocab, max_seqs)
        start = time.perf_counter()
        serve(llm, prompts, [ki.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens],
              variant.final_only)
        out["warmup_seconds"] = time.perf_counter() - start
        params = [ki.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in requests.output_lens]
        start = time.perf_counter()
        outputs = serve(llm, requests.prompts, params, variant.final_only)
        out["seconds"] = time.perf_counter() - start
        assert [len(o) for o in outputs] == requests.output_lens
        out["tokens_per_s"] = requests.useful_tokens / out["seconds"]
        if steady:
            start = time.perf_counter()
            outputs = serve_steady(llm, requests.prompts, params, steady)
            seconds = time.perf_counter() - start
            assert [len(o) for o in outputs] == requests.output_lens
            out["steady"] = {"concurrency": steady, "seconds": seconds,
                             "tokens_per_s": requests.useful_tokens / seconds}
        out["batch1_ms"] = 1e3 * perf_cpu.decode_steps(llm, 1, 64, 129, model.vocab, seed=5)
        if graphs is not None:
            out["graphs"] = {"captured_sizes": graphs.batch_sizes, "replays": graphs.replays,
                             "refused": {str(k): v for k, v in graphs.refused.items()}}
            if 1 in graphs.batch_sizes and on_gpu:
                out["batch1_replay_ms"] = replay_ms(graphs.captured_step(1), device)
        for batch in profile_batches if profile_steps else ():
            out.setdefault("decode_profiles", []).append(
                profile_decode(llm, model.vocab, profile_steps, device, batch, 64 if batch == 1 else 512))
        if on_gpu:
            out["memory_peak_gib"] = gib(torch.cuda.max_memory_allocated(device) - before)
    torch.cuda.empty_cache()
    return out


def labelled(name: str, fn: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return run


def profile_decode(llm: Any, vocab: int, steps: int, device: torch.device, batch: int = 1, prompt_len: int = 64,
                   rows: int = 25) -> dict[str, Any]:
    """Where a decode step's time goes: ``steps`` steps of ``batch`` fresh sequences of ``prompt_len``-token
    prompts (their prefill left out) under torch's profiler, host and device; the ops with the most host time
    and the most device time (per step), and how long the device was busy per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    import kunlun_infer as ki

    engine = llm.engine
    g = torch.Generator().manual_seed(7)
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
                           ki.SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()  # the prefills
    for _ in range(3):  # and a few decode steps
        engine.step()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])]
    calls = step_host.part_calls(engine)  # the step's parts as step_host.py names them, each a labelled range
    for part, owner, name in calls:
        setattr(owner, name, labelled(f"step.{part}", getattr(owner, name)))
    try:
        with profile(activities=activities) as prof:
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync(device)
            wall = time.perf_counter() - start
    finally:
        for _, owner, name in calls:
            delattr(owner, name)  # the instance attribute: the class's method shows again
    while engine.has_unfinished():
        engine.step()
    averages = prof.key_averages()
    parts: dict[str, float] = {}
    for e in averages:  # (each labelled range is also listed as a device annotation, without host time)
        if e.key.startswith("step.") and e.cpu_time_total:
            parts[e.key.removeprefix("step.")] = round(e.cpu_time_total / steps, 1)

    def device_us(event: Any) -> float:
        return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))

    def row(event: Any) -> dict[str, Any]:
        return {"name": event.key[:90], "calls_per_step": round(event.count / steps, 2),
                "host_us_per_step": round(event.self_cpu_time_total / steps, 1),
                "device_us_per_step": round(device_us(event) / steps, 1)}

    # the device's own activities (kernels, copies), not the ops or labelled ranges that also carry their time
    busy_us = sum(e.time_range.elapsed_us() for e in prof.events()
                  if e.device_type == DeviceType.CUDA and not e.name.startswith("step."))
    return {"batch": batch, "prompt_len": prompt_len, "steps": steps, "step_ms": 1e3 * wall / steps, "device_busy_ms_per_step": busy_us / steps / 1e3,
            "host_us_per_step_by_part": parts,
            "by_host_time": [row(e) for e in sorted(averages, key=lambda e: -e.self_cpu_time_total)[:rows]],
            "by_device_time": [row(e) for e in sorted(averages, key=device_us, reverse=True)[:rows]
                               if device_us(e) > 0]}


def print_profile(profile: dict[str, Any]) -> None:
    print(f"  profiled batch-{profile['batch']} step {profile['step_ms']:.3f} ms, device busy "
          f"{profile['device_busy_ms_per_step']:.3f} "
          f"ms; host us per step by part {profile['host_us_per_step_by_part']}; per step, host us / device us / "
          "calls:")
    for title in ("by_host_time", "by_device_time"):
        print(f"  {title}:")
        for r in profile[title][:15]:
            print(f"    {r['host_us_per_step']:8.1f} {r['device_us_per_step']:8.1f} {r['calls_per_step']:6.2f}  "
                  f"{r['name']}")


def machine(device: torch.device) -> dict[str, Any]:
    import platform

    facts: dict[str, Any] = {"gpu": "none (CPU dry run)", "torch": torch.__version__, "cuda": torch.version.cuda,
                             "python": platform.python_version(), "host_cpu": platform.processor()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(gpu=props.name, multiprocessors=props.multi_processor_count,
                     memory_gib=round(props.total_memory / 2**30, 1))
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = None
    try:
        import transformers

        facts["transformers"] = transformers.__version__
    except ImportError:
        pass
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen2-0.5b,llama-1b")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompts", default="128,1024", help="prompt length range")
    parser.add_argument("--outputs", default="64,512", help="output length range")
    parser.add_argument("--variants", default="sdpa,triton,fused,graphs")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--profile", default="", help="variants whose batch-1 decode steps are also profiled")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--profile-batches", default="1",
                        help="decode batch sizes profiled (1: 64-token prompts; larger: 512-token prompts)")
    parser.add_argument("--steady", type=int, default=0,
                        help="also serve the requests with at most this many in flight (0: not)")
    parser.add_argument("--folder", default="/tmp/kunlun-gpu-models")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-dry-run", action="store_true", help="check the script on the host CPU (see above)")
    args = parser.parse_args(argv)
    device = torch.device("cpu") if args.cpu_dry_run else torch.device("cuda", 0)
    prompt_range = tuple(int(x) for x in args.prompts.split(","))
    output_range = tuple(int(x) for x in args.outputs.split(","))
    report: dict[str, Any] = {"command": " ".join(["python", "benchmarks/perf_gpu.py", *(argv or sys.argv[1:])]),
                              "date": time.strftime("%Y-%m-%d"), "machine": machine(device),
                              "requests": {"count": args.requests, "prompts": prompt_range, "outputs": output_range},
                              "models": {}}
    report["copy_bytes_per_s"] = copy_bandwidth(device)
    print(f"{report['machine']['gpu']}: copy {report['copy_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    for name in args.models.split(","):
        model = MODELS[name]
        folder = build(model, Path(args.folder) / name, device)
        requests = perf_cpu.make_requests(args.requests, model.vocab, args.seed, prompt_range, output_range)
        tokens = sum(len(p) + n for p, n in zip(requests.prompts, requests.output_lens))
        num_blocks = 2 * (tokens // 16 + 2 * args.requests) + 1024
        entry: dict[str, Any] = {"family": model.family, "shape": dataclasses.asdict(model.shape),
                                 "weight_bytes": model.weight_bytes(),
                                 "useful_tokens": requests.useful_tokens,
                                 "batch1_bound_ms": 1e3 * model.weight_bytes() / report["copy_bytes_per_s"],
                                 "variants": {}}
        report["models"][name] = entry
        if not args.no_transformers:
            entry["transformers"] = transformers_run(folder, requests, device)
            print(f"{name}: transformers {entry['transformers']['tokens_per_s']:.0f} tok/s, "
                  f"batch-1 {entry['transformers']['batch1_ms']:.2f} ms", flush=True)
            out_path.write_text(json.dumps(report, indent=1))
        for short in args.variants.split(","):
            variant = VARIANTS[short]
            label = variant.label
            runs = sum(1 for known in entry["variants"] if known.split(" [run ")[0] == label)
            if runs:  # a variant named again (``--variants graphs,graphs``: does a first engine run slower?)
                label = f"{label} [run {runs + 1}]"
            try:
                overrides = [*variant.overrides,
                             *(["ops.attention=triton"] if args.cpu_dry_run and short != "sdpa" else [])]
                result = ours(folder, model, requests, variant, overrides, num_blocks, device,
                              args.profile_steps if short in args.profile.split(",") else 0,
                              tuple(int(b) for b in args.profile_batches.split(",")), args.steady)
            except Exception as exc:  # noqa: BLE001 - recorded; the other variants still run
                result = {"error": f"{type(exc).__name__}: {exc}"}
            entry["variants"][label] = result
            out_path.write_text(json.dumps(report, indent=1))
            if "error" in result:
                print(f"{name}: {label}: {result['error']}", flush=True)
                continue
            theirs = entry.get("transformers", {}).get("tokens_per_s")
            vs = f" ({result['tokens_per_s'] / theirs:.2f}x transformers)" if theirs else ""
            replay = f", layers' replay {result['batch1_replay_ms']:.3f} ms" if "batch1_replay_ms" in result else ""
            if "steady" in result:
                replay += f", {result['steady']['concurrency']} in flight {result['steady']['tokens_per_s']:.0f} tok/s"
            memory = result.get("memory_after_start_gib", {})
            print(f"{name}: {label}: {result['tokens_per_s']:.0f} tok/s{vs}, start {result['start_seconds']:.1f} s "
                  f"({memory.get('allocated', '-')} GiB, captured {result.get('captured_at_start', '-')}), "
                  f"warm-up {result['warmup_seconds']:.1f} s, batch-1 {result['batch1_ms']:.2f} ms{replay} "
                  f"(bound {entry['batch1_bound_ms']:.3f})", flush=True)
            for profile in result.get("decode_profiles", []):
                print_profile(profile)
    out_path.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
