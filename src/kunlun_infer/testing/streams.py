"""Conformance of a streams provider: in-order execution, cross-stream events, synchronize, errors."""

from __future__ import annotations

import time

from kunlun_infer.capabilities import Streams
from kunlun_infer.testing.compare import ConformanceError


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise ConformanceError(message)


def check_streams(streams: Streams) -> None:
    """Order within a stream, events across streams, synchronize, and error reporting."""
    compute, comm = streams.compute_stream(), streams.comm_stream()
    _expect(streams.overlaps == (compute is not comm), "streams: overlaps must say whether the comm stream differs")
    seen: list[str] = []

    def step(label: str, delay: float = 0.0) -> None:
        if delay:
            time.sleep(delay)
        seen.append(label)

    for i in range(5):
        compute.submit(step, f"c{i}", 0.002 * (5 - i))
    compute.synchronize()
    _expect(seen == [f"c{i}" for i in range(5)], f"streams: work on one stream ran out of order: {seen}")

    seen.clear()
    compute.submit(step, "before", 0.02)
    event = compute.record_event()
    comm.wait_event(event)
    comm.submit(step, "after")
    comm.synchronize()
    _expect(seen == ["before", "after"], f"streams: work after wait_event ran before the event's work: {seen}")
    _expect(event.query(), "streams: an event must report completion once its work has run")
    event.synchronize()

    seen.clear()
    compute.submit(step, "last", 0.01)
    streams.synchronize()
    _expect(seen == ["last"], "streams: synchronize() returned before submitted work finished")

    def fail() -> None:
        raise RuntimeError("deliberate failure")

    try:
        compute.submit(fail)
        compute.synchronize()
    except Exception as exc:  # noqa: BLE001 - the error may surface from submit or from synchronize
        _expect("deliberate failure" in str(exc) or "deliberate failure" in str(exc.__cause__),
                f"streams: a failing submission surfaced as an unrelated error: {exc!r}")
    else:
        raise ConformanceError("streams: an exception raised by submitted work was neither raised by submit() "
                               "nor by synchronize()")
