"""Bounded load test of the OpenAI-compatible server: N streaming clients for a fixed time, on loopback.

Each client sends one streaming ``/v1/completions`` request after another
(a prompt of random words, ``max_tokens`` tokens, EOS ignored) until the time
is up; requests still running then are waited for. Reported: requests done
and failed, throughput (requests/s, generated tokens/s), end-to-end latency
and time to first token (p50/p90/p99), and the server's own batch-size mean
from ``/metrics``::

    python benchmarks/load_test_server.py                        # builds a ~11M-parameter random model,
                                                                 # starts `kunlun-infer serve`, 16 clients, 20 s
    python benchmarks/load_test_server.py --clients 32 --duration 60 --max-tokens 64
    python benchmarks/load_test_server.py --url http://127.0.0.1:8000   # an already running server
    python benchmarks/load_test_server.py --model /models/qwen2 scheduler.max_num_seqs=64
    python benchmarks/load_test_server.py --clients 128 --max-tokens 64 --top-p 0.95 --top-k 50

Trailing arguments are Hydra overrides for the server it starts. Exits 1
when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  (a sibling file: what every benchmark records of the machine)

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches under "
         "bright northern lights near old harbours full of ships").split()


def build_random_model(folder: Path) -> Path:
    """A Llama-shaped random model (hidden 256, 4 layers, ~11M parameters) with the embedded tokenizer."""
    import tokenizers
    import torch
    import transformers as tf

    import kunlun_infer

    tokenizer_dir = Path(kunlun_infer.__file__).parent / "default_model"
    vocab = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                            tie_word_embeddings=True)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def start_server(model: Path, overrides: list[str]) -> tuple[subprocess.Popen, str]:
    """``kunlun-infer serve`` on a free loopback port; returns the process and its base URL."""
    cmd = [sys.executable, "-m", "kunlun_infer", "serve", f"model.path={model}", "server.port=0", *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    match = re.search(r"on (http://\S+?:\d+)", line)
    if not match:
        proc.kill()
        raise SystemExit(f"the server did not start (exit code {proc.wait()}): {line.strip()}")
    return proc, match[1]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0-100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                      sampling: dict[str, Any]) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, **sampling, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:200]
            raise RuntimeError(f"HTTP {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter()
    done = time.perf_counter()
    return {"latency": done - started, "ttft": (first or done) - started, "tokens": tokens}


async def run_load(url: str, clients: int, duration: float, max_tokens: int, prompt_words: int,
                   seed: int, sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    rng = random.Random(seed)
    deadline = time.perf_counter() + duration

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            prompt = " ".join(rng.choice(WORDS) for _ in range(prompt_words))
            try:
                results.append(await one_request(client, url, prompt, max_tokens, sampling or {}))
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                errors.append(f"{type(exc).__name__}: {exc}")

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    wall = time.perf_counter() - started
    latencies = [r["latency"] for r in results]
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {
        "clients": clients, "duration_s": duration, "wall_s": round(wall, 3), "max_tokens": max_tokens,
        "sampling": {"temperature": 0.8, **(sampling or {})},
        "requests_ok": len(results), "requests_failed": len(errors), "errors": sorted(set(errors))[:5],
        "requests_per_s": round(len(results) / wall, 3), "output_tokens_per_s": round(tokens / wall, 1),
        "latency_s": {f"p{q}": round(percentile(latencies, q), 4) for q in (50, 90, 99)},
        "ttft_s": {f"p{q}": round(percentile(ttfts, q), 4) for q in (50, 90, 99)},
    }


def server_batching(url: str) -> dict[str, float]:
    """Mean sequences per engine step and steps run, from ``/metrics``."""
    samples = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    count = samples.get("kunlun_infer_batch_size_count", 0)
    return {"engine_steps": count,
            "mean_batch_size": round(samples.get("kunlun_infer_batch_size_sum", 0) / count, 2) if count else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an already running server (otherwise one is started)")
    parser.add_argument("--model", type=Path, help="model folder for the server it starts (default: a random one)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds during which clients send requests")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=None, help="each request's top_p (default: none sent)")
    parser.add_argument("--top-k", type=int, default=None, help="each request's top_k (default: none sent)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args, overrides = parser.parse_known_args()

    proc = None
    workdir = None
    try:
        url = args.url
        if url is None:
            model = args.model
            if model is None:
                workdir = Path(tempfile.mkdtemp(prefix="kunlun-load-"))
                model = build_random_model(workdir / "model")
            os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) - 1)))
            proc, url = start_server(model, [f"scheduler.max_num_seqs={max(args.clients, 16)}", *overrides])
        sampling = {key: value for key, value in (("top_p", args.top_p), ("top_k", args.top_k)) if value is not None}
        result = asyncio.run(run_load(url, args.clients, args.duration, args.max_tokens, args.prompt_words,
                                      args.seed, sampling))
        result.update(server_batching(url))
        result["machine"] = machine.facts()  # this host's: where the server was started here, the one measured
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)

    print(machine.describe(result["machine"]))
    print(f"{result['clients']} clients for {result['duration_s']:.0f} s ({result['wall_s']:.1f} s wall), "
          f"max_tokens={result['max_tokens']}, {result['sampling']}")
    print(f"  requests: {result['requests_ok']} ok, {result['requests_failed']} failed")
    print(f"  throughput: {result['requests_per_s']:.2f} req/s, {result['output_tokens_per_s']:.1f} output tokens/s")
    print("  latency:  " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in result["latency_s"].items()))
    print("  TTFT:     " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in result["ttft_s"].items()))
    print(f"  server: {result['engine_steps']:.0f} engine steps, {result['mean_batch_size']} sequences per step")
    for error in result["errors"]:
        print(f"  error: {error}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if result["requests_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
