"""With a separate comm stream, a row-parallel all-reduce overlaps the next chunk's matmul; results are unchanged.

The comm stream here is a worker thread; the fake comm's all-reduce of the
first chunk waits until the second chunk's matmul has started. Run one after
the other (no overlap) it would wait in vain, so the test shows the overlap
itself, not only a right answer.
"""

from __future__ import annotations

import queue
import threading

import torch

from kunlun_infer.capabilities import Event, Stream, Streams
from kunlun_infer.layers import LayerContext, RowParallelLinear
from kunlun_infer.ops import OP_SPECS
from kunlun_infer.plugins.cpu_streams import SyncStreams


class ThreadEvent(Event):
    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        assert self.done.wait(10), "stream work never finished"


class ThreadStream(Stream):
    """Runs submitted work in order on its own thread."""

    def __init__(self) -> None:
        self.work: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, args = self.work.get()
            fn(*args)

    def submit(self, fn, *args) -> None:
        self.work.put((fn, args))

    def record_event(self) -> Event:
        event = ThreadEvent()
        self.submit(event.done.set)
        return event

    def wait_event(self, event: Event) -> None:
        self.submit(event.synchronize)

    def synchronize(self) -> None:
        self.record_event().synchronize()


class HostAndThreadStreams(Streams):
    """Compute on the caller's thread (as the CPU ops run), comm on a worker thread."""

    def __init__(self) -> None:
        self.compute, self.comm = SyncStreams().compute_stream(), ThreadStream()

    def compute_stream(self) -> Stream:
        return self.compute

    def comm_stream(self) -> Stream:
        return self.comm


class SecondChunkFirstComm:
    """Rank 0 of two identical ranks (sum = 2 x); notes whether chunk 1 started before chunk 0 was reduced."""

    rank, world_size = 0, 2

    def __init__(self, second_chunk_started: threading.Event) -> None:
        self.second_chunk_started = second_chunk_started
        self.overlapped: list[bool] = []

    def all_reduce(self, tensor, accumulate_dtype=None):
        self.overlapped.append(self.second_chunk_started.wait(timeout=3))
        return tensor * 2


def row_parallel(comm, streams, ops) -> tuple[RowParallelLinear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(8, 32, generator=g), torch.randn(8, generator=g)
    ctx = LayerContext(ops=ops, device=torch.device("cpu"), dtype=torch.float32, tp_rank=0, tp_size=2, comm=comm,
                       streams=streams)
    layer = RowParallelLinear(64, 8, True, ctx)  # this rank holds input columns 0..31
    layer.load_weight("weight", None, torch.cat([weight, torch.zeros_like(weight)], dim=1))
    layer.load_weight("bias", None, bias)
    layer.pack_weights()
    return layer, weight, bias


def test_all_reduce_of_a_chunk_runs_while_the_next_chunk_is_computed():
    started = threading.Event()
    calls = []

    def linear(x, weight, bias=None):
        calls.append(x.shape[0])
        if len(calls) == 2:
            started.set()
        return OP_SPECS["linear"].reference(x, weight, bias)

    ops = type("Ops", (), {"linear": staticmethod(linear), "pack_linear_weight": staticmethod(lambda w: w)})
    comm = SecondChunkFirstComm(started)
    layer, weight, bias = row_parallel(comm, HostAndThreadStreams(), ops)
    x = torch.randn(96, 32)
    out = layer(x)
    assert calls == [32, 32, 32]  # 96 rows in three chunks
    assert comm.overlapped[0], "chunk 0 was reduced only after chunk 1's matmul had started"
    torch.testing.assert_close(out, 2 * (x @ weight.T + bias))


def test_small_batches_and_single_stream_plugins_reduce_inline():
    started = threading.Event()
    started.set()
    ops = type("Ops", (), {"linear": staticmethod(OP_SPECS["linear"].reference),
                           "pack_linear_weight": staticmethod(lambda w: w)})
    comm = SecondChunkFirstComm(started)
    layer, weight, bias = row_parallel(comm, None, ops)  # what the loader passes for streams=sync
    x = torch.randn(96, 32)
    torch.testing.assert_close(layer(x), 2 * (x @ weight.T + bias))
    layer.ctx = LayerContext(ops=ops, device=torch.device("cpu"), dtype=torch.float32, tp_rank=0, tp_size=2,
                             comm=comm, streams=HostAndThreadStreams())
    torch.testing.assert_close(layer(x[:40]), 2 * (x[:40] @ weight.T + bias))  # a decode-sized batch
    assert len(comm.overlapped) == 2  # one all-reduce each: nothing was cut into chunks
