"""What every layer is built with: the op table, where tensors live, and its tensor-parallel place.

Layers never reach for a device or a global: a :class:`LayerContext` is passed
in when a model is built. ``ops`` is the runtime's resolved op table (attribute
access, ``ops.linear(...)``); ``comm`` is the runtime's Comm, used only when
``tp_size > 1``. This module also holds the few helpers layers share to read
their shard of a checkpoint tensor.
"""

from __future__ import annotations

import dataclasses
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
    #: dtype in which low-precision all-reduces accumulate (``comm.accumulate_dtype``)
    accumulate_dtype: torch.dtype | None = torch.float32

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
    return isinstance(packed, torch.Tensor) and packed.data_ptr() == weight.data_ptr()


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator`` when exact, else a ``ValueError`` naming ``what``."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
