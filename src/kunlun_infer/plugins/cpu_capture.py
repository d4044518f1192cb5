"""Steps captured once and replayed without Python: the host CPU's counterpart of a device graph.

:func:`capture` runs a function once, as usual, while two things watch it:

- ``cpu_native.library()`` hands out a recorder, so every native kernel
  call runs and is kept (the C function and its arguments, pointers
  included);
- a torch dispatch mode sees every torch op of the region. Allocations and
  views are what a step of native kernels needs, and they are kept alive so
  that no recorded pointer dangles. Any other op — one that computes in
  torch (a reference fallback, an embedding lookup, a collective) or writes
  a tensor in place — would be skipped by a replay, so the capture is
  refused (``None``) and the caller keeps running that work eagerly.

The tensors the region allocated are then laid out again in one arena, by
the span of calls that touch each (first to last): buffers whose spans do
not overlap share memory, as the eager step's allocator shares freed
blocks, so a replay keeps the same few cache-warm buffers instead of a new
one per layer. Every captured step of a thread shares that arena (its
replays run one at a time), so a graph per batch size costs its outputs
only. The region's result keeps its own storage.

A replay makes the recorded calls again, in order, with pointers moved into
the arena; the inputs the region read (the caller's buffers, the weights,
the KV cache) are read at their current contents. Where the library has
``kunlun_replay`` (``native/replay.c``) and every call's arguments fit its
table, the calls are made from C, one ctypes call a replay; else one by one
from Python. A kernel reporting a failure (a nonzero status) stops the replay
with :class:`ReplayError`; the caller runs the step eagerly instead, which
raises the kernel's own error.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kunlun_infer import capabilities

#: ops that only allocate: their outputs are buffers of the region (uninitialised until a kernel writes them)
_ALLOCATIONS = frozenset({"aten::empty.memory_format", "aten::empty_like", "aten::empty_strided",
                          "aten::new_empty", "aten::new_empty_strided"})
#: ops that turn host values into a tensor: step data a replay would not see again
_HOST_VALUES = frozenset({"aten::lift_fresh", "aten::scalar_tensor"})
#: byte alignment of each buffer in the arena (a cache line, and every vector width the kernels use)
_ALIGN = 64


class CaptureRefused(Exception):
    """The region did work a replay would skip; the message names the op."""


class ReplayError(RuntimeError):
    """A kernel of the replay reported a failure; run the step eagerly to raise its own error."""


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class _Watch(TorchDispatchMode):
    """Keeps every tensor the region makes; refuses ops that compute or write."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[torch.Tensor] = []
        #: why the capture was refused (kept here too: the model's guards may re-raise the exception as another)
        self.refused = ""
        #: storage address -> bytes, of the buffers the region allocated
        self.allocated: dict[int, int] = {}

    def refuse(self, reason: str) -> CaptureRefused:
        self.refused = self.refused or reason
        return CaptureRefused(reason)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name + ("." + func._schema.overload_name if func._schema.overload_name else "")
        if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
            raise self.refuse(f"{name} writes a tensor in place")
        if func._schema.name in _HOST_VALUES:
            raise self.refuse(f"{name} makes a tensor of host values, which a replay would repeat")
        out = func(*args, **kwargs)
        results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.kept += results
        if name in _ALLOCATIONS or func._schema.name in _ALLOCATIONS:
            for t in results:
                base, nbytes = _storage(t)
                self.allocated[base] = nbytes
            return out
        # a weight oneDNN reordered is opaque (no storage): only an op that computes in torch reads one
        inputs = {_storage(t)[0] for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.layout is torch.strided}
        for t in results:
            if _storage(t)[0] not in inputs:
                raise self.refuse(f"{name} computes a new tensor in torch")
        return out


@dataclasses.dataclass
class _Call:
    function: Any
    args: list[Any]
    #: positions of the pointer arguments
    pointers: tuple[int, ...]
    #: the kernel returns a status (0 = done)
    checked: bool
    #: the library the function is from
    library: Any = None


class _Recorder:
    """Stands in for the native library during a capture: each call runs, and is kept."""

    def __init__(self, library: ctypes.CDLL, calls: list[_Call]) -> None:
        self._library = library
        self._calls = calls

    def __getattr__(self, name: str) -> Callable[..., Any]:
        function = getattr(self._library, name)
        pointers = tuple(i for i, t in enumerate(function.argtypes or ()) if t is ctypes.c_void_p)
        checked = function.restype is ctypes.c_int

        def record(*args: Any) -> Any:
            self._calls.append(_Call(function, list(args), pointers, checked, self._library))
            return function(*args)

        return record


