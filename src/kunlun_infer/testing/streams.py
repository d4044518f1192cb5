"""Conformance of a streams provider: in-order execution, cross-stream events, synchronize, errors, and the
read-back of an overlapped step (hook API 1.7)."""

from __future__ import annotations

import time

import torch

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


def check_readback(streams: Streams, device: torch.device) -> None:
    """What an overlapped step relies on (``scheduler.overlap_steps``): device results copied to the host
    without blocking, then an event of the compute stream recorded, hold their values once the event completes,
    while work queued after the event runs on; and ``asynchronous`` is a bool. Any plugin must pass this (the
    engine may be asked to overlap, ``on``); one whose ``asynchronous`` is true is relied on for it."""
    _expect(isinstance(streams.asynchronous, bool), "streams: asynchronous must be a bool (hook API 1.7)")
    a = torch.randint(-3, 4, (512, 512), generator=torch.Generator().manual_seed(0)).float()  # exact products
    want = (a @ a).sum(dim=-1).long()
    on_device = a.to(device)
    tokens = (on_device @ on_device).sum(dim=-1).long()  # work still queued on an asynchronous device
    host = tokens.to("cpu", non_blocking=True)
    ready = streams.compute_stream().record_event()
    later = on_device @ on_device  # queued behind the event: the read-back must not wait for it to be right
    ready.synchronize()
    _expect(ready.query(), "streams: an event must report completion once synchronize() returned")
    _expect(torch.equal(host, want),
            "streams: a non-blocking copy to the host, read once an event recorded after it completed, did not "
            "hold the device's values: the event must complete only after the copy (order it behind the copy on "
            "the compute stream)")
    del later
