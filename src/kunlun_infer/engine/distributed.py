"""The control plane of tensor parallelism: rank 0 tells the other ranks what to run, through the comm plugin.

Every message starts with a fixed header of :data:`HEADER_LEN` int64 numbers,
broadcast from rank 0 with ``comm.broadcast`` (so it travels over the same
``torch.distributed`` group as the activations — gloo, NCCL or a chip's own).
What follows depends on the kind:

- ``STEP``: one more broadcast of an int64 payload holding the flat batch —
  input ids, positions, KV slots, block tables, sequence lengths, query
  starts, and which rows need logits. Every rank then runs the same forward;
  only rank 0 samples.
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

from kunlun_infer.engine.model_runner import StepInputs

HEADER_LEN = 8


class Kind(enum.IntEnum):
    """What a control message asks the ranks to do."""

    HEARTBEAT = 0
    STEP = 1
    KV = 2
    LOAD = 3
    STOP = 4


@dataclasses.dataclass(frozen=True)
class Message:
    """A received control message: its kind and, by kind, the step inputs, block count or load spec."""

    kind: Kind
    inputs: StepInputs | None = None
    num_blocks: int = 0
    spec: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class RankStatus:
    """What one rank reports after loading: whether it succeeded, and its free device memory."""

    rank: int
    ok: bool
    free_bytes: int
    error: str | None = None


def _step_parts(inputs: StepInputs) -> list[torch.Tensor]:
    attn = inputs.attn
    return [inputs.input_ids, inputs.positions, attn.slot_mapping, attn.block_tables.reshape(-1), attn.seq_lens,
            attn.query_start_loc, inputs.logits_indices]


def pack_step(inputs: StepInputs) -> tuple[list[int], torch.Tensor]:
    """The header numbers and the one int64 payload that describe ``inputs``."""
    attn = inputs.attn
    num_seqs, width = attn.block_tables.shape
    header = [Kind.STEP, int(inputs.input_ids.numel()), int(num_seqs), int(width),
              int(inputs.logits_indices.numel()), int(attn.max_query_len or 0), int(attn.max_seq_len or 0)]
    return header, torch.cat([part.to(torch.int64) for part in _step_parts(inputs)])


def unpack_step(header: list[int], payload: torch.Tensor) -> StepInputs:
    """The :class:`StepInputs` that :func:`pack_step` described (``sample_rows`` is unknown here: empty)."""
    from kunlun_infer.layers.attention import AttentionMetadata

    _, num_tokens, num_seqs, width, num_logits, max_query_len, max_seq_len = header[:7]
    sizes = [num_tokens, num_tokens, num_tokens, num_seqs * width, num_seqs, num_seqs + 1, num_logits]
    ids, positions, slots, tables, seq_lens, starts, logits_indices = payload.split(sizes)
    attn = AttentionMetadata(
        slot_mapping=slots, block_tables=tables.view(num_seqs, width).to(torch.int32),
        seq_lens=seq_lens.to(torch.int32), query_start_loc=starts.to(torch.int32),
        max_query_len=max_query_len or None, max_seq_len=max_seq_len or None,
        is_decode_only=num_tokens == num_seqs)
    return StepInputs(ids, positions, attn, logits_indices, [])


class ControlPlane:
    """Sends (rank 0) and receives (every other rank) control messages over ``comm``."""

    def __init__(self, comm: Any, device: torch.device) -> None:
        self.comm = comm
        self.device = device

    def _header(self, numbers: list[int]) -> None:
        padded = [int(n) for n in numbers] + [0] * (HEADER_LEN - len(numbers))
        self.comm.broadcast(torch.tensor(padded, dtype=torch.int64).to(self.device), 0)

    # ------------------------------------------------------------------ rank 0

    def send_step(self, inputs: StepInputs) -> None:
        header, payload = pack_step(inputs)
        self._header(header)
        self.comm.broadcast(payload.to(self.device), 0)

    def send_kv(self, num_blocks: int) -> None:
        self._header([Kind.KV, num_blocks])

    def send_load(self, spec: dict[str, Any]) -> None:
        self._header([Kind.LOAD])
        self.comm.broadcast_object(spec, 0)

    def send_heartbeat(self) -> None:
        self._header([Kind.HEARTBEAT])

    def send_stop(self) -> None:
        self._header([Kind.STOP])

    # ------------------------------------------------------------------ other ranks

    def receive(self) -> Message:
        """Wait for rank 0's next message (a collective: bounded by the comm's timeout)."""
        header = self.comm.broadcast(torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device), 0)
        numbers = header.tolist()
        kind = Kind(numbers[0])
        if kind is Kind.STEP:
            payload = torch.empty(3 * numbers[1] + numbers[2] * numbers[3] + 2 * numbers[2] + 1 + numbers[4],
                                  dtype=torch.int64, device=self.device)
            return Message(kind, inputs=unpack_step(numbers, self.comm.broadcast(payload, 0)))
        if kind is Kind.KV:
            return Message(kind, num_blocks=numbers[1])
        if kind is Kind.LOAD:
            return Message(kind, spec=self.comm.broadcast_object(None, 0))
        return Message(kind)


def exchange_status(comm: Any, device: torch.device, *, ok: bool, free_bytes: int,
                    error: str | None) -> list[RankStatus]:
    """Every rank tells every other whether it loaded, and how much memory it has left.

    A collective all ranks call after ``LOAD``; the error text of each failed
    rank follows with one ``broadcast_object`` from that rank.
    """
    mine = torch.tensor([int(ok), int(free_bytes)], dtype=torch.int64, device=device)
    table = comm.all_gather(mine.view(1, 2), 0).tolist()
    statuses = []
    for rank, (rank_ok, rank_free) in enumerate(table):
        text = None
        if not rank_ok:
            text = comm.broadcast_object(error if rank == comm.rank else None, rank)
        statuses.append(RankStatus(rank, bool(rank_ok), int(rank_free), text))
    return statuses
