"""Tiny random-weight Hugging Face models saved as real model folders, for tests.

``build_hf_model(path, "llama")`` writes ``config.json``,
``generation_config.json``, safetensors weights and a small byte-level BPE
tokenizer to ``path`` and returns the ``transformers`` model (the oracle) in
eval mode. Every parameter is drawn at random, biases and norm weights
included, so a layer that ignores one of them changes the logits.

Presets (``ARCHITECTURES``): ``llama`` (GQA), ``llama_mqa`` (one KV head),
``mistral``, ``qwen2`` (qkv bias, tied embeddings), ``qwen3`` (q/k norm,
``head_dim`` != hidden / heads), ``qwen3_moe`` and ``mixtral`` (mixture of
experts), ``deepseek_v2`` and ``deepseek_v3``
(multi-head latent attention, a dense first layer, shared and routed
experts). Any config field can be overridden.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 320
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
_SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "def add(a, b):\n    return a + b\n",
    "Paged attention keeps keys and values in fixed-size blocks.",
    "0123456789 +-*/= () [] {} <> ,.;:!? 'quoted' \"double\"",
    "Ünïcödé, 中文字符, emoji 🙂 and tabs\tand newlines\n",
]

_COMMON: dict[str, Any] = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                               rms_norm_eps=1e-6, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                               tie_word_embeddings=False)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"rope_theta": 10000.0}),
    "llama_mqa": ("LlamaConfig", {"num_key_value_heads": 1}),
    "mistral": ("MistralConfig", {"sliding_window": None, "num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    # mixture of experts: layer 1 of 3 is dense (mlp_only_layers), the others route to 2 of 8 experts
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 32, "num_hidden_layers": 3, "num_experts": 8,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True,
                                     "mlp_only_layers": [1]}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    # multi-head latent attention; V2-Lite style (one query projection), group-limited greedy routing
    "deepseek_v2": ("DeepseekV2Config", {
        "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_shared_experts": 2, "moe_intermediate_size": 24,
        "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5,
        "first_k_dense_replace": 1}),
    # low-rank queries, sigmoid routing with a correction bias, grouped top-k over the best two of each group
    "deepseek_v3": ("DeepseekV3Config", {
        "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 24, "n_group": 4,
        "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1}),
}


def tiny_hf_config(arch: str = "llama", **overrides: Any):
    """A ``transformers`` config for a tiny model of preset ``arch``; ``overrides`` win."""
    import transformers

    class_name, preset = ARCHITECTURES[arch]
    fields = {**_COMMON, **preset, **overrides}
    rope = {"rope_type": "default", "rope_theta": fields.pop("rope_theta", 10000.0)}
    scaling = fields.pop("rope_scaling", None)
    if scaling:
        rope.update(scaling)
    return getattr(transformers, class_name)(**rope_config_kwargs(rope), **fields)


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def rope_config_kwargs(rope: dict[str, Any]) -> dict[str, Any]:
    """Rotary settings as this transformers' config classes take them.

    transformers 5 takes one ``rope_parameters`` dict; transformers 4 (the
    release line for torch < 2.6) takes ``rope_theta`` and ``rope_scaling``.
    """
    if _transformers_major() >= 5:
        return {"rope_parameters": dict(rope)}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_theta": rope["rope_theta"],
            "rope_scaling": None if scaling.get("rope_type", "default") == "default" and len(scaling) <= 1 else scaling}


def rope_parameters(config: Any) -> dict[str, Any]:
    """A transformers config's rotary settings in transformers 5's layout, whichever release made the config."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    return {"rope_theta": config.rope_theta, **scaling}


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.08) -> None:
    """Draw every parameter (biases and norm weights too), and DeepSeek-V3's routing bias, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():  # DeepSeek-V3's expert choice bias is a buffer, saved with the weights
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def save_tiny_tokenizer(path: str | Path, *, add_bos_token: bool = False) -> None:
    """Train a byte-level BPE (ids 0-2 are ``<s>``, ``</s>``, ``<pad>``) and save it with its config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=_SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "pad_token": "<pad>", "add_bos_token": add_bos_token, "clean_up_tokenization_spaces": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def build_hf_model(path: str | Path, arch: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32,
                   max_shard_size: str | None = None, tokenizer: bool = True, **overrides: Any):
    """Save a tiny random ``arch`` model folder to ``path``; returns the ``transformers`` model (eval).

    ``dtype`` is the saved (and returned) precision; ``max_shard_size`` (e.g.
    ``"40KB"``) writes a sharded checkpoint with its index.
    """
    import transformers

    config = tiny_hf_config(arch, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(str(path), safe_serialization=True, **kwargs)
    if tokenizer:
        save_tiny_tokenizer(path)
    if dtype != torch.float32:  # as a user would load it (rotary buffers stay float32)
        model = load_hf_model(path, dtype)
    return model.eval()


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """The ``transformers`` model saved in ``path``, in ``dtype``, eager attention, eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                             attn_implementation="eager").eval()
