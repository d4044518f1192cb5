"""The interface every model implements, and the weight bookkeeping they share.

A :class:`CausalLM` turns a flat batch of new tokens (with their positions and
the paged-cache metadata) into hidden states, and hidden states into float32
logits over the full vocabulary. It computes only through the op table it was
built with and declares the ops it needs in ``required_ops`` so the runtime
can resolve them before the first step. Its layers say which checkpoint
tensors they read (``weight_specs``); :meth:`CausalLM.checkpoint_tensors`
turns those into Hugging Face tensor names for the loader.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from kunlun_infer.layers import AttentionMetadata, LayerContext, WeightSpec
from kunlun_infer.models.config import ModelArchConfig


class CausalLM(nn.Module):
    """A decoder-only language model over a paged KV cache."""

    #: ops from ``kunlun_infer.ops.OP_SPECS`` this model calls
    required_ops: ClassVar[tuple[str, ...]] = (
        "embedding", "rms_norm", "add_rms_norm", "rotary_embedding", "pack_linear_weight", "linear",
        "silu_and_mul", "store_kv", "paged_attention")
    #: checkpoint module name -> (this model's merged module, shard id)
    packed_modules: ClassVar[dict[str, tuple[str, Any]]] = {}
    #: checkpoint tensors that carry nothing this model needs (name suffixes)
    ignored_tensor_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    config: ModelArchConfig
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __init__(self, config: ModelArchConfig, ctx: LayerContext):
        super().__init__()
        self.config = config
        self.ctx = ctx

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``[T]`` token ids and positions → ``[T, hidden]``; writes the tokens' K/V to ``kv_caches``."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` → ``[N, vocab]`` float32 (full vocabulary on every rank)."""
        raise NotImplementedError

    def checkpoint_tensors(self) -> dict[str, tuple[nn.Module, WeightSpec]]:
        """Every checkpoint tensor this rank reads: HF name -> (layer that loads it, what it is)."""
        merged = {target: name for name, target in self.packed_modules.items()}
        tensors = {}
        for module_name, module in self.named_modules():
            if not hasattr(module, "weight_specs"):
                continue
            for spec in module.weight_specs():
                name = module_name
                if spec.shard is not None:
                    parent, _, leaf = module_name.rpartition(".")
                    name = f"{parent}.{merged[(leaf, spec.shard)]}" if parent else merged[(leaf, spec.shard)]
                tensors[f"{name}.{spec.param}"] = (module, spec)
        return tensors

    def is_ignored_tensor(self, name: str) -> bool:
        """True for checkpoint tensors the model may skip (e.g. ``lm_head.weight`` when tied)."""
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return True
        return name.endswith(self.ignored_tensor_suffixes)

    def pack_weights(self) -> None:
        """Let the ops plugin prepare every linear weight once, after loading."""
        for module in self.modules():
            if module is not self and hasattr(module, "pack_weights"):
                module.pack_weights()

    def weight_nbytes(self) -> int:
        """Bytes held by weights on the device (parameters and packed weights, each counted once)."""
        seen, total = set(), 0
        tensors = list(self.parameters()) + [getattr(m, "packed_weight", None) for m in self.modules()]
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.data_ptr() if t.layout == torch.strided else id(t)  # opaque layouts have no data pointer
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        return total
