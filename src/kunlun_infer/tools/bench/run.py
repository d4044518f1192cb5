"""One measured benchmark run: every request of a workload through one engine, offline.

All requests arrive at once and the engine steps until they finish, so the
run measures the engine at its configured batch limits. First, untimed, the
engine serves a warm-up of the same prompt and output lengths with other
random tokens: what an engine does once (kernels compiled for the shapes it
meets, decode steps captured for each batch size, allocator and caches
grown) is not counted, and no measured prompt finds its prefix cached from
it (``warmup=False`` measures from cold). Reported: input and
output tokens per second, time to first token and per-token latency
(the gaps between a request's consecutive tokens) at p50/p90/p99, peak
memory (weights plus the memory plugin's peak, which includes the KV
cache) and KV-cache utilization (blocks in use over blocks allocated, peak
and mean over steps).
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any

from omegaconf import DictConfig

from kunlun_infer.engine.engine import LLMEngine
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.runtime import Runtime
from kunlun_infer.tools.bench.workload import Workload

PERCENTILES = (50, 90, 99)


def percentiles(samples: list[float]) -> dict[str, float | None]:
    """``{"p50": …, "p90": …, "p99": …}`` by linear interpolation; ``None`` without samples."""
    ordered = sorted(samples)
    out: dict[str, float | None] = {}
    for p in PERCENTILES:
        if not ordered:
            out[f"p{p}"] = None
            continue
        rank = (len(ordered) - 1) * p / 100
        low = int(rank)
        high = min(low + 1, len(ordered) - 1)
        out[f"p{p}"] = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    return out


@dataclasses.dataclass
class BenchResult:
    """The figures of one run (times in seconds, memory in bytes)."""

    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float
    ttft_s: dict[str, float | None]
    per_token_s: dict[str, float | None]
    peak_memory: int
    weight_bytes: int
    allocator_peak: int
    kv_blocks_total: int
    kv_utilization_peak: float
    kv_utilization_mean: float
    num_steps: int
    num_preemptions: int
    #: seconds of the untimed warm-up; ``None`` when the run was measured from cold
    warmup_s: float | None = None
    setting: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def input_tokens_per_s(self) -> float:
        return self.input_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(input_tokens_per_s=self.input_tokens_per_s, output_tokens_per_s=self.output_tokens_per_s,
                    requests_per_s=self.requests_per_s)
        return data


def _progress(total: int, enabled: bool | None, desc: str, stream: Any) -> Any:
    from tqdm.auto import tqdm

    # disable=None: tqdm shows the bar only on a terminal
    return tqdm(total=total, desc=desc, unit="req", disable=None if enabled is None else not enabled, file=stream,
                leave=False)


def warm_up(engine: Any, workload: Workload) -> float:
    """Serve, untimed, requests of ``workload``'s prompt and output lengths made of other (seeded random) token
    ids; returns the seconds it took."""
    rng = random.Random("bench warm-up")
    started = time.monotonic()
    for request in workload.requests:
        length = (len(engine.prepare_request(request.prompt).prompt_token_ids) if isinstance(request.prompt, str)
                  else len(request.prompt))
        engine.add_request([rng.randrange(engine.vocab_size) for _ in range(length)],
                           SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return time.monotonic() - started


def run_workload(engine: Any, workload: Workload, *, progress: bool | None = None, progress_stream: Any = None,
                 desc: str = "bench", warmup: bool = True) -> BenchResult:
    """Run ``workload`` on a started engine and measure it, after a warm-up unless ``warmup=False`` (the engine
    is left open)."""
    warmup_s = warm_up(engine, workload) if warmup else None
    memory = engine.runtime.memory
    memory.reset_peak()
    stats0 = engine.stats()
    ids = []
    started = time.monotonic()
    for request in workload.requests:
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        ids.append(engine.add_request(request.prompt, params))
    wanted = set(ids)
    token_times: dict[str, list[float]] = {i: [] for i in ids}
    finals: dict[str, Any] = {}
    utilization: list[float] = []
    bar = _progress(len(ids), progress, desc, progress_stream)
    try:
        while len(finals) < len(ids):
            outputs = engine.step()
            now = time.monotonic()
            stats = engine.stats()
            total = stats["kv_blocks_total"]
            utilization.append((total - stats["kv_blocks_free"]) / total if total else 0.0)
            for out in outputs:
                if out.request_id not in wanted:
                    continue
                times = token_times[out.request_id]
                times.extend([now] * (len(out.token_ids) - len(times)))
                if out.finished:
                    finals[out.request_id] = out
                    bar.update(1)
    finally:
        bar.close()
    elapsed = time.monotonic() - started
    stats1 = engine.stats()
    ttft = [finals[i].metrics.time_to_first_token for i in ids if finals[i].metrics.time_to_first_token is not None]
    gaps = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    weights = engine.runner.model.weight_nbytes()
    peak = memory.stats().peak
    return BenchResult(
        num_requests=len(ids), input_tokens=sum(len(finals[i].prompt_token_ids) for i in ids),
        output_tokens=sum(len(finals[i].token_ids) for i in ids), elapsed_s=elapsed,
        ttft_s=percentiles(ttft), per_token_s=percentiles(gaps), peak_memory=weights + peak, weight_bytes=weights,
        allocator_peak=peak, kv_blocks_total=stats1["kv_blocks_total"],
        kv_utilization_peak=max(utilization, default=0.0),
        kv_utilization_mean=sum(utilization) / len(utilization) if utilization else 0.0,
        num_steps=stats1["num_steps"] - stats0["num_steps"],
        num_preemptions=stats1["num_preemptions"] - stats0["num_preemptions"], warmup_s=warmup_s)


def run_bench(cfg: DictConfig, workload: Workload, *, runtime: Runtime | None = None, progress: bool | None = None,
              progress_stream: Any = None, desc: str = "bench", warmup: bool = True) -> BenchResult:
    """Start an engine for ``cfg`` (on ``runtime`` when given), run ``workload`` (after a warm-up unless
    ``warmup=False``), close the engine."""
    engine = LLMEngine(cfg, runtime=runtime)
    try:
        return run_workload(engine, workload, progress=progress, progress_stream=progress_stream, desc=desc,
                            warmup=warmup)
    finally:
        engine.close()
