"""Rotary tables equal transformers' bit for bit, and scaled models give transformers' logits."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kunlun_infer.layers import rope_cos_sin_cache
from kunlun_infer.models import load_model
from tests.models.hf_factory import build_hf_model, rope_config_kwargs
from tests.models.paged import PagedKV, hf_logits, max_relative_error

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 1.7},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "mscale": 0.8,
                    "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                              "attention_factor": 1.3, "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}
HEAD_DIM, THETA, MAX_POS = 32, 500.0, 64
#: how a forward call takes the KV cache: ``cache`` in transformers 5, ``past_key_values`` in 4
CACHE_ARG = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else (
    "past_key_values")


def hf_rotary(scaling):
    rope = {"rope_type": "default", "rope_theta": THETA, **(scaling or {})}
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=HEAD_DIM,
                                      max_position_embeddings=MAX_POS, **rope_config_kwargs(rope))
    return LlamaRotaryEmbedding(config)


def hf_rows(module, positions):
    cos, sin = module(torch.zeros(1), torch.as_tensor(positions)[None])
    return torch.stack((cos[0], sin[0]), dim=1)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_cos_sin_table_is_bitwise_transformers(name):
    table = rope_cos_sin_cache(HEAD_DIM, MAX_POS, THETA, SCALINGS[name], MAX_POS)
    assert table.shape == (MAX_POS, 2, HEAD_DIM) and table.dtype == torch.float32
    assert torch.equal(table, hf_rows(hf_rotary(SCALINGS[name]), range(MAX_POS)))


def test_dynamic_ntk_beyond_max_positions_follows_incremental_decoding():
    # transformers regrows the frequencies for each longer step: token p is rotated for a p+1 long sequence
    scaling = SCALINGS["dynamic"]
    table = rope_cos_sin_cache(HEAD_DIM, 2 * MAX_POS, THETA, scaling, MAX_POS)
    module = hf_rotary(scaling)
    assert torch.equal(table[:MAX_POS], hf_rows(module, range(MAX_POS)))
    for p in range(MAX_POS, 2 * MAX_POS):
        assert torch.equal(table[p], hf_rows(module, [p])[0]), p
    assert not torch.equal(table[MAX_POS:], rope_cos_sin_cache(HEAD_DIM, 2 * MAX_POS, THETA, None, MAX_POS)[MAX_POS:])


@pytest.mark.parametrize("name", ["linear", "dynamic", "yarn_mscale", "llama3"])
def test_scaled_model_logits_match_transformers(name, tmp_path, runtime):
    hf = build_hf_model(tmp_path, "llama", max_position_embeddings=MAX_POS, rope_scaling=SCALINGS[name],
                        rope_theta=THETA)
    model = load_model(tmp_path, runtime=runtime, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = {i: torch.randint(3, 300, (n,), generator=g).tolist() for i, n in enumerate([6, 30, 60])}
    out = PagedKV(model).step(prompts)
    for i, tokens in prompts.items():
        assert max_relative_error(out[i], hf_logits(hf, tokens)) < 1e-4


def test_dynamic_model_decoding_past_max_positions(tmp_path, runtime):
    hf = build_hf_model(tmp_path, "llama", max_position_embeddings=16, rope_scaling=SCALINGS["dynamic"])
    model = load_model(tmp_path, runtime=runtime, dtype=torch.float32)
    assert model.max_positions == 27  # 16 x 1.7
    tokens = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    kv = PagedKV(model)
    ours = kv.step({0: tokens})[0][-1]
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), use_cache=True)
        cache = out.past_key_values
        for _ in range(12):  # positions 12..23, crossing max_position_embeddings=16
            assert max_relative_error(ours, out.logits[0, -1]) < 1e-4
            nxt = int(ours.argmax())
            ours = kv.step({0: [nxt]})[0][-1]
            out = hf(torch.tensor([[nxt]]), **{CACHE_ARG: cache}, use_cache=True)
            cache = out.past_key_values
