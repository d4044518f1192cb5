"""Pipeline parallelism's transport: control messages, activations, failures and logits, point to point.

With ``parallel.pipeline_size > 1`` every message travels a chain instead of
a broadcast, so that the stages need not wait for each other: rank 0 sends
each control message (the same fixed-size int64 message as
:mod:`~kunlun_infer.engine.parallel.control_plane`, same packing of a step)
to the other ranks of its stage and to the next stage; every rank forwards
what it receives to the same rank of the next stage. After a stage's forward
its ranks send the next stage a *status* (the first plugin failure held back
so far, or none) and the hidden states with the residual; the last stage's
ranks send their status to rank 0, and its first rank the logits of the rows
to sample. Rank 0 samples, so tokens never travel.

Sends go through an :class:`Outbox`: one thread per rank sends in order, so
a stage never waits for a busy next stage to take its message (a comm's
``send`` may wait for the matching ``recv``). Receives are the caller's and
are bounded by the comm's ``timeout_s``.
"""

from __future__ import annotations

import pickle
import queue
import threading
from typing import Any

import torch

from kunlun_infer.capabilities import Comm
from kunlun_infer.engine.model_runner import StepInputs
from kunlun_infer.engine.parallel.control_plane import Message, blank_frame, frame, read_frame
from kunlun_infer.engine.parallel.stages import Grid
from kunlun_infer.errors import PluginError


class Outbox:
    """Sends tensors in the order given, from a thread of its own; the first failure is kept and re-raised."""

    def __init__(self, comm: Comm, name: str) -> None:
        self.comm = comm
        self._queue: queue.Queue[tuple[torch.Tensor, int] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, tensor: torch.Tensor, dst: int) -> None:
        self.check()
        self._queue.put((tensor, dst))

    def check(self) -> None:
        """Raise the failure of an earlier send, if one failed."""
        if self._error is not None:
            raise self._error

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued has been sent (or failed); False if it took longer than ``timeout_s``."""
        done = threading.Event()
        self._queue.put((None, done))  # type: ignore[arg-type]
        return done.wait(timeout_s)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            tensor, dst = item
            if tensor is None:  # a flush marker
                dst.set()  # type: ignore[union-attr]
                continue
            if self._error is not None:
                continue  # the link is broken: drop the rest, the owner raises the first failure
            try:
                self.comm.send(tensor, dst)
            except BaseException as exc:  # noqa: BLE001 - handed to the owner's thread
                self._error = exc


class PipelineLink:
    """One rank's ends of the chain: what it receives from the rank before, what it sends onward."""

    def __init__(self, comm: Comm, grid: Grid, device: torch.device) -> None:
        self.comm = comm
        self.grid = grid
        self.rank = comm.rank
        self.device = device
        self.prev = grid.prev_rank(self.rank)
        self.next = grid.next_rank(self.rank)
        self.outbox = Outbox(comm, f"kunlun-infer-pp-send-{self.rank}")

    def close(self) -> None:
        self.outbox.close()

    # ------------------------------------------------------------------ control messages

    def _targets(self) -> list[int]:
        """Where a control message goes from here: rank 0 also tells the other ranks of its stage."""
        targets = self.grid.stage_ranks(0)[1:] if self.rank == 0 else []
        return targets + ([self.next] if self.next is not None else [])

    def send_message(self, numbers: list[int], payload: torch.Tensor | None = None) -> None:
        message, rest = frame(numbers, payload, self.device)
        for dst in self._targets():
            self.outbox.put(message, dst)
            if rest is not None:
                self.outbox.put(rest, dst)

    def receive_message(self) -> Message:
        """The next control message from the rank before, forwarded to the next stage at once."""
        message = self.comm.recv(blank_frame(self.device), self.prev)
        numbers, payload, size = read_frame(message)
        if size:
            payload = self.comm.recv(torch.empty(size, dtype=torch.int64, device=self.device), self.prev)
        if self.next is not None:
            self.outbox.put(message, self.next)
            if size:
                self.outbox.put(payload, self.next)
        return Message.decode(numbers, payload, self.device)

    # ------------------------------------------------------------------ step data

    def send_status(self, dst: int, failure: dict[str, Any] | None) -> None:
        """Whether the step failed so far (the first failure's detail), to ``dst``."""
        data = b"" if failure is None else pickle.dumps(failure)
        self.outbox.put(torch.tensor([len(data)], dtype=torch.int64, device=self.device), dst)
        if data:
            self.outbox.put(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device), dst)

    def recv_status(self, src: int) -> dict[str, Any] | None:
        size = int(self.comm.recv(torch.zeros(1, dtype=torch.int64, device=self.device), src).item())
        if size == 0:
            return None
        data = self.comm.recv(torch.empty(size, dtype=torch.uint8, device=self.device), src)
        return pickle.loads(data.cpu().numpy().tobytes())  # noqa: S301 - from a peer rank of this engine

    def send_tensor(self, tensor: torch.Tensor, dst: int) -> None:
        """``tensor`` to ``dst``, copied now: the outbox sends it later, and a captured step's outputs are
        rewritten by its next replay."""
        self.outbox.put(tensor.clone(memory_format=torch.contiguous_format), dst)

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        return self.comm.recv(torch.empty(shape, dtype=dtype, device=self.device), src)


# ---------------------------------------------------------------------- what both ends share


def failure_detail(failure: PluginError | None, rank: int) -> dict[str, Any] | None:
    """A held-back plugin failure as the picklable detail a status carries."""
    if failure is None:
        return None
    return {"text": str(failure), "plugin": failure.plugin, "hook": failure.hook, "layer": failure.layer,
            "rank": rank}


def as_plugin_error(detail: dict[str, Any]) -> PluginError:
    return PluginError(f"{detail['text']} (on pipeline rank {detail['rank']})", plugin=detail["plugin"],
                       hook=detail["hook"], layer=detail["layer"])


def run_stage(runner: Any, link: PipelineLink, inputs: StepInputs, *, tp_rank: int, hidden_size: int,
              dtype: torch.dtype) -> None:
    """One rank's part of a step on any stage but rank 0's: receive, forward, send on (or report to rank 0)."""
    span = runner.model.span
    upstream, intermediate = None, None
    if not span.is_first:
        upstream = link.recv_status(link.prev)
        shape = (inputs.input_ids.numel(), hidden_size)
        intermediate = (link.recv_tensor(shape, dtype, link.prev), link.recv_tensor(shape, dtype, link.prev))
    with torch.inference_mode():
        out = runner.forward(inputs, intermediate)
        logits = runner.logits(inputs, out) if span.is_last else None
    failure = upstream or failure_detail(runner.model.deferred_failures.take(), link.rank)
    if not span.is_last:
        link.send_status(link.next, failure)
        link.send_tensor(out[0], link.next)
        link.send_tensor(out[1], link.next)
        return
    link.send_status(0, failure)
    if tp_rank == 0 and logits is not None:
        link.send_tensor(logits, 0)
