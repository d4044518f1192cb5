"""What every layer is built with: the op table, where tensors live, and its tensor-parallel place.

Layers never reach for a device or a global: a :class:`LayerContext` is passed
in when a model is built. ``ops`` is the runtime's resolved op table (attribute
access, ``ops.linear(...)``); ``attention`` the attention backend that owns
the KV cache's layout and kernels; ``comm`` is the runtime's Comm, used only when
``tp_size > 1``; ``streams`` is set only when the streams plugin has a comm
stream of its own, so that all-reduces can overlap computation. This module
also holds the few helpers layers share to read their shard of a checkpoint
tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """Everything a layer needs besides its own sizes."""

    ops: Any
    device: torch.device
    dtype: torch.dtype
    tp_rank: int = 0
    tp_size: int = 1
    comm: Any = None
    #: dtype in which all-reduces accumulate; ``None`` leaves it to the comm plugin, which was built
    #: from ``comm.accumulate_dtype`` (so ``none`` there really switches widening off)
    accumulate_dtype: torch.dtype | None = None
    #: the runtime's streams when its comm stream is distinct (``streams.overlaps``); ``None`` = inline collectives
    streams: Any = None
    #: the run's attention backend (:class:`kunlun_infer.ops.attention.AttentionBackend`)
    attention: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} is outside 0..{self.tp_size - 1}")
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


class WeightSpec(NamedTuple):
    """One checkpoint tensor a layer loads: which parameter, which part of it, the full shape."""

    param: str
    shard: Any
    shape: tuple[int, ...]


def source_shape(source: Any) -> tuple[int, ...]:
    """Shape of a checkpoint tensor given as a tensor or a safetensors slice."""
    return tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)


def read_part(source: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """Rows (``dim=0``) or columns (``dim=1``) ``start:start+size`` of ``source``, read lazily."""
    if dim == 0:
        return source[start:start + size]
    return source[:, start:start + size]


def copy_weight(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor (any float dtype, on the host) into a parameter slice."""
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"shard shape {tuple(loaded.shape)} does not fit parameter part {tuple(target.shape)}")
    target.copy_(loaded.to(dtype=target.dtype))


def shares_storage(packed: Any, weight: torch.Tensor) -> bool:
    """True when a packed weight is the loaded weight itself (no second copy to free)."""
    if not isinstance(packed, torch.Tensor) or packed.layout != torch.strided:
        return False  # an opaque layout (e.g. oneDNN-blocked) is always a copy of its own
    return packed.data_ptr() == weight.data_ptr()


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator`` when exact, else a ``ValueError`` naming ``what``."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
