"""``ModelRuntime``: what building and running a model asks of a runtime.

A :class:`~kunlun_infer.runtime.Runtime` is one; so is a stand-in that
resolves ops its own way (``kunlun-infer doctor`` swaps one op at a time, tests
run the plain-torch references). The runtime may also offer the ops plugin's
attention backend (``attention_backend(spec)``), which the loader asks for
when it is there, and its memory allocator (``memory``), whose
``empty_cache`` the loader calls once the weights are in place.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from kunlun_infer.capabilities import Comm, Device, Streams
from kunlun_infer.runtime.optable import OpTable


class ModelRuntime(Protocol):
    """The device a model lives on, its collectives and streams, and its op table."""

    device: Device
    comm: Comm
    streams: Streams

    def resolve_ops(self, ops: Iterable[str]) -> OpTable:
        """The op table for ``ops``."""
        ...
