"""Qwen2 and Qwen3: the Llama decoder with the variants their configs switch on.

Qwen2 adds a bias to the q/k/v projections (never to the output projection)
and often ties the embeddings. Qwen3 drops that bias, normalises each query
and key head with its own RMSNorm before rotary, and sets ``head_dim``
explicitly (not always ``hidden_size / num_attention_heads``). The config
parser turns those facts into flags the Llama layers already honour.
"""

from __future__ import annotations

from kunlun_infer.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """``Qwen2ForCausalLM`` checkpoints (q/k/v bias)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """``Qwen3ForCausalLM`` checkpoints (per-head q/k RMSNorm, explicit head_dim)."""
