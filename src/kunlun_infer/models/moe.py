"""Mixture-of-experts decoders on the Llama blocks: Qwen3-MoE and Mixtral.

Attention is the Llama/Qwen3 one; the feed-forward part of a layer is a
:class:`~kunlun_infer.layers.moe.SparseMoeBlock` where the config's
``moe.sparse_layers`` says so, a dense SwiGLU MLP elsewhere.

- Qwen3-MoE: q/k head norm; experts in every ``decoder_sparse_step``-th
  layer except ``mlp_only_layers``, under ``mlp`` (``mlp.gate``,
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj``); top-k weights
  renormalised when ``norm_topk_prob``.
- Mixtral: experts in every layer, under ``block_sparse_moe``
  (``experts.{e}.w1`` gate, ``w3`` up, ``w2`` down); top-k always renormalised.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from kunlun_infer.layers import LayerContext
from kunlun_infer.layers.moe import MIXTRAL_EXPERT_NAMES, MOE_OPS, QWEN_EXPERT_NAMES, SparseMoeBlock
from kunlun_infer.models.base import CausalLM
from kunlun_infer.models.config import ModelArchConfig
from kunlun_infer.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class MoeDecoderLayer(LlamaDecoderLayer):
    """A Llama block whose feed-forward part is routed experts in the layers the config names."""

    expert_names: ClassVar[tuple[str, str, str]] = QWEN_EXPERT_NAMES

    def make_feed_forward(self, config: ModelArchConfig, ctx: LayerContext, layer_idx: int) -> nn.Module:
        if config.moe is None or not config.moe.sparse_layers[layer_idx]:
            return LlamaMLP(config, ctx)
        return SparseMoeBlock(config.hidden_size, config.moe, ctx, expert_names=self.expert_names)


class MixtralDecoderLayer(MoeDecoderLayer):
    feed_forward_name = "block_sparse_moe"
    expert_names = MIXTRAL_EXPERT_NAMES


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """``Qwen3MoeForCausalLM`` checkpoints."""

    required_ops = CausalLM.required_ops + MOE_OPS
    decoder_layer = MoeDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    """``MixtralForCausalLM`` checkpoints."""

    required_ops = CausalLM.required_ops + MOE_OPS
    decoder_layer = MixtralDecoderLayer
