"""Server metrics in the Prometheus text exposition format (version 0.0.4), without a client library.

Counters and histograms are updated from the engine-loop thread and the
HTTP handlers, and read by ``GET /metrics``; one lock guards them. Gauges
(queue depth, running sequences, KV usage) are read at scrape time from the
engine loop's latest snapshot of ``engine.stats()``.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Collection, Iterable, Mapping

PREFIX = "kunlun_infer"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""

    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{escape(str(v))}"' for k, v in sorted(labels.items())) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Counter:
    """A monotonically growing count, optionally split by labels."""

    kind = "counter"

    def __init__(self, name: str, help: str) -> None:
        self.name, self.help = f"{PREFIX}_{name}", help
        self._values: dict[tuple[tuple[str, str], ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(tuple(sorted(labels.items())), 0.0)

    def samples(self) -> Iterable[str]:
        for key, value in sorted(self._values.items()):
            yield f"{self.name}{_labels(dict(key))} {_number(value)}"


class Histogram:
    """Observations counted into cumulative ``le`` buckets, with their sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help = f"{PREFIX}_{name}", help
        self.buckets = buckets
        self._counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def samples(self) -> Iterable[str]:
        cumulative = 0
        for bound, count in zip((*self.buckets, math.inf), self._counts):
            cumulative += count
            yield f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}'
        yield f"{self.name}_sum {_number(self.sum)}"
        yield f"{self.name}_count {self.count}"


class Gauge:
    """A value read when scraped (``kind="counter"`` for a total kept elsewhere, e.g. in the engine)."""

    def __init__(self, name: str, help: str, read: Callable[[], float], kind: str = "gauge") -> None:
        self.name, self.help = f"{PREFIX}_{name}", help
        self.read = read
        self.kind = kind

    def samples(self) -> Iterable[str]:
        yield f"{self.name} {_number(self.read())}"


