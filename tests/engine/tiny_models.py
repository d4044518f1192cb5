"""Tiny random-weight Hugging Face models (fp32) saved as safetensors, for engine tests.

The models are built with ``transformers`` (the correctness oracle) and kept
tiny — hidden 64, 2 layers — so a whole engine test takes well under a
second. Every weight is random (norm weights and qkv biases included). Their
tokenizer is byte-level (one token per byte plus an end-of-text token), so
random generations exercise multi-byte streaming. Presets: ``llama`` (GQA),
``qwen2`` (qkv bias, one KV head, tied embeddings), ``qwen3`` (q/k norm,
explicit ``head_dim``), ``qwen3_moe`` (2 of 8 experts in layers 0 and 2, a
dense layer 1), ``mixtral`` (2 of 4 experts in every layer), ``deepseek_v2`` /
``deepseek_v3`` (multi-head latent attention).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB_SIZE = 257  # 256 bytes + <|endoftext|>
EOS_ID = 256
MAX_POSITIONS = 1024
PRESETS = {
    "llama": {},
    "qwen2": {"num_key_value_heads": 1, "tie_word_embeddings": True},
    "qwen3": {"head_dim": 16},
    "qwen3_moe": {"head_dim": 16, "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1]},
    "mixtral": {"intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    # multi-head latent attention: V2-Lite style queries and interleaved rotary pairs; V3 low-rank queries
    # experts after a dense first layer: V2 softmax over 4 groups of 2 (best 2 groups), V3 sigmoid with a bias
    "deepseek_v2": {"num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 8, "v_head_dim": 12, "first_k_dense_replace": 1, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
                    "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                    "routed_scaling_factor": 1.5},
    "deepseek_v3": {"num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 8, "v_head_dim": 12, "first_k_dense_replace": 1, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32, "n_group": 4,
                    "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5},
}
#: transformers class names per preset (config, model)
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
           "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
           "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
           "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}


def build_byte_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def build_tiny_model(folder: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a random ``arch`` (a key of :data:`PRESETS`) model with a byte tokenizer into ``folder``."""
    import transformers as tf

    config_cls, model_cls = (getattr(tf, name) for name in CLASSES[arch])
    kwargs = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                  eos_token_id=EOS_ID, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
                  initializer_range=0.2, rms_norm_eps=1e-6)
    kwargs.update(PRESETS[arch])
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():  # random norm weights and biases, so a layer that drops one would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0, 0.2)
        for name, buffer in model.named_buffers():  # DeepSeek-V3's expert choice bias (a buffer)
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.2)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    build_byte_tokenizer(folder)
    return folder


def engine_overrides(**keys) -> list[str]:
    """Hydra overrides for a small, fast engine; ``keys`` like ``cache__num_blocks=8`` override them."""
    base = {"model.max_model_len": 512, "scheduler.max_num_seqs": 16, "scheduler.max_num_batched_tokens": 256,
            "cache.block_size": 16}
    base.update({k.replace("__", "."): v for k, v in keys.items()})
    return [f"{k}={'null' if v is None else v}" for k, v in base.items()]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt (stops at EOS like the engine)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=EOS_ID)
    return out[0, len(prompt):].tolist()
