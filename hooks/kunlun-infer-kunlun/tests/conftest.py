"""Shared fixtures: the ``kunlun_ops`` stand-in, one torch thread, and tiny transformers models with references."""

from __future__ import annotations

import types

import pytest
import torch

import kunlun_ops_standin

PROMPT_LENGTHS = [1, 5, 16, 17, 40]
MAX_TOKENS = 6


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors gain nothing from threads on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def standin(monkeypatch):
    """``import kunlun_ops`` gives the stand-in for this test."""
    kunlun_ops_standin.install(monkeypatch)
    return kunlun_ops_standin


def build_model(folder, arch: str):
    """A random-weight ``arch`` (llama | qwen3 | qwen3_moe) saved as safetensors with a byte tokenizer; returns the
    HF model."""
    import transformers as tf

    from kunlun_infer.tools.tiny_model import EOS_ID, VOCAB_SIZE, write_byte_tokenizer

    config_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                             "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
                             "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM)}[arch]
    # head size 32: the smallest the vendor's attention kernels serve (Qwen3's is explicit, Llama's is hidden / heads)
    extra = {"head_dim": 32, "hidden_size": 64} if arch.startswith("qwen3") else {"hidden_size": 128}
    if arch == "qwen3_moe":  # 2 of 8 experts per token, renormalised
        extra.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)
    config = config_cls(vocab_size=VOCAB_SIZE, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=EOS_ID,
                        bos_token_id=None, pad_token_id=None, tie_word_embeddings=False, **extra)
    torch.manual_seed(7)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():  # random norm weights too, so a norm that drops its weight shows
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    return model


@pytest.fixture(scope="session", params=["llama", "qwen3", "qwen3_moe"])
def tiny_model(request, tmp_path_factory):
    """``folder``, ``prompts``, ``max_tokens`` and transformers' greedy ``references`` for one architecture."""
    folder = tmp_path_factory.mktemp(request.param)
    model = build_model(folder, request.param)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    return types.SimpleNamespace(folder=folder, prompts=prompts, max_tokens=MAX_TOKENS, references=refs,
                                 experts=request.param == "qwen3_moe")
