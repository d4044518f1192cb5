"""What every layer is built with: the op table, where tensors live, and its tensor-parallel place.

Layers never reach for a device or a global: a :class:`LayerContext` is passed
in when a model is built. ``ops`` is the runtime's resolved op table (attribute
access, ``ops.linear(...)``); ``attention`` the attention backend that owns
the KV cache's layout and kernels; ``comm`` is the Comm of the layer's
tensor-parallel group (the runtime's, or its pipeline stage's subgroup), used only when
``tp_size > 1``; ``streams`` is set only when the streams plugin has a comm
stream of its own, so that all-reduces can overlap computation. Reading a
layer's shard of a checkpoint tensor is :mod:`kunlun_infer.layers.weights`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING
import torch

from kunlun_infer.capabilities import Comm, Streams
from kunlun_infer.ops.attention import AttentionBackend
from kunlun_infer.runtime.optable import OpTable

if TYPE_CHECKING:  # the quantization module builds on the layers, which build on this context
    from kunlun_infer.layers.quantization import Quantization


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """Everything a layer needs besides its own sizes."""

    ops: OpTable
    device: torch.device
    dtype: torch.dtype
    tp_rank: int = 0
    tp_size: int = 1
    comm: Comm | None = None
    #: dtype in which all-reduces accumulate; ``None`` leaves it to the comm plugin, which was built
    #: from ``comm.accumulate_dtype`` (so ``none`` there really switches widening off)
    accumulate_dtype: torch.dtype | None = None
    #: the runtime's streams when its comm stream is distinct (``streams.overlaps``); ``None`` = inline collectives
    streams: Streams | None = None
    #: the run's attention backend, which owns the KV cache's layout and the attention kernels
    attention: AttentionBackend | None = None
    #: ``model.quantization``; ``None`` = full-precision weights
    quantization: Quantization | None = None
    #: ``parallel.expert_size``: 1 splits every expert like a dense MLP; ``tp_size`` gives each rank whole experts
    ep_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} is outside 0..{self.tp_size - 1}")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(f"expert parallelism over {self.ep_size} ranks needs it to be 1 or the tensor-parallel "
                             f"size {self.tp_size}")
        if self.tp_size > 1 and self.comm is None:
            raise ValueError(f"tp_size={self.tp_size} needs a comm to reduce shard results")

    def empty(self, *shape: int, dtype: torch.dtype | None = None) -> torch.nn.Parameter:
        """An uninitialised, frozen parameter of ``shape`` on the model's device."""
        data = torch.empty(*shape, dtype=dtype or self.dtype, device=self.device)
        return torch.nn.Parameter(data, requires_grad=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` across ranks (no collective at all with one rank)."""
        if self.tp_size == 1:
            return x
        return self.comm.all_reduce(x, accumulate_dtype=self.accumulate_dtype)

    def all_reduce_pipelined(self, compute: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                             num_chunks: int) -> torch.Tensor:
        """``all_reduce(compute(x))``, row chunk by row chunk, each chunk's all-reduce overlapping the next's compute.

        Chunk ``i`` is computed on the compute stream (the caller's), then its
        all-reduce is queued on the comm stream after an event, so it runs
        while chunk ``i + 1`` is computed; at the end the compute stream and
        the host wait for the last all-reduce. Rows are independent, so the
        result equals the unchunked one. Needs ``streams`` (see the field).
        """
        compute_stream, comm_stream = self.streams.compute_stream(), self.streams.comm_stream()
        reduced: list[torch.Tensor | None] = [None] * num_chunks

        def reduce(i: int, part: torch.Tensor) -> None:
            reduced[i] = self.comm.all_reduce(part, accumulate_dtype=self.accumulate_dtype)

        for i, rows in enumerate(x.tensor_split(num_chunks)):
            part = compute(rows)
            comm_stream.wait_event(compute_stream.record_event())
            comm_stream.submit(reduce, i, part)
        done = comm_stream.record_event()
        compute_stream.wait_event(done)
        done.synchronize()  # ops may run on the host (not in stream order): the host waits as well
        return torch.cat(reduced)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` (identity with one rank)."""
        if self.tp_size == 1:
            return x
        return self.comm.all_gather(x, dim=dim)


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator`` when exact, else a ``ValueError`` naming ``what``."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
