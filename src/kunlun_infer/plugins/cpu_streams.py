"""Built-in streams plugin ``sync``: one synchronous stream serves compute and comm.

Submitted work runs at once in the caller's thread, so order is submission
order and every event is complete as soon as it is recorded. An error of
submitted work is raised by ``submit`` itself, where it happened.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kunlun_infer.version import __version__
from kunlun_infer.capabilities import Device, Event, Stream, Streams
from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.plugins.cpu_device import stack_versions

PLUGIN_NAME = "cpu-streams"


class DoneEvent(Event):
    """An event of a synchronous stream: complete from the start."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class SyncStream(Stream):
    """Runs each submitted function immediately, in order."""

    def __init__(self) -> None:
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._closed:
            raise RuntimeError("stream used after close()")
        fn(*args)

    def record_event(self) -> Event:
        return DoneEvent()

    def wait_event(self, event: Event) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self._closed = True


class SyncStreams(Streams):
    """Compute and comm share one :class:`SyncStream`."""

    name = "sync"

    def __init__(self) -> None:
        self._stream = SyncStream()

    def compute_stream(self) -> Stream:
        return self._stream

    def comm_stream(self) -> Stream:
        return self._stream

    def close(self) -> None:
        self._stream.close()


def make_sync(*, config: Any, device: Device) -> SyncStreams:
    return SyncStreams()


@hookimpl
def kunlun_infer_plugin_info() -> PluginInfo:
    return PluginInfo(name=PLUGIN_NAME, version=__version__, api=">=1.0,<2", capabilities=("streams",),
                      stack=stack_versions(), description="one synchronous stream for compute and comm")


@hookimpl
def kunlun_infer_streams_factories() -> dict[str, Any]:
    return {"sync": make_sync}