_active = threading.local()


def recorder(library: ctypes.CDLL) -> Any:
    """What ``cpu_native.library()`` hands out: the recorder while this thread captures, else ``library``."""
    calls = getattr(_active, "calls", None)
    return library if calls is None else _Recorder(library, calls)


class _Arena(threading.local):
    """The scratch memory every captured step of one thread shares: replays in a thread run one at a time."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        #: bumped whenever the buffer moves, so that steps re-point their calls
        self.version = 0

    def reserve(self, nbytes: int) -> int:
        """The buffer's address, grown to at least ``nbytes`` first."""
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self.version += 1
        return self.buffer.data_ptr()


_arena = _Arena()

#: ctypes codes of the argument types replay.c passes as integers (pointers included), and as float32
_INTEGER_CODES = frozenset("bBhHiIlLqQP?")
_FLOAT_CODE = "f"


def _native_table(ready: list[tuple[Any, tuple[Any, ...], bool]], library: Any) -> tuple[Any, Any] | None:
    """``(kunlun_replay, its table of the calls)`` for replay.c, or ``None`` where the library has none or a call's
    arguments do not fit its table (then the calls are made from Python)."""
    replay = getattr(library, "kunlun_replay", None)
    layout = getattr(library, "kunlun_replay_layout", None)
    if replay is None or layout is None or not ready or replay(None, 0) != 0:  # -1: not this platform's convention
        return None
    ints, floats = layout(0), layout(1)

    class Record(ctypes.Structure):
        _fields_ = [("function", ctypes.c_void_p), ("ints", ctypes.c_int64 * ints),
                    ("floats", ctypes.c_float * floats), ("checked", ctypes.c_int64)]

    if ctypes.sizeof(Record) != layout(2):
        return None
    table = (Record * len(ready))()
    for record, (function, args, checked) in zip(table, ready):
        types = function.argtypes
        if types is None or len(types) != len(args):
            return None
        i = f = 0
        for kind, value in zip(types, args):
            code = getattr(kind, "_type_", None)
            if isinstance(value, ctypes._SimpleCData):
                value = value.value
            if code in _INTEGER_CODES and i < ints:
                value = int(value or 0)
                record.ints[i] = value - (1 << 64) if value >= 1 << 63 else value
                i += 1
            elif code == _FLOAT_CODE and f < floats:
                record.floats[f] = float(value)
                f += 1
            else:  # a double, a structure, or more arguments than the table holds
                return None
        record.function = ctypes.cast(function, ctypes.c_void_p).value
        record.checked = int(checked)
    return replay, table


class CapturedStep(capabilities.CapturedStep):
    """A captured region: :attr:`result` (its outputs, rewritten by every replay) and :meth:`replay`.

    The region's buffers live at ``offsets`` in this thread's shared arena;
    the calls are re-pointed whenever the arena has moved since they last
    ran.
    """

    def __init__(self, result: Any, calls: list[_Call], arena_args: list[list[tuple[int, int]]], keep: list[Any],
                 arena_bytes: int) -> None:
        self.result = result
        self._calls = calls
        #: per call: (argument position, offset in the arena) of the pointers into the region's buffers
        self._arena_args = arena_args
        self._keep = keep
        #: bytes of scratch the replays need between kernels (shared with the thread's other captured steps)
        self.arena_bytes = arena_bytes
        self._bound: tuple[int, int] | None = None
        self._ready: list[tuple[Any, tuple[Any, ...], bool]] = []
        libraries = {id(call.library): call.library for call in calls}
        #: the library whose replay.c makes the calls (all of them its own), or None: from Python
        self._library = next(iter(libraries.values())) if len(libraries) == 1 else None
        self._native: tuple[Any, Any] | None = None

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def _bind(self) -> None:
        """Point the calls into this thread's arena (grown to fit first), again whenever it has moved since."""
        origin = _arena.reserve(self.arena_bytes)
        if self._bound == (id(_arena), _arena.version):
            return
        ready = []
        for call, moved in zip(self._calls, self._arena_args):
            args = list(call.args)
            for position, offset in moved:
                args[position] = origin + offset
            ready.append((call.function, tuple(args), call.checked))
        self._ready = ready
        self._native = None if self._library is None else _native_table(ready, self._library)
        self._bound = (id(_arena), _arena.version)

    @property
    def from_c(self) -> bool:
        """Whether replays make the calls from C (replay.c) rather than one by one from Python."""
        self._bind()
        return self._native is not None

    def replay(self) -> Any:
        """The recorded kernels again on the inputs' current contents; :attr:`result` then holds the outputs."""
        self._bind()
        if self._native is not None:
            replay, table = self._native
            failed = replay(ctypes.addressof(table), len(table))  # 1 + the index of a call that failed
            if failed:
                raise ReplayError(f"a captured kernel ({self._ready[failed - 1][0].__name__}) returned a nonzero "
                                  "status")
            return self.result
        for function, args, checked in self._ready:
            status = function(*args)
            if checked and status:
                raise ReplayError(f"a captured kernel ({function.__name__}) returned status {status}")
        return self.result


