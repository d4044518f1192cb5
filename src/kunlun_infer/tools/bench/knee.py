"""The knee of a sweep: the smallest setting past which more batch buys little throughput.

Definition used throughout: the knee is the smallest swept value whose
throughput reaches ``fraction`` (default 90 %) of the best throughput of the
sweep. Beyond it, raising the value adds at most the remaining 10 % of
throughput while latency keeps growing. Unlike "the first point whose
marginal gain drops below 10 %", it does not stop at a noisy dip before the
curve has actually flattened.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_FRACTION = 0.9


def find_knee(values: Sequence[float], throughputs: Sequence[float], *, fraction: float = DEFAULT_FRACTION) -> int:
    """Index of the knee in ``values`` (sorted ascending internally; the index refers to the input order)."""
    if len(values) != len(throughputs) or not values:
        raise ValueError("find_knee needs one throughput per value, and at least one value")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction} must be in (0, 1]")
    best = max(throughputs)
    order = sorted(range(len(values)), key=lambda i: values[i])
    return next(i for i in order if throughputs[i] >= fraction * best)


def marginal_gains(values: Sequence[float], throughputs: Sequence[float]) -> list[float | None]:
    """Relative throughput gain of each point over the previous (ascending) one; ``None`` for the first."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    gains: list[float | None] = [None] * len(values)
    for prev, cur in zip(order, order[1:]):
        gains[cur] = (throughputs[cur] - throughputs[prev]) / throughputs[prev] if throughputs[prev] else None
    return gains
