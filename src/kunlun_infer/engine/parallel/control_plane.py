"""The control plane of tensor parallelism: rank 0 tells the other ranks what to run, through the comm plugin.

Every message is one broadcast from rank 0 with ``comm.broadcast`` (so it
travels over the same ``torch.distributed`` group as the activations — gloo,
NCCL or a chip's own) of a fixed-size int64 tensor: :data:`HEADER_LEN`
numbers saying what to do, then room for :data:`INLINE_CAPACITY` numbers of
payload. By kind:

- ``STEP``: the payload is the flat batch — input ids, positions, and the
  neutral attention step (KV slots, query and context lengths, block
  tables), and which rows need logits; a batch too large for the message
  follows in a second broadcast. Every rank then builds its attention
  backend's metadata and runs the same forward; only rank 0 samples.
- ``KV``: the number of KV blocks each rank should now hold (0 = none).
- ``LOAD``: a ``comm.broadcast_object`` with what to load (folder, dtype, …),
  answered by :func:`exchange_status` once every rank has loaded.
- ``HEARTBEAT``: nothing; rank 0 sends it while idle so the waiting ranks'
  collective timeout (``comm.timeout_s``) measures silence, not idleness.
- ``STOP``: leave the loop.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch

from kunlun_infer.capabilities import Comm
from kunlun_infer.engine.model_runner import StepInputs
from kunlun_infer.errors import PluginError
from kunlun_infer.ops.attention_step import AttentionStep

HEADER_LEN = 8
#: payload numbers that travel inside the message (a decode step of dozens of sequences fits)
INLINE_CAPACITY = 1024


class Kind(enum.IntEnum):
    """What a control message asks the ranks to do."""

    HEARTBEAT = 0
    STEP = 1
    KV = 2
    LOAD = 3
    STOP = 4
    #: capture the ``ops.step_graph_sizes`` decode steps now, as rank 0 does (``engine/step_graph.py``)
    CAPTURE = 5


@dataclasses.dataclass(frozen=True)
class Message:
    """A received control message: its kind and, by kind, the step inputs, block count, load spec or the batch
    limit captures are taken up to."""

    kind: Kind
    inputs: StepInputs | None = None
    num_blocks: int = 0
    spec: dict[str, Any] | None = None
    max_num_seqs: int = 0

    @classmethod
    def decode(cls, numbers: list[int], payload: torch.Tensor | None, device: torch.device,
               spec: dict[str, Any] | None = None) -> Message:
        """The message a frame's header ``numbers`` (and a ``STEP``'s payload, a ``LOAD``'s spec) describe."""
        kind = Kind(numbers[0])
        if kind is Kind.STEP:
            assert payload is not None, "a STEP message comes with its payload"
            return cls(kind, inputs=unpack_step(numbers, payload, device))
        if kind is Kind.KV:
            return cls(kind, num_blocks=numbers[1])
        if kind is Kind.CAPTURE:
            return cls(kind, max_num_seqs=numbers[1])
        if kind is Kind.LOAD:
            return cls(kind, spec=spec)
        return cls(kind)


@dataclasses.dataclass(frozen=True)
class RankStatus:
    """What one rank reports after loading or a step: whether it succeeded, and its free device memory."""

    rank: int
    ok: bool
    free_bytes: int
    #: what went wrong (the load's error text, a step's failure detail); ``None`` when ``ok``
    error: Any = None
    #: more numbers the rank reported (after loading a pipeline stage: its weight bytes and KV bytes per block)
    extra: tuple[int, ...] = ()


def pack_step(inputs: StepInputs) -> tuple[list[int], torch.Tensor]:
    """The header numbers and the one int64 payload that describe ``inputs`` (the neutral step, not metadata)."""
    step = inputs.attn
    table_lens = [len(t) for t in step.block_tables]
    header = [Kind.STEP, step.num_tokens, step.num_seqs, sum(table_lens), int(inputs.logits_indices.numel()),
              step.block_size]
    lists = torch.tensor(step.slot_mapping + step.query_lens + step.context_lens + table_lens
                         + [b for t in step.block_tables for b in t], dtype=torch.int64)
    parts = [inputs.input_ids.cpu(), inputs.positions.cpu(), lists, inputs.logits_indices.cpu()]
    return header, torch.cat([part.to(torch.int64) for part in parts])


def payload_size(header: list[int]) -> int:
    """How many int64 numbers the payload of a ``STEP`` header holds."""
    _, num_tokens, num_seqs, num_table_entries, num_logits = header[:5]
    return 3 * num_tokens + 3 * num_seqs + num_table_entries + num_logits


def unpack_step(header: list[int], payload: torch.Tensor, device: torch.device | None = None) -> StepInputs:
    """The :class:`StepInputs` that :func:`pack_step` described (``sample_rows`` is unknown here: empty)."""
    _, num_tokens, num_seqs, num_table_entries, num_logits, block_size = header[:6]
    device = payload.device if device is None else device
    sizes = [num_tokens, num_tokens, num_tokens, num_seqs, num_seqs, num_seqs, num_table_entries, num_logits]
    ids, positions, slots, query_lens, context_lens, table_lens, tables, logits_indices = payload.split(sizes)
    flat_tables, tables_of = tables.tolist(), []
    for n in table_lens.tolist():
        tables_of.append(flat_tables[:n])
        flat_tables = flat_tables[n:]
    step = AttentionStep(block_size, query_lens.tolist(), context_lens.tolist(), tables_of, slots.tolist(), device)
    return StepInputs(ids.to(device), positions.to(device), step, logits_indices.to(device), [])


