"""The Llama decoder (also Mistral-style checkpoints), written against the op table.

Pre-norm blocks: RMSNorm → attention (merged qkv projection, optional q/k
head norm, rotary, paged attention, output projection) → residual add fused
into the next RMSNorm → SwiGLU MLP (merged gate/up, ``silu_and_mul``, down).
The flags on :class:`ModelArchConfig` (qkv bias, output bias, MLP bias, q/k
norm, tied embeddings) cover the Qwen2 and Qwen3 variants as well, so
``models/qwen.py`` only names them. Parameter names follow ``transformers``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kunlun_infer.layers import (
    Attention,
    LayerContext,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from kunlun_infer.models.base import CausalLM
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
    def __init__(self, config: ModelArchConfig, rotary_emb: RotaryEmbedding, ctx: LayerContext):
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb, ctx)
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


class LlamaModel(nn.Module):
    def __init__(self, config: ModelArchConfig, ctx: LayerContext, max_positions: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx)
        self.rotary_emb = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling,
                                          config.max_position_embeddings, ctx)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, self.rotary_emb, ctx)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any,
                kv_caches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, attn, kv_cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    """``LlamaForCausalLM`` and ``MistralForCausalLM`` checkpoints."""

    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelArchConfig, ctx: LayerContext, max_positions: int):
        super().__init__(config, ctx)
        self.model = LlamaModel(config, ctx, max_positions)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx, tied_to=tied)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads
        self.head_dim = config.head_dim
        self.max_positions = max_positions

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any,
                kv_caches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        return self.model(input_ids, positions, attn, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
