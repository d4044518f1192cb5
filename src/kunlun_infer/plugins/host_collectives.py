"""Collectives among the ranks of one host through a shared-memory segment: the ``gloo`` comm's way on one host.

gloo moves every collective through sockets and threads of its own. On a 2-core host an all-reduce of one decode
row (896 float32 values) took ~1 ms that way, and the 0.5B model's 49 collectives a token made a two-rank
tensor-parallel decode step ~4x as long as one rank's step alone. Ranks on one host meet in memory instead.

The segment holds one arrival count per rank (a cache line each), then two sets of slots, a slot of
:data:`SLOT_BYTES` per rank in each; collective number ``n`` uses set ``n % 2``. A collective: each rank writes its
share into its own slot, arrives (publishes ``n`` as its count, after its writes), waits until every rank has
arrived at ``n``, then reads the slots it needs. A rank writes set ``n % 2`` again only at collective ``n + 2``,
after it saw every rank arrive at ``n + 1``, which each did only once it had read what it needed of ``n``: two sets
need no other wait. A tensor larger than a slot goes through in pieces, a collective each. Every rank sums the
slots in rank order, so all ranks get the same bits. The counts are published and read by the native kernels
(``native/host_collectives.c``), whose fences order them with the data torch copies.

Rank 0 makes the segment under ``/dev/shm`` (its whole size reserved, so a full ``/dev/shm`` fails here, not as a
fault in a later write), the other ranks open it, and rank 0 unlinks its name once every rank has tried: nothing
is left behind however the processes end. Where the ranks are not all on one host (host name and boot id), or
the segment cannot be made or opened, or a rank has no native kernels, every rank keeps to gloo, having agreed so.

Point-to-point messages (pipeline stages' activations and control messages) go through channels in the same
segment, one for each ordered pair of ranks: a ring of :data:`P2P_SLOTS` slots with two counts, the pieces the
sender has put in and the pieces the receiver has taken out. A sender waits only while the ring is full, a
receiver until the next piece is in; each slot says how many bytes its piece and its whole message hold, so a
``recv`` whose tensor does not match the ``send`` fails naming both sizes. Every channel of a group shares
:data:`P2P_BYTES`, so a group of many ranks gets smaller pieces, not a larger segment.

An all-to-all (expert parallelism's dispatch and combine) is a collective on the same slots, one native call: each
rank's slot says how many bytes it sends each rank, and holds a region per destination; what does not fit goes in
more rounds.

A wait looks at the clock and at the waited-for rank's process every few milliseconds: a rank whose process has
ended makes the collective or message fail at once, one that does not arrive within ``comm.timeout_s`` makes it
time out, each naming the rank, as gloo's collectives fail.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import secrets
import socket
import threading
import time
from typing import Any

import torch

from kunlun_infer.plugins import cpu_native

log = logging.getLogger("kunlun_infer.plugin.cpu-comm")

#: bytes of one rank's slot: the most a rank moves in one collective (a larger tensor goes in pieces)
SLOT_BYTES = 1 << 20
#: slots in the ring of one ordered pair of ranks' point-to-point channel
P2P_SLOTS = 4
#: the data bytes of every point-to-point channel of one group together (each slot's piece at most 256 KiB)
P2P_BYTES = 16 << 20
#: (tensor dtype, dtype added up in) -> (dtype code, widened) of the native all-reduce
_NATIVE_REDUCTIONS = {(torch.float32, torch.float32): (0, 0), (torch.bfloat16, torch.float32): (1, 1),
                      (torch.bfloat16, torch.bfloat16): (1, 0)}
_NOT_AT_COLLECTIVE = "did not arrive at a shared-memory collective"
#: what a rank says it is at, beside its count (a collective's kind, its root, its bytes): ranks that meet at
#: different collectives (a bug that crossed them) fail naming both, rather than read each other's slots
_KINDS = {1: "an all-reduce", 2: "an all-gather", 3: "a broadcast", 4: "a barrier", 5: "an all-to-all"}
_ALL_REDUCE, _ALL_GATHER, _BROADCAST, _BARRIER, _ALL_TO_ALL = _KINDS


def _tag(kind: int, nbytes: int = 0, src: int = 0) -> int:
    return kind << 56 | src << 40 | nbytes


def _describe(tag: int) -> str:
    kind, src, nbytes = tag >> 56, tag >> 40 & 0xFFFF, tag & (1 << 40) - 1
    what = _KINDS.get(kind, f"collective kind {kind}")
    size = {_BARRIER: "", _ALL_TO_ALL: f" of rows of {nbytes} bytes"}.get(kind, f" of {nbytes} bytes")
    return what + (f" from rank {src}" if kind == _BROADCAST else "") + size
#: where the segment is made (a tmpfs on Linux)
SHM_DIR = "/dev/shm"
_LINE = 64
_PAGE = 4096
#: how long one native look of a wait lasts before the waiting thread is back in Python (to handle its signals)
_LOOK_S = 0.02


def host_identity() -> str:
    """This host as the ranks compare it: its name and this boot's id (Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def segment_bytes(world_size: int) -> int:
    """The size of the segment of ``world_size`` ranks: the counts, two sets of collective slots, the channels."""
    return _p2p_start(world_size) + _channels(world_size) * P2P_SLOTS * (p2p_piece_bytes(world_size) + _LINE)


