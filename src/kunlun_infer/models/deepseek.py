"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention, dense first layers, then shared and routed experts.

Attention (MLA): the query comes from one projection (``q_proj``, V2-Lite)
or a low-rank pair with a norm between (``q_a_proj`` → ``q_a_layernorm`` →
``q_b_proj``); ``kv_a_proj_with_mqa`` makes the latent (normalised by
``kv_a_layernorm``) and one rotary key shared by every head. Only the
latent and that key are cached — by the run's MLA attention backend, in its
layout — and ``kv_b_proj`` decompresses per-head keys and values from the
latent inside the backend. DeepSeek's rotary dimensions come in interleaved
pairs; they are regrouped into the rotate-half layout before the op table's
``rotary_embedding``, for queries and keys alike, which leaves every
query·key product as the checkpoint means it. With yarn scaling the softmax
scale is multiplied by ``mscale(factor, mscale_all_dim)²`` as DeepSeek's
configs ask. The first ``first_k_dense_replace`` layers have a dense SwiGLU
MLP, the others shared experts every token goes through plus routed experts
(:class:`~kunlun_infer.layers.moe.SparseMoeBlock`, routing options from the
config: see :func:`kunlun_infer.models.config._deepseek_moe`). Tensor parallelism splits the heads (``q_proj``/``q_b_proj``/
``kv_b_proj`` by rows, ``o_proj`` by columns); the latent projections are
replicated, so every rank caches the same latent. Parameter names follow
``transformers``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kunlun_infer.layers import (
    ColumnParallelLinear,
    LayerContext,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
)
from kunlun_infer.layers.context import divide
from kunlun_infer.layers.mla import MLAAttention, MLAUpProjection
from kunlun_infer.layers.moe import MOE_OPS, SparseMoeBlock
from kunlun_infer.models.base import CausalLM, LayerSpan, StagedCausalLM, StagedDecoder
from kunlun_infer.models.config import MLAConfig, ModelArchConfig
from kunlun_infer.models.llama import LlamaMLP
from kunlun_infer.ops.attention import AttentionSpec, mla_spec


def softmax_scale(config: ModelArchConfig) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` when scaled rotary asks for it."""
    scale = config.mla.qk_head_dim ** -0.5
    scaling = config.rope_scaling or {}
    mscale_all_dim = scaling.get("mscale_all_dim")
    factor = scaling.get("factor") or 1.0
    if mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs ``(x0, x1), (x2, x3), …`` of the last dim regrouped as ``(x0, x2, …, x1, x3, …)`` (rotate-half layout)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class DeepseekAttention(nn.Module):
    def __init__(self, config: ModelArchConfig, rotary_emb: RotaryEmbedding, ctx: LayerContext):
        super().__init__()
        mla: MLAConfig = config.mla
        self.mla = mla
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = divide(heads, ctx.tp_size, "attention heads")
        bias = config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * mla.qk_head_dim, False, ctx)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, mla.q_lora_rank, bias, ctx)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, config.rms_norm_eps, ctx)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, heads * mla.qk_head_dim, False, ctx)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, bias, ctx)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, config.rms_norm_eps, ctx)
        self.kv_b_proj = MLAUpProjection(mla.kv_lora_rank, heads, mla.qk_nope_head_dim, mla.v_head_dim, ctx)
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, hidden, config.attention_out_bias, ctx)
        self.rotary_emb = rotary_emb
        self.attn = MLAAttention(self.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim,
                                 softmax_scale(config), ctx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn: Any,
                kv_cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        mla = self.mla
        if mla.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_rope = q.view(-1, self.num_heads, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        k_rope = k_rope.unsqueeze(1)
        if mla.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = self.rotary_emb(positions, q_rope.contiguous(), k_rope.contiguous())
        out = self.attn(q_nope, q_rope, latent, k_rope.squeeze(1), self.kv_b_proj.per_head, attn, kv_cache)
        return self.o_proj(out.reshape(-1, self.num_heads * mla.v_head_dim))


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, layer: int, rotary_emb: RotaryEmbedding, ctx: LayerContext):
        super().__init__()
        self.self_attn = DeepseekAttention(config, rotary_emb, ctx)
        if config.moe is not None and config.moe.sparse_layers[layer]:
            # the router scores in float32, as DeepSeek's gate does whatever the model's dtype
            self.mlp = SparseMoeBlock(config.hidden_size, config.moe, ctx, router_dtype=torch.float32)
        else:
            self.mlp = LlamaMLP(config, ctx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                attn: Any, kv_cache: tuple[torch.Tensor, ...]):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, attn, kv_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekModel(StagedDecoder):
    """The DeepSeek decoder layers of ``span`` (see :class:`StagedDecoder`)."""

    def __init__(self, config: ModelArchConfig, ctx: LayerContext, max_positions: int, span: LayerSpan):
        rotary = RotaryEmbedding(config.mla.qk_rope_head_dim, max_positions, config.rope_theta, config.rope_scaling,
                                 config.max_position_embeddings, ctx)
        super().__init__(config, ctx, span, rotary, lambda i: DeepseekDecoderLayer(config, i, rotary, ctx))


class DeepseekV2ForCausalLM(StagedCausalLM):
    """``DeepseekV2ForCausalLM`` checkpoints (V2, V2-Lite)."""

    required_ops = CausalLM.required_ops + MOE_OPS
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelArchConfig, ctx: LayerContext, max_positions: int,
                 span: LayerSpan | None = None):
        super().__init__(config, ctx, max_positions, span, lambda span: DeepseekModel(config, ctx, max_positions, span))
        # what one token caches per layer: the latent and the rotary key, shared by every head
        self.num_kv_heads = 1
        self.head_dim = config.mla.kv_lora_rank + config.mla.qk_rope_head_dim

    @classmethod
    def attention_spec(cls, config: ModelArchConfig, *, dtype: torch.dtype, tp_size: int = 1) -> AttentionSpec:
        mla = config.mla
        return mla_spec(num_heads=divide(config.num_attention_heads, tp_size, "attention heads"),
                        qk_nope_head_dim=mla.qk_nope_head_dim, qk_rope_head_dim=mla.qk_rope_head_dim,
                        kv_lora_rank=mla.kv_lora_rank, v_head_dim=mla.v_head_dim, dtype=dtype)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """``DeepseekV3ForCausalLM`` checkpoints (V3, R1): sigmoid routing with a correction bias, grouped top-k."""
