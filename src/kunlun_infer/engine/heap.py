"""Python's garbage collector in a serving process: what start-up built is not walked again.

A full collection walks every object the collector tracks. Once an engine is
up that is a few hundred thousand (the model's modules, the tokenizer, the
plugins, every imported library): 70 ms with the default model, 130-160 ms in
a process that also imported ``transformers``, on a host CPU. Steady serving
allocates enough for one about every 20 seconds, and the step it lands in is
that much late for every request in it.

So a serving loop (the HTTP server's, a fleet replica's, a worker rank's)
:func:`hold`\\ s the heap once its engine or shard is loaded: one collection,
then every object that survived is frozen (``gc.freeze``) and later
collections skip it. When the last loop of the process ends,
:func:`release` unfreezes them, so that whatever cycles the closed engines
left are found by the next full collection. The embedded ``LLM`` does not
freeze its caller's heap: that process is the caller's.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
#: serving loops of this process between :func:`hold` and :func:`release`
_holders = 0


def hold() -> None:
    """A serving loop has its engine: collect once, then freeze every object that survived."""
    global _holders
    with _lock:
        _holders += 1
        gc.collect()
        gc.freeze()


def release() -> None:
    """A serving loop that called :func:`hold` has ended; the last one to end unfreezes the heap."""
    global _holders
    with _lock:
        _holders = max(_holders - 1, 0)
        if not _holders:
            gc.unfreeze()


@contextlib.contextmanager
def held() -> Iterator[None]:
    """:func:`hold` for the length of the block."""
    hold()
    try:
        yield
    finally:
        release()


def num_holders() -> int:
    """Serving loops of this process holding the heap frozen."""
    return _holders
