"""The Llama decoder (also Mistral-style checkpoints), written against the op table.

Pre-norm blocks: RMSNorm → attention (merged qkv projection, optional q/k
head norm, rotary, paged attention, output projection) → residual add fused
into the next RMSNorm → SwiGLU MLP (merged gate/up, ``silu_and_mul``, down).
The flags on :class:`ModelArchConfig` (qkv bias, output bias, MLP bias, q/k
norm, tied embeddings) cover the Qwen2 and Qwen3 variants as well, so
``models/qwen.py`` only names them. Parameter names follow ``transformers``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from kunlun_infer.layers import (
    Attention,
    LayerContext,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
)
from kunlun_infer.models.base import LayerSpan, StagedCausalLM, StagedDecoder
from kunlun_infer.models.config import ModelArchConfig


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelArchConfig, rotary_emb: RotaryEmbedding, ctx: LayerContext):
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, config.attention_bias, ctx)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size,
                                        config.attention_out_bias, ctx)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, ctx) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps, ctx) if config.qk_norm else None
        self.rotary_emb = rotary_emb
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, d ** -0.5, ctx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, attn: Any,
                kv_cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, attn, kv_cache)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelArchConfig, ctx: LayerContext):
        super().__init__()
        self.ctx = ctx
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, config.mlp_bias, ctx)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, config.mlp_bias, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ctx.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    #: attribute (and checkpoint) name of the feed-forward part: ``mlp``, Mixtral's ``block_sparse_moe``
    feed_forward_name: ClassVar[str] = "mlp"

    def __init__(self, config: ModelArchConfig, rotary_emb: RotaryEmbedding, ctx: LayerContext, layer_idx: int = 0):
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb, ctx)
        setattr(self, self.feed_forward_name, self.make_feed_forward(config, ctx, layer_idx))
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
        return getattr(self, self.feed_forward_name)(hidden), residual

    def make_feed_forward(self, config: ModelArchConfig, ctx: LayerContext, layer_idx: int) -> nn.Module:
        """The feed-forward part of layer ``layer_idx`` (a dense SwiGLU MLP here; experts in MoE models)."""
        return LlamaMLP(config, ctx)


class LlamaModel(StagedDecoder):
    """The Llama-family decoder layers of ``span`` (see :class:`StagedDecoder`)."""

    def __init__(self, config: ModelArchConfig, ctx: LayerContext, max_positions: int, span: LayerSpan,
                 layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer):
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling,
                                 config.max_position_embeddings, ctx)
        super().__init__(config, ctx, span, rotary, lambda i: layer_class(config, rotary, ctx, i))


class LlamaForCausalLM(StagedCausalLM):
    """``LlamaForCausalLM`` and ``MistralForCausalLM`` checkpoints."""

    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    #: the decoder layer the model stacks
    decoder_layer: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

    def __init__(self, config: ModelArchConfig, ctx: LayerContext, max_positions: int,
                 span: LayerSpan | None = None):
        super().__init__(config, ctx, max_positions, span,
                         lambda span: LlamaModel(config, ctx, max_positions, span, self.decoder_layer))
        self.num_kv_heads = self.model.layers[self.span.start].self_attn.num_kv_heads
        self.head_dim = config.head_dim
