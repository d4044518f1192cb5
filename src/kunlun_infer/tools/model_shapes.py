"""A model's sizes per tensor-parallel rank, from its ``config.json`` alone — no weights read.

The model is built by the engine's own model code on the ``meta`` device
(shapes without storage) for rank 0 of ``tensor_size`` ranks, so the figures
include exactly the sharding, padding and replication a real run does (for a
mixture-of-experts model: every expert's slice, or whole experts per rank under
``parallel.expert_size``):
parameters per rank, and the per-rank KV layout (layers, local KV heads,
head dim).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from kunlun_infer.errors import ModelLoadError
from kunlun_infer.layers import LayerContext
from kunlun_infer.models import load_model_config
from kunlun_infer.models.base import LayerSpan
from kunlun_infer.models.loader import model_class


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """What the memory plan needs to know about a model on one rank."""

    architecture: str
    num_params: int  #: parameters of the whole model (each counted once)
    params_per_rank: int  #: parameters one rank holds
    num_layers: int
    num_kv_heads: int  #: KV heads one rank holds
    head_dim: int
    max_context_len: int


class _NoComm:
    """Stands in for a comm on the meta device: building a model never communicates."""


def meta_model(arch: Any, *, tensor_size: int = 1, max_model_len: int | None = None,
               dtype: torch.dtype = torch.float32, span: LayerSpan | None = None, expert_size: int = 1) -> Any:
    """Rank 0's model of ``tensor_size`` ranks (of the pipeline stage running ``span``), built on the meta
    device (no memory, no weights).

    ``expert_size`` (``parallel.expert_size``): 1 or ``tensor_size``, how a mixture-of-experts model's experts
    spread over the ranks (ignored for a dense model).
    """
    ctx = LayerContext(ops=None, device=torch.device("meta"), dtype=dtype, tp_rank=0, tp_size=tensor_size,
                       comm=_NoComm() if tensor_size > 1 else None,
                       ep_size=expert_size if getattr(arch, "moe", None) is not None else 1)
    try:
        return model_class(arch)(arch, ctx, max_model_len or arch.max_context_len, span)
    except ValueError as exc:
        raise ModelLoadError(f"{arch.architecture}: cannot split this model over parallel.tensor_size="
                             f"{tensor_size}: {exc}") from exc


def _param_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def model_shapes(model_dir: str | Path, *, tensor_size: int = 1, span: LayerSpan | None = None,
                 expert_size: int = 1) -> ModelShapes:
    """Sizes of the model in ``model_dir`` (only ``config.json`` is read) on one of ``tensor_size`` ranks
    (of the pipeline stage running ``span``; default: the whole model; experts spread as ``expert_size`` says)."""
    arch = load_model_config(model_dir)
    whole = meta_model(arch, max_model_len=1)
    rank = whole if tensor_size == 1 and span is None else meta_model(arch, tensor_size=tensor_size,
                                                                       max_model_len=1, span=span,
                                                                       expert_size=expert_size)
    return ModelShapes(architecture=arch.architecture, num_params=_param_count(whole),
                       params_per_rank=_param_count(rank), num_layers=rank.num_layers,
                       num_kv_heads=rank.num_kv_heads, head_dim=rank.head_dim,
                       max_context_len=arch.max_context_len)
