"""The sweep plot: throughput (left) and latency (right) against the swept value, the knee marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kunlun_infer.errors import KunlunInferError


def plot_sweep(sweep: dict[str, Any], path: str | Path) -> Path:
    """Write the PNG for a sweep dict (as :func:`kunlun_infer.tools.bench.sweep.sweep_to_dict` makes it)."""
    try:
        import matplotlib
    except ImportError:
        raise KunlunInferError("the sweep plot needs matplotlib: pip install 'kunlun-infer[bench]'") from None

    matplotlib.use("Agg", force=True)  # files only, never a window
    import matplotlib.pyplot as plt

    points = sweep["points"]
    xs = [p["value"] for p in points]
    knee = sweep.get("knee")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    try:
        left.plot(xs, [p["output_tokens_per_s"] for p in points], "o-", label="output tokens/s")
        left.plot(xs, [p["input_tokens_per_s"] for p in points], "s--", label="input tokens/s")
        left.set_ylabel("tokens / s")
        left.set_title("throughput")
        for name, key, style in (("TTFT p50", ("ttft_s", "p50"), "o-"), ("TTFT p99", ("ttft_s", "p99"), "o:"),
                                 ("per-token p50", ("per_token_s", "p50"), "s-"),
                                 ("per-token p99", ("per_token_s", "p99"), "s:")):
            ys = [(p[key[0]][key[1]] or 0.0) * 1e3 for p in points]
            right.plot(xs, ys, style, label=name)
        right.set_ylabel("ms")
        right.set_title("latency")
        numeric = all(isinstance(x, (int, float)) and x > 0 for x in xs)
        for ax in (left, right):
            ax.set_xlabel(sweep["key"])
            if numeric and max(xs) / min(xs) >= 8:
                ax.set_xscale("log", base=2)
                ax.set_xticks(xs, [str(x) for x in xs])  # the swept values, not powers of two
            if knee is not None:
                ax.axvline(knee["value"], color="grey", linestyle="--", linewidth=1,
                           label=f"knee: {sweep['key']}={knee['value']}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"kunlun-infer bench: {sweep['workload']}", fontsize=9)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
