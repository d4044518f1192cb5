"""A tiny random-weight Llama written in-process: ``config.json`` plus ``model.safetensors``.

The bring-up tools need a model that exists on every machine, loads in a
blink and splits over any tensor-parallel size up to 8. Tensor names and
shapes come from the engine's own model code (built on the meta device), so
the folder loads exactly as a Hugging Face checkpoint would. Weights are
seeded: the same call writes the same bytes. The tokenizer is byte-level:
one token per byte, plus an end-of-text token.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kunlun_infer.models.config import parse_model_config
from kunlun_infer.tools.model_shapes import meta_model

VOCAB_SIZE = 257  # 256 bytes + <|endoftext|>
EOS_ID = 256
HEAD_DIM = 16


def tiny_config(*, tensor_size: int = 1, num_layers: int = 2, max_positions: int = 512) -> dict:
    """A Llama ``config.json`` whose heads and features divide by ``tensor_size``."""
    kv_heads = max(2, tensor_size)
    heads = 2 * kv_heads
    hidden = heads * HEAD_DIM
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": num_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": HEAD_DIM,
        "max_position_embeddings": max_positions, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": None, "eos_token_id": EOS_ID,
    }


def write_tiny_model(folder: str | Path, *, tensor_size: int = 1, seed: int = 0, num_layers: int = 2) -> Path:
    """Write the tiny model into ``folder`` (created if needed) and return it."""
    from safetensors.torch import save_file


    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = tiny_config(tensor_size=tensor_size, num_layers=num_layers)
    arch = parse_model_config(raw, folder / "config.json")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (_, spec) in sorted(meta_model(arch, max_model_len=1).checkpoint_tensors().items()):
        noise = torch.randn(*spec.shape, generator=generator)
        # norms near one and small projections keep activations in range, so logits separate tokens
        tensors[name] = (1.0 + 0.1 * noise) if "norm" in name else 0.1 * noise
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    write_byte_tokenizer(folder)
    return folder


def write_byte_tokenizer(folder: Path) -> None:
    """``tokenizer.json``: byte-level BPE without merges (token = byte) and ``<|endoftext|>`` as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