def p2p_piece_bytes(world_size: int) -> int:
    """The data bytes of one slot of a point-to-point channel: a power of two, 16 to 256 KiB."""
    share = P2P_BYTES // max(1, _channels(world_size) * P2P_SLOTS)
    return max(16 << 10, min(256 << 10, 1 << (share.bit_length() - 1)))


def _channels(world_size: int) -> int:
    return world_size * (world_size - 1)


def _header_bytes(world_size: int) -> int:
    """The counts: one line a rank for the collectives, then two a channel (pieces put in, pieces taken out)."""
    return -(-(world_size + 2 * _channels(world_size)) * _LINE // _PAGE) * _PAGE


def _p2p_start(world_size: int) -> int:
    return _header_bytes(world_size) + 2 * world_size * SLOT_BYTES


def _native() -> Any:
    """The loaded native kernels (not a capture's recorder: these calls are never part of a step's replay)."""
    return cpu_native.selection().library


def _create(size: int) -> tuple[str | None, mmap.mmap | None]:
    """A new segment of ``size`` bytes, all of them reserved, and its name; ``(None, None)`` where it cannot be."""
    name = f"kunlun_infer-{os.getpid()}-{secrets.token_hex(8)}"
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        log.warning("comm=gloo keeps to sockets on this host: cannot make a shared-memory segment in %s (%s)",
                    SHM_DIR, exc)
        return None, None
    try:
        os.posix_fallocate(fd, 0, size)
        return name, mmap.mmap(fd, size)
    except OSError as exc:
        log.warning("comm=gloo keeps to sockets on this host: cannot reserve %d bytes of shared memory in %s (%s)",
                    size, SHM_DIR, exc)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None, None
    finally:
        os.close(fd)


def _attach(name: str, size: int) -> mmap.mmap | None:
    """The segment ``name`` made by rank 0, mapped; ``None`` where this rank cannot open it."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    except OSError as exc:
        log.warning("comm=gloo keeps to sockets: this rank cannot open rank 0's shared-memory segment (%s)", exc)
        return None
    try:
        if os.fstat(fd).st_size != size:
            log.warning("comm=gloo keeps to sockets: rank 0's shared-memory segment %s is not %d bytes", name, size)
            return None
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class HostSegment:
    """One comm group's shared-memory segment, as one of its ranks sees it."""

    def __init__(self, memory: mmap.mmap, lib: Any, *, rank: int, world_size: int, pids: list[int],
                 timeout_s: float) -> None:
        self.rank, self.world_size = rank, world_size
        self.nbytes = len(memory)
        self._memory = memory
        self._bytes = torch.frombuffer(memory, dtype=torch.uint8)
        self._lib = lib
        self._timeout_s = timeout_s
        self._counts = self._bytes.data_ptr()
        self._slots = _header_bytes(world_size)
        #: collectives this rank has arrived at: its count in the segment, which a replayed all-reduce moves on too
        self._arrived = ctypes.c_int64.from_address(self._counts + rank * _LINE)
        #: each rank's process, which the native waits look at
        self._pids = (ctypes.c_int64 * world_size)(*pids)
        #: the native all-reduce and all-to-all (``native/host_collectives.c``) where the library has them
        self.native_all_reduce = hasattr(lib, "kunlun_host_all_reduce")
        self.native_all_to_all = hasattr(lib, "kunlun_host_all_to_all")
        self._piece = p2p_piece_bytes(world_size)
        self._p2p = _p2p_start(world_size)
        #: pieces this rank has put into its channel to each rank, and taken out of each rank's channel to it
        self._sent = [0] * world_size
        self._taken = [0] * world_size
        self._send_locks = [threading.Lock() for _ in range(world_size)]
        self._recv_locks = [threading.Lock() for _ in range(world_size)]

    @classmethod
    def join(cls, comm: Any, timeout_s: float) -> HostSegment | None:
        """Every rank of ``comm`` calls this together, the segment not yet in use (its ranks agree through
        ``broadcast_object`` alone): the segment of the group where its ranks share a host, else ``None`` on
        every rank."""
        if comm.world_size < 2:
            return None
        lib = _native()
        mine = (host_identity(), os.getpid(), lib is not None and os.path.isdir(SHM_DIR))
        ranks = [comm.broadcast_object(mine if comm.rank == r else None, r) for r in range(comm.world_size)]
        if len({host for host, _, _ in ranks}) != 1:
            log.info("comm=gloo: the ranks are on %d hosts; collectives go through sockets",
                     len({host for host, _, _ in ranks}))
            return None
        if not all(able for _, _, able in ranks):
            log.info("comm=gloo: rank(s) %s have no native CPU kernels or no %s; collectives go through sockets",
                     [r for r, (_, _, able) in enumerate(ranks) if not able], SHM_DIR)
            return None
        size = segment_bytes(comm.world_size)
        name, memory = _create(size) if comm.rank == 0 else (None, None)
        name = comm.broadcast_object(name, 0)
        if name is None:
            return None
        if comm.rank != 0:
            memory = _attach(name, size)
        opened = [comm.broadcast_object(memory is not None if comm.rank == r else None, r)
                  for r in range(comm.world_size)]
        if comm.rank == 0:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))
        if not all(opened):
            if memory is not None:
                memory.close()
            return None
        log.info("comm=gloo: the %d ranks on this host meet in %d bytes of shared memory", comm.world_size, size)
        return cls(memory, lib, rank=comm.rank, world_size=comm.world_size,
                   pids=[pid for _, pid, _ in ranks], timeout_s=timeout_s)

    # ------------------------------------------------------------------ one collective

    def _slot(self, number: int, rank: int, nbytes: int) -> torch.Tensor:
        start = self._slots + ((number % 2) * self.world_size + rank) * SLOT_BYTES
        return self._bytes[start:start + nbytes]

    def _meet(self, tag: int) -> int:
        """Arrive at the next collective (this rank's writes for it done), saying which one (``tag``); wait for
        every rank, and fail where one is at another collective."""
        number = self._arrived.value + 1
        self._tag_of(self.rank, number).value = tag
        self._lib.kunlun_host_arrive(self._counts + self.rank * _LINE, number)
        self._await(self._counts, 0, self.world_size, number, _NOT_AT_COLLECTIVE)
        for rank in range(self.world_size):
            if self._tag_of(rank, number).value != tag:
                raise self._crossed(rank, number)
        return number

    def _tag_of(self, rank: int, number: int) -> ctypes.c_int64:
        """Where ``rank`` says which collective its ``number``-th is: its count's line, one word a set."""
        return ctypes.c_int64.from_address(self._counts + rank * _LINE + 8 * (1 + number % 2))

    def _crossed(self, rank: int, number: int) -> RuntimeError:
        return RuntimeError(
            f"comm=gloo: rank {rank} is at {_describe(self._tag_of(rank, number).value)} where rank {self.rank} is "
            f"at {_describe(self._tag_of(self.rank, number).value)} (shared-memory collective {number}): the ranks "
            "called their collectives in different orders")

    def _await(self, counts: int, first: int, ranks: int, number: int, not_yet: str) -> None:
        """Wait until the counts of ranks ``first`` .. ``first + ranks - 1`` (lines from address ``counts`` on)
        reach ``number``, in native looks between which this thread handles its signals; fail where one's process
        ended, time out after ``comm.timeout_s`` (``not_yet`` says what it did not do)."""
        began = time.monotonic()
        pids = ctypes.addressof(self._pids) + 8 * first
        while (status := self._lib.kunlun_host_await(counts, ranks, number, pids, self._timeout_s, began,
                                                     _LOOK_S)) < 0:
            pass
        if status:
            raise self._wait_failure(status, first, ranks, number, not_yet)

    def _wait_failure(self, status: int, first: int, ranks: int, number: int, not_yet: str) -> RuntimeError:
        """The error a native wait's ``status`` (over ranks ``first`` .. ``first + ranks - 1``) says: a rank that
        did not do ``not_yet`` within ``comm.timeout_s``, whose process ended, or that is at another collective."""
        rank, why = first + (status - 1) % ranks, (status - 1) // ranks
        pid = self._pids[rank]
        if why == 2:
            return self._crossed(rank, number)
        if why == 1:
            return RuntimeError(f"comm=gloo: rank {rank} (pid {pid}) of this host's shared-memory collectives and "
                                "messages has exited")
        return RuntimeError(f"comm=gloo: rank {rank} (pid {pid}) {not_yet} within comm.timeout_s="
                            f"{self._timeout_s:g}s (timed out)")

    def _pieces(self, nbytes: int) -> range:
        return range(0, nbytes, SLOT_BYTES)

    # ------------------------------------------------------------------ the collectives

    def all_reduce(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place, added up in ``dtype`` in rank order.

        float32, and bfloat16 added up in float32 or in bfloat16, are reduced by one native call: nothing of it
        runs in torch, so a captured step (``cpu_capture.py``) records it with its kernels and replays it."""
        code = _NATIVE_REDUCTIONS.get((tensor.dtype, dtype))
        if code is not None and self.native_all_reduce and tensor.is_contiguous():
            status = cpu_native.library().kunlun_host_all_reduce(
                self._counts, self.rank, self.world_size, self._counts + self._slots, SLOT_BYTES,
                tensor.data_ptr(), tensor.numel(), *code, ctypes.addressof(self._pids), self._timeout_s)
            if status:
                raise self._wait_failure(status, 0, self.world_size, self._arrived.value, _NOT_AT_COLLECTIVE)
            return tensor
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        size = dtype.itemsize
        for start in self._pieces(flat.numel() * size):
            piece = flat[start // size:(start + SLOT_BYTES) // size]
            nbytes = piece.numel() * size
            number = self._arrived.value + 1
            self._slot(number, self.rank, nbytes).view(dtype).copy_(piece)
            self._meet(_tag(_ALL_REDUCE, nbytes))
            total = torch.add(self._slot(number, 0, nbytes).view(dtype), self._slot(number, 1, nbytes).view(dtype))
            for rank in range(2, self.world_size):
                total.add_(self._slot(number, rank, nbytes).view(dtype))
            piece.copy_(total)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``tensor`` (all of one shape and dtype), concatenated along ``dim`` in rank order."""
        mine = tensor.contiguous().view(-1).view(torch.uint8)
        parts = [torch.empty(mine.numel(), dtype=torch.uint8) for _ in range(self.world_size)]
        for start in self._pieces(mine.numel()):
            end = min(start + SLOT_BYTES, mine.numel())
            number = self._arrived.value + 1
            self._slot(number, self.rank, end - start).copy_(mine[start:end])
            self._meet(_tag(_ALL_GATHER, end - start))
            for rank, part in enumerate(parts):
                part[start:end].copy_(self._slot(number, rank, end - start))
        return torch.cat([part.view(tensor.dtype).view(tensor.shape) for part in parts], dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """``src``'s ``tensor`` copied into every rank's, in place."""
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        data = work.view(-1).view(torch.uint8)
        for start in self._pieces(data.numel()):
            end = min(start + SLOT_BYTES, data.numel())
            number = self._arrived.value + 1
            if self.rank == src:
                self._slot(number, src, end - start).copy_(data[start:end])
            self._meet(_tag(_BROADCAST, end - start, src))
            if self.rank != src:
                data[start:end].copy_(self._slot(number, src, end - start))
        if work is not tensor and self.rank != src:
            tensor.copy_(work)
        return tensor

    def all_to_all(self, tensor: torch.Tensor, send_splits: Any, recv_splits: Any) -> torch.Tensor:
        """Rows (dim 0) of ``tensor`` to the ranks, ``send_splits[j]`` of them to rank ``j`` in order; the rows
        received, ``recv_splits[i]`` from rank ``i``, rank 0's first: one native call
        (``kunlun_host_all_to_all``), in rounds where the rows do not fit a slot. A rank whose ``recv_splits``
        differ from what the others send fails naming both, once every rank has taken the same rounds (so
        the ranks stay in step)."""
        world, me = self.world_size, self.rank
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        row_bytes = work.shape[1:].numel() * work.element_size()
        send_splits, recv_splits = [int(n) for n in send_splits], [int(n) for n in recv_splits]
        if len(send_splits) != world or len(recv_splits) != world or sum(send_splits) != work.shape[0]:
            raise ValueError(f"all_to_all: rank {me} has {work.shape[0]} rows and send_splits {send_splits}, "
                             f"recv_splits {recv_splits}: one split per rank ({world}), the sends adding up to the "
                             "rows")
        out = work.new_empty((sum(recv_splits), *work.shape[1:]))
        sends = (ctypes.c_int64 * world)(*(n * row_bytes for n in send_splits))
        expected = (ctypes.c_int64 * world)(*(n * row_bytes for n in recv_splits))
        sent = (ctypes.c_int64 * world)()
        status = self._lib.kunlun_host_all_to_all(
            self._counts, me, world, self._counts + self._slots, SLOT_BYTES, work.data_ptr(), sends,
            out.data_ptr(), expected, row_bytes, ctypes.addressof(self._pids), self._timeout_s, sent)
        if status:
            raise self._wait_failure(status, 0, world, self._arrived.value, _NOT_AT_COLLECTIVE)
        if list(sent) != list(expected):
            raise ValueError(f"all_to_all: rank {me} expected {recv_splits} rows, the ranks send "
                             f"{[n // max(row_bytes, 1) for n in sent]}")
        return out

    def barrier(self) -> None:
        self._meet(_tag(_BARRIER))

    # ------------------------------------------------------------------ point to point

    def _channel(self, src: int, dst: int) -> tuple[int, int]:
        """The addresses of channel ``src -> dst``'s two counts (pieces put in; taken out) and its first slot."""
        if not (0 <= src < self.world_size and 0 <= dst < self.world_size) or src == dst:
            raise ValueError(f"comm=gloo: no channel from rank {src} to rank {dst} in a group of "
                             f"{self.world_size} ranks")
        index = src * (self.world_size - 1) + (dst if dst < src else dst - 1)
        counts = self._counts + (self.world_size + 2 * index) * _LINE
        return counts, self._p2p + index * P2P_SLOTS * (self._piece + _LINE)

    def _pieces_of(self, nbytes: int) -> range:
        return range(0, nbytes, self._piece) if nbytes else range(1)  # an empty message is still one piece

    def _p2p_slot(self, first_slot: int, number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Piece ``number``'s slot of a channel: its header (piece bytes, message bytes) and its data."""
        start = first_slot + ((number - 1) % P2P_SLOTS) * (self._piece + _LINE)
        return self._bytes[start:start + 16].view(torch.int64), self._bytes[start + _LINE:start + _LINE + self._piece]

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """``tensor`` to rank ``dst``, in order after this rank's earlier messages to it; waits only while the
        channel's ring is full."""
        data = tensor.contiguous().view(-1).view(torch.uint8)
        counts, first_slot = self._channel(self.rank, dst)
        with self._send_locks[dst]:
            for start in self._pieces_of(data.numel()):
                end = min(start + self._piece, data.numel())
                number = self._sent[dst] + 1
                self._await(counts + _LINE, dst, 1, number - P2P_SLOTS,
                            f"took no message from rank {self.rank} through shared memory")
                header, slot = self._p2p_slot(first_slot, number)
                header.copy_(torch.tensor([end - start, data.numel()], dtype=torch.int64))
                slot[:end - start].copy_(data[start:end])
                self._sent[dst] = number
                self._lib.kunlun_host_arrive(counts, number)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Rank ``src``'s next message to this rank, into ``tensor`` (which must hold exactly its bytes)."""
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        data = work.view(-1).view(torch.uint8)
        counts, first_slot = self._channel(src, self.rank)
        with self._recv_locks[src]:
            for start in self._pieces_of(data.numel()):
                number = self._taken[src] + 1
                self._await(counts, src, 1, number, f"sent nothing to rank {self.rank} through shared memory")
                header, slot = self._p2p_slot(first_slot, number)
                nbytes, total = header.tolist()
                if total != data.numel():
                    raise RuntimeError(f"comm=gloo: rank {src} sent a message of {total} bytes where rank "
                                       f"{self.rank} received into {data.numel()} ({tuple(tensor.shape)} "
                                       f"{tensor.dtype}); a recv's tensor must have the size of the send's")
                data[start:start + nbytes].copy_(slot[:nbytes])
                self._taken[src] = number
                self._lib.kunlun_host_arrive(counts + _LINE, number)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def close(self) -> None:
        """Let go of the segment (its memory returns once every rank has)."""
        memory, self._memory = self._memory, None
        self._bytes = None
        if memory is not None:
            with contextlib.suppress(BufferError):  # a view still held elsewhere: the mapping goes with it
                memory.close()
