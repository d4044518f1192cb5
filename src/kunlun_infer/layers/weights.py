"""What layers share to load their weights: which checkpoint tensor fills which parameter, and reading a shard.

A layer lists the checkpoint tensors it needs as :class:`WeightSpec` entries;
the loader hands each one over as a tensor or a lazily read safetensors slice,
of which the layer reads only its tensor-parallel part (:func:`read_part`) and
copies it in (:func:`copy_weight`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


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