def _place(spans: list[tuple[int, int, int, int]]) -> tuple[dict[int, int], int]:
    """Offsets in one arena for buffers ``(first, last, nbytes, base)`` that share memory when their call spans
    do not overlap (first fit by offset, larger buffers placed first); returns ``{base: offset}`` and the size."""
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    offsets: dict[int, int] = {}
    size = 0
    for first, last, nbytes, base in sorted(spans, key=lambda s: (-s[2], s[0])):
        need = -(-nbytes // _ALIGN) * _ALIGN
        busy = sorted((o, e) for o, e, f, l in placed if not (l < first or f > last))
        offset = 0
        for o, e in busy:
            if offset + need <= o:
                break
            offset = max(offset, e)
        placed.append((offset, offset + need, first, last))
        offsets[base] = offset
        size = max(size, offset + need)
    return offsets, size


def capture(fn: Callable[[], Any]) -> CapturedStep | None:
    """Run ``fn`` once and return it captured for replay, or ``None`` when part of it ran outside the native
    kernels (:func:`capture_or_reason` says which op)."""
    captured, _ = capture_or_reason(fn)
    return captured


def capture_or_reason(fn: Callable[[], Any]) -> tuple[CapturedStep | None, str]:
    """:func:`capture`, with the reason a capture was refused (``""`` when it was not)."""
    if getattr(_active, "calls", None) is not None:
        return None, "a capture is already running in this thread"
    calls: list[_Call] = []
    watch = _Watch()
    _active.calls = calls
    try:
        with watch:
            result = fn()
    except Exception:
        if watch.refused:  # however the model's layers re-raised it
            return None, watch.refused
        raise
    finally:
        _active.calls = None
    if watch.refused:  # a caller inside the region held the refusal back (a rank deferring its failures)
        return None, watch.refused
    if not calls:
        return None, "the region called no native kernel"
    outputs = {_storage(t)[0] for t in tree_leaves(result) if isinstance(t, torch.Tensor)}
    buffers = sorted((base, base + n) for base, n in watch.allocated.items() if base not in outputs and n)
    starts = [b for b, _ in buffers]
    first: dict[int, int] = {}
    last: dict[int, int] = {}

    def owner(pointer: int) -> int | None:
        i = bisect.bisect_right(starts, pointer) - 1
        if i >= 0 and pointer < buffers[i][1]:
            return buffers[i][0]
        return None

    # per call: (argument position, buffer, offset in it) of each pointer into the region's own buffers
    hits: list[list[tuple[int, int, int]]] = []
    for index, call in enumerate(calls):
        hits.append([])
        for position in call.pointers:
            pointer = call.args[position]
            base = owner(pointer) if isinstance(pointer, int) else None
            if base is not None:
                first.setdefault(base, index)
                last[base] = index
                hits[-1].append((position, base, pointer - base))
    offsets, size = _place([(first[b], last[b], e - b, b) for b, e in buffers if b in first])
    arena_args = [[(position, offsets[base] + within) for position, base, within in hit] for hit in hits]
    gone = {b for b, _ in buffers}  # the region's own copies of these are no longer read: let them go
    keep = [t for t in watch.kept if _storage(t)[0] not in gone]
    return CapturedStep(result, calls, arena_args, keep, size), ""
