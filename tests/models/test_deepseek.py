"""DeepSeek-V2/V3: multi-head latent attention computes transformers' logits; its cache is the latent only.

The presets (``tests/models/hf_factory.py``) cover both query paths (one
projection, V2-Lite style; a low-rank pair with its norm, V3), DeepSeek's
interleaved rotary pairs and, here, the rotate-half layout, projection
biases, and yarn scaling whose ``mscale_all_dim`` changes the softmax scale.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from kunlun_infer.models import load_model, load_model_config
from kunlun_infer.ops.attention import MLAAttentionBackend
from kunlun_infer.ops.reference_mla import ReferenceMLABackend
from kunlun_infer.runtime import Runtime, compose_config
from tests.models.paged import PagedKV, hf_logits, max_relative_error

PROMPT_LENGTHS = [1, 4, 9, 23]


def prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randint(3, 300, (n,), generator=g).tolist() for i, n in enumerate(PROMPT_LENGTHS)}


def assert_matches_transformers(model, hf, block_size=4):
    kv = PagedKV(model, block_size=block_size)
    seqs = prompts()
    out = kv.step(seqs)
    for i, tokens in seqs.items():
        assert max_relative_error(out[i], hf_logits(hf, tokens)) < 1e-4, f"prompt of {len(tokens)} tokens"
    chosen = {i: [int(out[i][-1].argmax())] for i in seqs}
    out = kv.step(chosen)
    for i in seqs:
        assert max_relative_error(out[i], hf_logits(hf, seqs[i] + chosen[i])[-1:]) < 1e-4


@pytest.mark.parametrize("arch, overrides", [
    ("deepseek_v3", {"rope_interleave": False, "attention_bias": True}),  # rotate-half rotary, biased projections
    ("deepseek_v2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                      "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}}),
    ("deepseek_v3", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                                      "mscale": 0.707, "mscale_all_dim": 0.707}}),
], ids=["v3-rotate-half-bias", "v2-yarn-mscale", "v3-yarn-equal-mscale"])
def test_variants_match_transformers(arch, overrides, hf_folder, runtime):
    folder, hf = hf_folder(arch, **overrides)
    assert_matches_transformers(load_model(folder, runtime=runtime, dtype=torch.float32), hf)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_the_cache_holds_one_latent_and_rotary_key_per_token(arch, hf_folder, runtime):
    folder, hf = hf_folder(arch)
    model = load_model(folder, runtime=runtime, dtype=torch.float32)
    c = hf.config
    assert isinstance(model.attention, MLAAttentionBackend)
    per_token = (c.kv_lora_rank + c.qk_rope_head_dim) * 4  # float32
    tensors = model.attention.kv_cache_tensors(10, 16)
    assert sum(t.nbytes for t in tensors) == 10 * 16 * per_token
    # per-head K/V would take 2 × heads × (nope + rope) numbers per token: the latent is what saves memory
    assert per_token < 2 * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim) * 4


def test_bf16_logits_within_tolerance(hf_folder, runtime):
    folder, hf = hf_folder("deepseek_v3", dtype=torch.bfloat16)
    model = load_model(folder, runtime=runtime, dtype=torch.bfloat16)
    out = PagedKV(model, block_size=4).step(prompts())
    for i, tokens in prompts().items():
        assert max_relative_error(out[i], hf_logits(hf, tokens)) < 3e-2


def test_an_ops_plugin_without_an_mla_backend_runs_on_the_reference(hf_folder):
    folder, hf = hf_folder("deepseek_v2")
    with Runtime.from_config(compose_config(["platform=simchip"])) as runtime:
        model = load_model(folder, runtime=runtime, dtype=torch.float32)
        assert isinstance(model.attention, ReferenceMLABackend)
        assert_matches_transformers(model, hf)


def test_multi_token_prediction_layers_of_a_v3_checkpoint_are_skipped(hf_folder, tmp_path, runtime):
    folder, hf = hf_folder("deepseek_v3")
    for f in folder.iterdir():
        if f.is_file():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    n = hf.config.num_hidden_layers  # the MTP module comes after the last decoder layer, as in DeepSeek's releases
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(8, 8)
    tensors[f"model.layers.{n}.self_attn.kv_b_proj.weight"] = torch.zeros(8, 8)
    save_file(tensors, tmp_path / "model.safetensors")
    assert_matches_transformers(load_model(tmp_path, runtime=runtime, dtype=torch.float32), hf)


def test_config_reads_the_mla_sizes(hf_folder):
    folder, hf = hf_folder("deepseek_v3")
    config = load_model_config(folder)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["head_dim"] == hf.config.qk_rope_head_dim  # what transformers writes; a head is nope + rope
    assert config.head_dim == hf.config.qk_nope_head_dim + hf.config.qk_rope_head_dim
    assert (config.mla.q_lora_rank, config.mla.kv_lora_rank, config.mla.v_head_dim) == (24, 32, 12)
    assert config.mla.rope_interleave and config.moe.sparse_layers == (False, True)  # first_k_dense_replace=1
    moe = config.moe  # sigmoid, choice by score + bias among the 2 of 4 groups whose best two sum highest
    assert (moe.scoring, moe.correction_bias, moe.num_expert_group, moe.topk_group, moe.group_score) == (
        "sigmoid", True, 4, 2, "top2_sum")
    assert (moe.renormalize, moe.routed_scaling_factor, moe.shared_intermediate_size) == (True, 2.5, 24)