def frame(numbers: list[int], payload: torch.Tensor | None,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fixed-size message that carries the header ``numbers`` (and ``payload`` when it fits inline), and
    the payload that must travel after it (``None`` when inline or absent)."""
    message = blank_frame(device)
    message[:len(numbers)] = torch.tensor([int(n) for n in numbers], dtype=torch.int64).to(device)
    if payload is not None and payload.numel() <= INLINE_CAPACITY:
        message[HEADER_LEN:HEADER_LEN + payload.numel()] = payload
        return message, None
    return message, payload


def blank_frame(device: torch.device) -> torch.Tensor:
    """A buffer one message is received into."""
    return torch.zeros(HEADER_LEN + INLINE_CAPACITY, dtype=torch.int64, device=device)


def read_frame(message: torch.Tensor) -> tuple[list[int], torch.Tensor | None, int]:
    """A received message's header numbers, its inline payload, and the size of the payload that follows it
    (0 when none does)."""
    numbers = message[:HEADER_LEN].tolist()
    if Kind(numbers[0]) is not Kind.STEP:
        return numbers, None, 0
    size = payload_size(numbers)
    if size <= INLINE_CAPACITY:
        return numbers, message[HEADER_LEN:HEADER_LEN + size], 0
    return numbers, None, size


class ControlPlane:
    """Sends (rank 0) and receives (every other rank) control messages over ``comm``."""

    def __init__(self, comm: Comm, device: torch.device) -> None:
        self.comm = comm
        self.device = device

    def _send(self, numbers: list[int], payload: torch.Tensor | None = None) -> None:
        message, rest = frame(numbers, payload, self.device)
        self.comm.broadcast(message, 0)
        if rest is not None:
            self.comm.broadcast(rest.to(self.device), 0)

    # ------------------------------------------------------------------ rank 0

    def send_step(self, inputs: StepInputs) -> None:
        header, payload = pack_step(inputs)
        self._send(header, payload.to(self.device))

    def send_kv(self, num_blocks: int) -> None:
        self._send([Kind.KV, num_blocks])

    def send_load(self, spec: dict[str, Any]) -> None:
        self._send([Kind.LOAD])
        self.comm.broadcast_object(spec, 0)

    def send_capture(self, max_num_seqs: int) -> None:
        self._send([Kind.CAPTURE, max_num_seqs])

    def send_heartbeat(self) -> None:
        self._send([Kind.HEARTBEAT])

    def send_stop(self) -> None:
        self._send([Kind.STOP])

    # ------------------------------------------------------------------ other ranks

    def receive(self) -> Message:
        """Wait for rank 0's next message (a collective: bounded by the comm's timeout)."""
        numbers, payload, size = read_frame(self.comm.broadcast(blank_frame(self.device), 0))
        if size:
            payload = self.comm.broadcast(torch.empty(size, dtype=torch.int64, device=self.device), 0)
        spec = self.comm.broadcast_object(None, 0) if Kind(numbers[0]) is Kind.LOAD else None
        return Message.decode(numbers, payload, self.device, spec)


def exchange_status(comm: Comm, device: torch.device, *, ok: bool, free_bytes: int,
                    error: Any, extra: tuple[int, ...] = ()) -> list[RankStatus]:
    """Every rank tells every other whether it succeeded (and how much memory it has left).

    A collective all ranks call after ``LOAD`` and after each ``STEP``; the
    error of each failed rank (its text, or any picklable detail) follows with
    one ``broadcast_object`` from that rank. ``extra``: more numbers, as many
    on every rank.
    """
    mine = torch.tensor([int(ok), int(free_bytes), *map(int, extra)], dtype=torch.int64, device=device)
    table = comm.all_gather(mine.view(1, -1), 0).tolist()
    statuses = []
    for rank, (rank_ok, rank_free, *rank_extra) in enumerate(table):
        text = None
        if not rank_ok:
            text = comm.broadcast_object(error if rank == comm.rank else None, rank)
        statuses.append(RankStatus(rank, bool(rank_ok), int(rank_free), text, tuple(rank_extra)))
    return statuses


def exchange_step_failures(comm: Comm, device: torch.device, failure: PluginError | None) -> PluginError | None:
    """After each step, every rank learns whether a rank's plugin failed in it (one small all-gather).

    Returns ``None`` for a good step, else the first failed rank's error as a
    :class:`PluginError` naming its plugin, hook and layer, and the ranks.
    """
    detail = None if failure is None else {"text": str(failure), "plugin": failure.plugin, "hook": failure.hook,
                                           "layer": failure.layer}
    failed = [s for s in exchange_status(comm, device, ok=failure is None, free_bytes=0, error=detail) if not s.ok]
    if not failed:
        return None
    first = failed[0].error
    ranks = ", ".join(str(s.rank) for s in failed)
    return PluginError(f"{first['text']} (on tensor-parallel rank{'s' if len(failed) > 1 else ''} {ranks})",
                       plugin=first["plugin"], hook=first["hook"], layer=first["layer"])
