"""glibc's allocator in a process that serves: which arena a thread allocates from.

The CPU memory plugin sets what glibc keeps free between steps
(``plugins/cpu_memory.py``); this module holds what a serving process
decides for itself before its threads start (:func:`one_host_arena`), and
the C library those settings go through (:func:`glibc`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

log = logging.getLogger(__name__)

#: ``mallopt``'s parameter for the most arenas glibc makes (``malloc.h``)
_M_ARENA_MAX = -8


@functools.cache
def glibc() -> Any:
    """The process's C library where it is glibc (``mallopt``, ``malloc_trim``), else ``None``; looked up once."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc alone
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        libc.malloc_info.argtypes, libc.malloc_info.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_int
        libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
        libc.open_memstream.restype = ctypes.c_void_p
        libc.fclose.argtypes, libc.fclose.restype = [ctypes.c_void_p], ctypes.c_int
        libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
        return libc
    except (OSError, AttributeError):
        return None


def host_arenas() -> int | None:
    """How many arenas glibc's allocator has made in this process (``malloc_info``); ``None`` without glibc."""
    libc = glibc()
    if libc is None:
        return None
    text, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(text), ctypes.byref(size))
    if not stream:
        return None
    try:
        libc.malloc_info(0, stream)
    finally:
        libc.fclose(stream)
    try:
        return (text.value or b"").count(b"<heap nr=")
    finally:
        libc.free(ctypes.cast(text, ctypes.c_void_p))


def one_host_arena() -> bool:
    """Have every thread of this process allocate from glibc's main arena (``M_ARENA_MAX`` 1); ``False``, with
    nothing changed, without glibc or once a thread has an arena of its own.

    For a process of its own that steps the engine in a thread other than
    the main one (the server's): glibc gives such a thread an arena that
    grows in heaps of 64 MiB, where a block larger than that is mapped afresh
    and faulted in every step, whatever the CPU memory plugin's policy
    (``cpu_memory.keep_freed_host_memory``) set. The CPU ops' own outputs
    avoid that (``cpu_memory.LargeHostBlocks``), but not what torch makes: a
    decode step's float32 logits over a 151936-token vocabulary from 111 rows
    on, and the sampler's probabilities over them. From the main arena they
    come from the heap that policy keeps: a step of 128 sequences of the 0.5B
    model in bf16, sampled with temperature, top-p and top-k, took 1.23x the
    main thread's time in a thread, and 1.08x with one arena (~36 000 minor
    faults a step gone). Each allocation then takes the one arena's lock; the
    server's threads (the HTTP loop, the engine loop, the kernels' threads
    with their scratch) allocate little besides the step's own tensors. It
    holds only while the main arena is the only one (glibc fixes its limit
    once it has made a few, and a thread keeps the arena it has), so call it
    before any thread starts work; an embedding application keeps glibc's own
    choice.
    """
    libc = glibc()
    if libc is None or host_arenas() != 1:
        return False
    held = libc.mallopt(_M_ARENA_MAX, 1) == 1
    if held:
        log.debug("host allocator: every thread allocates from the main arena")
    return held
