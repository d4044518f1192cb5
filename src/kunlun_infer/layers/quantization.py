"""Weight quantization (``model.quantization``): which weights are quantized, and the ops that serve them.

``model.quantization=int8`` quantizes every linear weight at load, per output
channel and symmetric (``ops.reference.quantize_int8``: int8 values, float32
scales), and multiplies with ``ops.int8_linear``, which quantizes each row of
activations the same way at run time and sums the integer products exactly
(W8A8). ``model.quantize_head`` and ``model.quantize_embedding`` (both on by
default) extend it to the LM head and to the token-embedding table (rows
looked up as int8 and scaled back). With tensor parallelism each rank
quantizes its own shard. How a weight is laid out for the multiply is the
ops plugin's choice (``pack_int8_linear_weight``); what the numbers mean is
the reference's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kunlun_infer.config import QUANTIZATION_METHODS as METHODS
from kunlun_infer.errors import ConfigError
from kunlun_infer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kunlun_infer.layers.linear import LinearBase

#: ops a quantized model needs besides the model's own
INT8_OPS = ("pack_int8_linear_weight", "int8_linear")


@dataclasses.dataclass(frozen=True)
class Quantization:
    """What ``model.quantization*`` asks for. ``head``: the LM head too; ``embedding``: the embedding table too."""

    method: str = "int8"
    head: bool = True
    embedding: bool = True

    @property
    def required_ops(self) -> tuple[str, ...]:
        return INT8_OPS

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, model_cfg: Any) -> Quantization | None:
        """The quantization of a ``model`` config node, or ``None`` for full-precision weights."""
        method = model_cfg.get("quantization")
        method = "none" if method is None else str(method).lower()
        if method not in METHODS:
            raise ConfigError(f"model.quantization={model_cfg.get('quantization')!r} is not supported; use one of "
                              f"{', '.join(METHODS)}")
        if method == "none":
            return None
        return cls(method=method, head=bool(model_cfg.get("quantize_head", True)),
                   embedding=bool(model_cfg.get("quantize_embedding", True)))


def estimate_weight_bytes(model: Any, dtype_bytes: int, quantization: Quantization | None) -> int:
    """Bytes the weights of ``model`` (built on the meta device: shapes only) hold once loaded.

    Full-precision weights take ``dtype_bytes`` per parameter; a quantized weight one byte per value plus a
    float32 scale per row (what the reference keeps; an ops plugin's packed layout may pad it a little). A
    quantized LM head is a copy of its own even when tied to the embedding.
    """
    def int8_bytes(rows: int, cols: int) -> int:
        return rows * cols + 4 * rows

    total, seen = 0, set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            quantized = quantization is not None and name == "weight" and (
                (isinstance(module, LinearBase) and getattr(module, "quantized_with_model", True))
                or (isinstance(module, ParallelLMHead) and quantization.head and not module.tied)
                or (type(module) is VocabParallelEmbedding and quantization.embedding))
            total += int8_bytes(*param.shape) if quantized else param.numel() * dtype_bytes
        if quantization is not None and isinstance(module, ParallelLMHead) and module.tied and quantization.head:
            total += int8_bytes(module.rows_per_rank, module.hidden_size)  # the head's own int8 copy
    return total
