"""Sweep one config key (``scheduler.max_num_seqs=1,2,4,8,16``): one run per value, the knee, a table.

Each value is composed into the config like any override, so anything
composable can be swept. The same workload runs at every value; the knee
(:mod:`kunlun_infer.tools.bench.knee`) is taken on output tokens per second,
since that is what a larger batch buys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kunlun_infer.errors import ConfigError
from kunlun_infer.hookspecs import CAPABILITIES
from kunlun_infer.runtime import PluginManager, Runtime
from kunlun_infer.runtime import compose_config
from kunlun_infer.tools.bench.knee import DEFAULT_FRACTION, find_knee, marginal_gains
from kunlun_infer.tools.bench.run import BenchResult, run_bench
from kunlun_infer.tools.bench.workload import Workload
from kunlun_infer.tools.sizes import format_bytes


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """``"scheduler.max_num_seqs=1,2,4"`` → ``("scheduler.max_num_seqs", [1, 2, 4])``."""
    key, sep, values = text.partition("=")
    items = [_value(v.strip()) for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not items:
        raise ConfigError(f"--sweep {text!r}: write KEY=V1,V2,… (e.g. scheduler.max_num_seqs=1,2,4,8,16)")
    if len(set(map(str, items))) != len(items):
        raise ConfigError(f"--sweep {text!r}: a value appears twice")
    return key.strip(), items


def run_sweep(overrides: Sequence[str], key: str, values: Sequence[Any], workload: Workload, *,
              plugin_manager: PluginManager | None = None, runtime: Runtime | None = None,
              fraction: float = DEFAULT_FRACTION, progress: bool | None = None,
              progress_stream: Any = None, warmup: bool = True) -> dict[str, Any]:
    """Run ``workload`` at every value of ``key`` (each engine warmed up first unless ``warmup=False``); returns
    the sweep as a JSON-ready dict.

    ``runtime`` is reused for every point when the key is not a capability
    choice and the run is single-device; otherwise each engine builds its own.
    """
    from tqdm.auto import tqdm


    reuse = runtime is not None and key.split(".", 1)[0] not in CAPABILITIES
    results: list[BenchResult] = []
    outer = tqdm(values, desc=f"sweep {key}", unit="run", file=progress_stream, leave=False,
                 disable=None if progress is None else not progress)
    for value in outer:
        cfg = compose_config([*overrides, f"{key}={value}"], plugin_manager=plugin_manager)
        on = runtime if reuse and int(cfg.parallel.tensor_size) == 1 else None
        result = run_bench(cfg, workload, runtime=on, progress=progress, progress_stream=progress_stream,
                           desc=f"{key}={value}", warmup=warmup)
        result.setting = {key: value}
        results.append(result)
    outer.close()
    return sweep_to_dict(key, list(values), results, workload, fraction)


def sweep_to_dict(key: str, values: list[Any], results: list[BenchResult], workload: Workload,
                  fraction: float = DEFAULT_FRACTION) -> dict[str, Any]:
    """The sweep's JSON form, with the knee when the values are numbers."""
    throughput = [r.output_tokens_per_s for r in results]
    gains = marginal_gains(values, throughput) if all(isinstance(v, (int, float)) for v in values) else \
        [None] * len(values)
    points = [{"value": v, **r.to_dict(), "marginal_gain": g} for v, r, g in zip(values, results, gains)]
    knee = None
    if all(isinstance(v, (int, float)) for v in values):
        i = find_knee(values, throughput, fraction=fraction)
        knee = {"index": i, "value": values[i], "output_tokens_per_s": throughput[i],
                "definition": f"smallest {key} reaching {fraction:.0%} of the best output tokens/s"}
    return {"key": key, "values": values, "workload": workload.description, "fraction": fraction,
            "points": points, "knee": knee}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def sweep_table(sweep: dict[str, Any]) -> list[str]:
    """A text table of the sweep, the knee's row starred."""
    header = [sweep["key"], "OUT TOK/S", "IN TOK/S", "GAIN", "TTFT P50/P99 MS", "PER-TOKEN P50/P99 MS", "KV PEAK",
              "PEAK MEM", "PREEMPT"]
    knee = sweep["knee"]["index"] if sweep["knee"] else None
    rows = [header]
    for i, p in enumerate(sweep["points"]):
        gain = p["marginal_gain"]
        rows.append([f"{p['value']}{' *' if i == knee else ''}", f"{p['output_tokens_per_s']:.1f}",
                     f"{p['input_tokens_per_s']:.1f}", "-" if gain is None else f"{gain:+.0%}",
                     f"{_ms(p['ttft_s']['p50'])}/{_ms(p['ttft_s']['p99'])}",
                     f"{_ms(p['per_token_s']['p50'])}/{_ms(p['per_token_s']['p99'])}",
                     f"{p['kv_utilization_peak']:.0%}", format_bytes(p["peak_memory"]), str(p["num_preemptions"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    if sweep["knee"]:
        lines.append(f"knee (*): {sweep['key']}={sweep['knee']['value']} — {sweep['knee']['definition']}")
    return lines