class ServerMetrics:
    """Every metric the server exposes. ``stats`` returns the engine loop's latest stats snapshot."""

    def __init__(self, stats: Callable[[], Mapping[str, float]], queued: Callable[[], int]) -> None:
        self.lock = threading.Lock()
        self.http_requests = Counter("http_requests_total", "HTTP requests answered, by endpoint and status code.")
        self.requests_finished = Counter("requests_finished_total",
                                         "Engine requests finished, by finish reason (stop, length, abort).")
        self.requests_rejected = Counter("requests_rejected_total",
                                         "Requests refused before reaching the engine, by reason.")
        self.prompt_tokens = Counter("prompt_tokens_total", "Prompt tokens of finished requests.")
        self.ttft = Histogram("time_to_first_token_seconds", "Arrival to first generated token.", LATENCY_BUCKETS)
        self.latency = Histogram("request_latency_seconds", "Arrival to the last token, per finished sample.",
                                 LATENCY_BUCKETS)
        self.tpot = Histogram("time_per_output_token_seconds", "Mean time between tokens after the first.",
                              TOKEN_LATENCY_BUCKETS)
        self.step_duration = Histogram("step_duration_seconds", "Duration of one engine step.", LATENCY_BUCKETS)
        self.batch_size = Histogram("batch_size", "Sequences run by one engine step.", BATCH_BUCKETS)

        def stat(key: str) -> Callable[[], float]:
            return lambda: float(stats().get(key, 0))

        def kv_usage() -> float:
            s = stats()
            total = s.get("kv_blocks_total") or 0
            return (1.0 - s.get("kv_blocks_free", 0) / total) if total else 0.0

        self.gauges = [
            Gauge("generation_tokens_total", "Tokens generated.", stat("num_generated_tokens"), kind="counter"),
            Gauge("computed_tokens_total", "Tokens run through the model (prompts and decodes).",
                  stat("num_computed_tokens"), kind="counter"),
            Gauge("engine_steps_total", "Engine steps run.", stat("num_steps"), kind="counter"),
            Gauge("num_requests_running", "Sequences in the running batch.", stat("num_running")),
            Gauge("num_requests_waiting", "Queue depth: sequences waiting for a slot plus requests not yet "
                                          "handed to the engine.", lambda: stat("num_waiting")() + queued()),
            Gauge("kv_cache_usage_ratio", "Share of KV blocks in use (0-1).", kv_usage),
            Gauge("kv_blocks_free", "KV blocks no sequence uses.", stat("kv_blocks_free")),
            Gauge("kv_blocks_total", "KV blocks in the cache.", stat("kv_blocks_total")),
            Gauge("preemptions_total", "Sequences preempted so far.", stat("num_preemptions"), kind="counter"),
            Gauge("prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache so far.",
                  stat("prefix_cache_hit_tokens"), kind="counter"),
            Gauge("spec_draft_tokens_total", "Speculative decoding: draft tokens checked.",
                  stat("spec_draft_tokens"), kind="counter"),
            Gauge("spec_accepted_tokens_total", "Speculative decoding: draft tokens kept.",
                  stat("spec_accepted_tokens"), kind="counter"),
            Gauge("spec_acceptance_rate", "Speculative decoding: share of draft tokens kept (0-1).",
                  stat("spec_acceptance_rate")),
            Gauge("spec_tokens_per_step", "Speculative decoding: tokens a checked sequence gains per step.",
                  stat("spec_tokens_per_step")),
        ]

    def observe_step(self, duration_s: float, batch_size: int) -> None:
        with self.lock:
            self.step_duration.observe(duration_s)
            if batch_size:
                self.batch_size.observe(batch_size)

    def observe_finished(self, output: object) -> None:
        """Account one finished sample (a :class:`RequestOutput`)."""
        m = output.metrics  # type: ignore[attr-defined]
        with self.lock:
            self.requests_finished.inc(reason=str(output.finish_reason))  # type: ignore[attr-defined]
            if output.index == 0:  # type: ignore[attr-defined]
                self.prompt_tokens.inc(len(output.prompt_token_ids))  # type: ignore[attr-defined]
            if m.time_to_first_token is not None:
                self.ttft.observe(m.time_to_first_token)
            if m.finished_time is not None:
                self.latency.observe(m.finished_time - m.arrival_time)
            if m.time_per_output_token is not None:
                self.tpot.observe(m.time_per_output_token)

    def render(self, only: Collection[str] | None = None) -> str:
        """The exposition text for ``GET /metrics``; ``only``: just these families (names without the prefix)."""
        lines: list[str] = []
        with self.lock:
            metrics = [self.http_requests, self.requests_finished, self.requests_rejected, self.prompt_tokens,
                       self.ttft, self.latency, self.tpot, self.step_duration,
                       self.batch_size, *self.gauges]
            if only is not None:
                metrics = [m for m in metrics if m.name.removeprefix(f"{PREFIX}_") in only]
            for metric in metrics:
                lines += [f"# HELP {metric.name} {metric.help}", f"# TYPE {metric.name} {metric.kind}"]
                lines += list(metric.samples())
        return "\n".join(lines) + "\n"


def _families(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """Exposition text as ``{family: (HELP/TYPE lines, samples)}``, in order."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    current: tuple[list[str], list[str]] | None = None
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            name = line.split(" ", 3)[2]
            current = families.setdefault(name, ([], []))
            if len(current[0]) < 2 and not any(h.startswith(line[:7]) for h in current[0]):
                current[0].append(line)
        elif line and current is not None:
            current[1].append(line)
    return families


def _with_label(sample: str, key: str, value: str) -> str:
    """``sample`` with ``key="value"`` added to its labels."""
    name, _, rest = sample.partition(" ")
    label = f'{key}="{value}"'
    if name.endswith("}"):
        return f"{name[:-1]},{label}}} {rest}"
    return f"{name}{{{label}}} {rest}"


def merge_labelled(own: str, parts: Mapping[str, str], *, label: str) -> str:
    """``own`` exposition text plus each of ``parts`` (``{label value: text}``) with ``label`` added to its
    samples; a family present in several keeps one HELP and TYPE and all their samples."""
    merged = _families(own)
    for value, text in parts.items():
        for name, (header, samples) in _families(text).items():
            into = merged.setdefault(name, (header, []))
            into[1].extend(_with_label(sample, label, value) for sample in samples)
    lines: list[str] = []
    for header, samples in merged.values():
        lines += header + samples
    return "\n".join(lines) + "\n"
