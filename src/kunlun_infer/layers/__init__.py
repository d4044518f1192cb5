"""Model building blocks that compute only through the runtime's op table: linear (incl.
tensor-parallel), embedding / LM head, RMSNorm, rotary embedding, paged attention."""

from kunlun_infer.layers.attention import Attention, AttentionMetadata
from kunlun_infer.layers.context import LayerContext
from kunlun_infer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kunlun_infer.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from kunlun_infer.layers.norm import RMSNorm
from kunlun_infer.layers.rotary import RotaryEmbedding, rope_cos_sin_cache
from kunlun_infer.layers.weights import WeightSpec

__all__ = [
    "Attention",
    "AttentionMetadata",
    "ColumnParallelLinear",
    "LayerContext",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "WeightSpec",
    "rope_cos_sin_cache",
]
