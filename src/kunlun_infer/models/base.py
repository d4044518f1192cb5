"""The interface every model implements, and the weight bookkeeping they share.

A :class:`CausalLM` turns a flat batch of new tokens (with their positions and
the attention backend's metadata for the step) into hidden states, and
hidden states into float32 logits over the full vocabulary. It computes only
through the op table and the attention backend it was built with; it
declares the ops it needs in ``required_ops`` and its attention in
:meth:`CausalLM.attention_spec` so the runtime can resolve both before the
first step. Its layers say which checkpoint
tensors they read (``weight_specs``); :meth:`CausalLM.checkpoint_tensors`
turns those into Hugging Face tensor names for the loader.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from kunlun_infer.layers import LayerContext, ParallelLMHead, RMSNorm, VocabParallelEmbedding, WeightSpec
from kunlun_infer.layers.linear import heads_per_rank
from kunlun_infer.models.config import ModelArchConfig
from kunlun_infer.ops.attention import AttentionBackend, AttentionSpec


@dataclasses.dataclass(frozen=True)
class LayerSpan:
    """Layers ``start .. end-1`` of a model of ``total`` layers (the whole model by default)."""

    start: int
    end: int
    total: int

    @classmethod
    def whole(cls, total: int) -> LayerSpan:
        return cls(0, total, total)

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.total

    @property
    def num_layers(self) -> int:
        return self.end - self.start


class StagedDecoder(nn.Module):
    """The decoder layers of ``span`` (the embedding only on the first stage, the final norm only on the last).

    Layers keep their checkpoint index (``layers.10``; another stage's layers
    are empty placeholders), so a later pipeline stage reads the same tensor
    names as the whole model. ``make_layer(i)`` builds layer ``i``.
    """

    def __init__(self, config: ModelArchConfig, ctx: LayerContext, span: LayerSpan, rotary_emb: nn.Module,
                 make_layer: Callable[[int], nn.Module]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx) \
            if span.is_first else None
        self.rotary_emb = rotary_emb
        self.span = span
        self.layers = nn.ModuleList(make_layer(i) if span.start <= i < span.end else nn.Identity()  # another stage's
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx) if span.is_last else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any,
                kv_caches: list[tuple[torch.Tensor, ...]],
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        """Final hidden states on the last stage; ``(hidden, residual)`` for the next stage on the others."""
        hidden, residual = (self.embed_tokens(input_ids), None) if intermediate is None else intermediate
        for layer, kv_cache in zip(self.layers[self.span.start:self.span.end], kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, attn, kv_cache)
        if self.norm is None:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """A decoder-only language model over a paged KV cache."""

    #: ops from ``kunlun_infer.ops.OP_SPECS`` this model calls (attention's own come from its backend)
    required_ops: ClassVar[tuple[str, ...]] = (
        "embedding", "rms_norm", "add_rms_norm", "rotary_embedding", "pack_linear_weight", "linear",
        "silu_and_mul")
    #: checkpoint module name -> (this model's merged module, shard id)
    packed_modules: ClassVar[dict[str, tuple[str, Any]]] = {}
    #: checkpoint tensors that carry nothing this model needs (name suffixes)
    ignored_tensor_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    #: with several tensor-parallel ranks, the plugin failures this rank's step held back (see the loader)
    deferred_failures: Any = None
    config: ModelArchConfig
    #: the layers this rank runs (a pipeline stage's; the whole model without pipeline parallelism)
    span: LayerSpan
    #: layers this rank runs (and holds KV for)
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __init__(self, config: ModelArchConfig, ctx: LayerContext):
        super().__init__()
        self.config = config
        self.ctx = ctx

    @classmethod
    def attention_spec(cls, config: ModelArchConfig, *, dtype: torch.dtype, tp_size: int = 1) -> AttentionSpec:
        """The attention this model's layers need on one of ``tp_size`` ranks (``ValueError`` if it cannot split)."""
        heads, kv_heads = heads_per_rank(config.num_attention_heads, config.num_key_value_heads, tp_size)
        return AttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=config.head_dim, dtype=dtype)

    @property
    def attention(self) -> AttentionBackend:
        """The attention backend the layers store and attend with (it owns the KV cache layout)."""
        return self.ctx.attention

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any,
                kv_caches: list[tuple[torch.Tensor, ...]],
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        """``[T]`` token ids and positions → ``[T, hidden]``; the backend writes the tokens' K/V to ``kv_caches``.

        ``attn``: the attention backend's metadata for the step; ``kv_caches``:
        one tuple of cache tensors per layer of :attr:`span`, in the
        backend's layout. On a pipeline stage after the first,
        ``intermediate`` is the stage before's ``(hidden, residual)`` (and
        ``input_ids`` is unused); a stage before the last returns its own
        ``(hidden, residual)`` instead of the normed hidden states.
        """
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` → ``[N, vocab]`` float32 (full vocabulary on every rank)."""
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids → ``[T, hidden]``: what :meth:`forward` starts from on the first stage.

        ``forward(ids, positions, attn, kv_caches, (embed(ids), None))`` then
        equals ``forward(ids, positions, attn, kv_caches)``; captured decode
        steps (``engine/step_graph.py``) run the embedding this way, outside
        the capture.
        """
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
        """True for checkpoint tensors the model may skip (e.g. ``lm_head.weight`` when tied, the tensors
        of layers another pipeline stage runs, or the experts other ranks hold)."""
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return True
        return (name.endswith(self.ignored_tensor_suffixes) or not self.owns_tensor(name)
                or name in self.held_elsewhere)

    def owns_tensor(self, name: str) -> bool:
        """False for a checkpoint tensor of a part another pipeline stage holds (override per architecture)."""
        return True

    @functools.cached_property
    def held_elsewhere(self) -> frozenset[str]:
        """Checkpoint tensors other ranks load instead of this one (layers with ``params_held_elsewhere``)."""
        return frozenset(f"{module_name}.{param}" for module_name, module in self.named_modules()
                         if hasattr(module, "params_held_elsewhere") for param in module.params_held_elsewhere())

    def pack_weights(self) -> None:
        """Let the ops plugin prepare every linear weight once, after loading."""
        for module in self.modules():
            if module is not self and hasattr(module, "pack_weights"):
                module.pack_weights()

    def weight_nbytes(self) -> int:
        """Bytes held by weights on the device (parameters and packed weights, each counted once)."""
        seen, total = set(), 0
        tensors = list(self.parameters())

        def flatten(packed: Any) -> list[Any]:
            if isinstance(packed, (tuple, list)):
                return [t for part in packed for t in flatten(part)]
            return [packed]

        for m in self.modules():  # a packed weight may be a tensor or (nested) tuples of them: int8 and scales,
            tensors += flatten(getattr(m, "packed_weight", None))  # each expert's packed weights
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.data_ptr() if t.layout == torch.strided else id(t)  # opaque layouts have no data pointer
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        return total


class StagedCausalLM(CausalLM):
    """A :class:`CausalLM` whose layers are a :class:`StagedDecoder` (``self.model``, built by ``make_model`` for
    the span) and whose LM head sits on the last stage.

    Checkpoint tensors of layers outside the span (another stage's, or past the
    last decoder layer such as DeepSeek-V3's multi-token-prediction layers) are
    not this rank's; a last stage without the embedding reads a tied table
    itself, under the embedding's name.
    """

    def __init__(self, config: ModelArchConfig, ctx: LayerContext, max_positions: int, span: LayerSpan | None,
                 make_model: Callable[[LayerSpan], StagedDecoder]):
        super().__init__(config, ctx)
        self.span = span = span if span is not None else LayerSpan.whole(config.num_hidden_layers)
        self.model = make_model(span)
        self.lm_head = None
        if span.is_last:
            tied = self.model.embed_tokens if config.tie_word_embeddings else None
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx, tied_to=tied)
        self.num_layers = span.num_layers
        self.max_positions = max_positions

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any,
                kv_caches: list[tuple[torch.Tensor, ...]],
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        return self.model(input_ids, positions, attn, kv_caches, intermediate)

    def checkpoint_tensors(self) -> dict[str, tuple[nn.Module, WeightSpec]]:
        tensors = super().checkpoint_tensors()
        if self.config.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is None:
            tensors["model.embed_tokens.weight"] = tensors.pop("lm_head.weight")
        return tensors

    def owns_tensor(self, name: str) -> bool:
        span = self.span
        if name.startswith("model.layers."):
            return span.start <= int(name.split(".")[2]) < span.end
        if name.startswith("model.embed_tokens."):
            return span.is_first or (span.is_last and self.config.tie_word_embeddings)
        if name.startswith(("model.norm.", "lm_head.")):
            return span.is_last
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.model.embed_tokens is None:
            raise ValueError(f"layers {self.span.start}-{self.span.end - 1} are not the first pipeline stage: "
                             f"they have no token embedding")
        return self.model.embed_tokens(input_ids)
