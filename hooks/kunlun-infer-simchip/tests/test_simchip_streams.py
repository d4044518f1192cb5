"""Worker-thread streams: queued work, real ordering, events across streams, sticky errors."""

import threading
import time

import pytest
import torch

from kunlun_infer_simchip.config import MIB
from kunlun_infer_simchip.device import SimchipDevice
from kunlun_infer_simchip.streams import SimchipStreams


@pytest.fixture
def streams():
    provider = SimchipStreams()
    yield provider
    provider.close()


def test_submit_returns_before_the_work_runs_and_synchronize_waits(streams):
    stream = streams.compute_stream()
    gate = threading.Event()
    done = []
    stream.submit(gate.wait)
    stream.submit(done.append, "ran")
    assert done == []  # queued behind the gate, the caller was not blocked
    gate.set()
    stream.synchronize()
    assert done == ["ran"]


def test_work_runs_in_submission_order_on_one_worker_thread(streams):
    stream = streams.compute_stream()
    seen = []
    for i in range(50):
        stream.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
    stream.synchronize()
    assert [i for i, _ in seen] == list(range(50))
    threads = {name for _, name in seen}
    assert len(threads) == 1 and threading.current_thread().name not in threads


def test_compute_and_comm_streams_are_distinct_and_overlap(streams):
    assert streams.overlaps
    assert streams.compute_stream().worker is not streams.comm_stream().worker


def test_event_completes_only_when_the_worker_reaches_it(streams):
    stream = streams.compute_stream()
    gate = threading.Event()
    stream.submit(gate.wait)
    event = stream.record_event()
    time.sleep(0.02)
    assert not event.query()
    gate.set()
    event.synchronize()
    assert event.query()


def test_wait_event_orders_work_across_streams(streams):
    compute, comm = streams.compute_stream(), streams.comm_stream()
    log = []
    gate = threading.Event()
    compute.submit(gate.wait)
    compute.submit(log.append, "produce")
    produced = compute.record_event()
    comm.wait_event(produced)
    comm.submit(log.append, "consume")
    time.sleep(0.02)
    assert log == []  # comm's worker is held at the event although it is otherwise idle
    gate.set()
    streams.synchronize()
    assert log == ["produce", "consume"]


def test_errors_are_sticky_skip_later_work_and_reraise_on_synchronize(streams):
    stream = streams.compute_stream()
    ran = []
    stream.submit(lambda: 1 / 0)
    stream.submit(ran.append, "after")
    with pytest.raises(ZeroDivisionError):
        stream.synchronize()
    assert ran == []
    stream.submit(ran.append, "recovered")  # the error was reported: the stream works again
    stream.synchronize()
    assert ran == ["recovered"]


def test_waiting_on_a_failed_stream_propagates_the_error(streams):
    compute, comm = streams.compute_stream(), streams.comm_stream()
    compute.submit(lambda: (_ for _ in ()).throw(RuntimeError("kernel fault")))
    event = compute.record_event()
    comm.wait_event(event)
    with pytest.raises(RuntimeError, match="kernel fault"):
        event.synchronize()
    with pytest.raises(RuntimeError, match="kernel fault"):
        comm.synchronize()
    with pytest.raises(RuntimeError, match="kernel fault"):
        compute.synchronize()


def test_grad_and_inference_mode_travel_with_the_work(streams):
    stream = streams.compute_stream()
    seen = []
    with torch.inference_mode():
        stream.submit(lambda: seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled())))
    with torch.no_grad():
        stream.submit(lambda: seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled())))
    stream.synchronize()
    assert seen == [(True, False), (False, False)]


def test_tensor_work_on_the_worker_is_visible_after_synchronize(streams):
    stream = streams.compute_stream()
    x = torch.zeros(4)
    stream.submit(x.add_, 3.0)
    stream.submit(x.mul_, 2.0)
    stream.synchronize()
    assert x.tolist() == [6.0] * 4


def test_device_synchronize_waits_for_its_streams_and_close_stops_workers():
    device = SimchipDevice(capacity=4 * MIB)
    device.open()
    provider = SimchipStreams(device)
    out = []
    provider.comm_stream().submit(lambda: (time.sleep(0.05), out.append("done")))
    device.synchronize()
    assert out == ["done"]
    workers = [provider.compute_stream().worker, provider.comm_stream().worker]
    provider.close()
    device.close()
    assert not any(w.is_alive() for w in workers)
    with pytest.raises(RuntimeError, match="closed"):
        provider.compute_stream().submit(print)
