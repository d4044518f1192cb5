"""``streams=cuda``: CUDA streams and events.

The compute stream is the device's current stream at creation (where torch
puts work by default); the comm stream is a separate stream, so collectives
can overlap compute. ``submit(fn, *args)`` runs ``fn`` on the host at once,
with the stream made current, so the kernels it launches queue on that
stream and run asynchronously. Host-side failures of submitted work follow
the contract's asynchronous-error rule: the first is kept, later work on
that stream is skipped, and ``synchronize`` re-raises it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kunlun_infer.capabilities import Event, Stream, Streams


class CudaEvent(Event):
    """A ``torch.cuda.Event`` recorded on a stream."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def query(self) -> bool:
        return bool(self.raw.query())

    def synchronize(self) -> None:
        self.raw.synchronize()


class CudaStream(Stream):
    """Wraps one ``torch.cuda.Stream``."""

    def __init__(self, raw: Any, api: Any) -> None:
        self.raw = raw
        self.api = api
        self._error: BaseException | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._error is not None:
            return  # the stream failed: skip until synchronize reports it
        try:
            with self.api.stream(self.raw):
                fn(*args)
        except Exception as exc:  # noqa: BLE001 - re-raised by synchronize
            self._error = exc

    def record_event(self) -> CudaEvent:
        event = self.api.Event()
        event.record(self.raw)
        return CudaEvent(event)

    def wait_event(self, event: Event) -> None:
        if isinstance(event, CudaEvent):
            self.raw.wait_event(event.raw)
        else:
            event.synchronize()

    def synchronize(self) -> None:
        self.raw.synchronize()
        error, self._error = self._error, None
        if error is not None:
            raise error


class CudaStreams(Streams):
    """The device's current stream for compute, a new stream for comm."""

    name = "cuda"

    def __init__(self, device: Any) -> None:
        api = getattr(device, "api", torch.cuda)
        index = device.index
        self._compute = CudaStream(api.current_stream(index), api)
        self._comm = CudaStream(api.Stream(device=index), api)

    def compute_stream(self) -> CudaStream:
        return self._compute

    def comm_stream(self) -> CudaStream:
        return self._comm

    @property
    def asynchronous(self) -> bool:
        """Kernels queue on the GPU and run after their launch returns (hook API 1.7)."""
        return True

    def close(self) -> None:
        self.synchronize()
