"""``streams=simchip``: asynchronous streams emulated by worker threads.

Each stream owns one worker thread and a FIFO queue, so work submitted to a
stream runs in submission order, off the caller's thread, while the caller
goes on. An event is a marker in a queue: it completes when the worker
reaches it. ``wait_event`` queues a marker that blocks the worker until the
other stream's event completes, which is how ordering across streams is
expressed. Like a real device's, errors are asynchronous and sticky: the
first exception raised by queued work is kept, later work on that stream is
skipped, and the next ``synchronize`` re-raises it (then the stream is usable
again). A stream waiting on an event of a failed stream fails with the same
error, since its input is garbage. The caller's grad mode and inference mode
travel with each piece of work, so the worker computes as the caller would.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from kunlun_infer.capabilities import Event, Stream, Streams

from kunlun_infer_simchip import CHIP_NAME

_STOP = object()


class WorkerEvent(Event):
    """Completes when its stream's worker reaches it; carries the stream's error at that point."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def _complete(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error

    def wait(self, timeout: float | None = None) -> bool:
        """Block until complete (or ``timeout`` seconds); True when complete."""
        return self._done.wait(timeout)


class WorkerStream(Stream):
    """One ordered queue of work run by its own daemon worker thread."""

    _ids = itertools.count()

    def __init__(self, label: str) -> None:
        self.label = label
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._closed = False
        self.worker = threading.Thread(target=self._run, name=f"{CHIP_NAME}-{label}-{next(self._ids)}",
                                       daemon=True)
        self.worker.start()

    # ------------------------------------------------------------------ worker side

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            kind, payload = item
            if kind == "event":
                payload._complete(self._error)
            elif kind == "wait":
                payload.wait()
                if payload.error is not None:
                    self._fail(payload.error)
            elif self._error is None:  # work after a failure is skipped until synchronize
                fn, args, grad, inference = payload
                try:
                    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                        fn(*args)
                except BaseException as exc:  # noqa: BLE001 - re-raised on the host by synchronize
                    self._fail(exc)

    def _fail(self, error: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = error

    # ------------------------------------------------------------------ host side

    def _put(self, item: Any) -> None:
        if self._closed:
            raise RuntimeError(f"{CHIP_NAME} stream '{self.label}' is closed")
        self._queue.put(item)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        self._put(("work", (fn, args, torch.is_grad_enabled(), torch.is_inference_mode_enabled())))

    def record_event(self) -> WorkerEvent:
        event = WorkerEvent()
        self._put(("event", event))
        return event

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, WorkerEvent):
            event.synchronize()  # a foreign event: the host waits for it instead
            return
        self._put(("wait", event))

    def drain(self) -> None:
        """Wait for everything queued so far, without raising."""
        if not self._closed and self.worker.is_alive():
            self.record_event().wait()

    def synchronize(self) -> None:
        self.drain()
        with self._error_lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Let queued work finish, then stop the worker thread."""
        if self._closed:
            return
        self.drain()
        self._closed = True
        self._queue.put(_STOP)
        self.worker.join()


class SimchipStreams(Streams):
    """A compute stream and a separate comm stream, each with its own worker thread."""

    name = CHIP_NAME

    def __init__(self, device: Any = None) -> None:
        self._compute = WorkerStream("compute")
        self._comm = WorkerStream("comm")
        for stream in (self._compute, self._comm):
            register = getattr(device, "register_stream", None)
            if register is not None:
                register(stream)

    def compute_stream(self) -> WorkerStream:
        return self._compute

    def comm_stream(self) -> WorkerStream:
        return self._comm

    def close(self) -> None:
        self._compute.close()
        self._comm.close()
