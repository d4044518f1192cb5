"""config.json parsing: transformers' defaults and both rope layouts; clear errors for what is unsupported."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from kunlun_infer.errors import ConfigError, ModelLoadError
from kunlun_infer.models import SUPPORTED_ARCHITECTURES, load_model, load_model_config, resolve_dtype
from tests.models.hf_factory import build_hf_model, rope_parameters
from tests.models.paged import ReferenceRuntime

MODEL_TYPES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}
MINIMAL = {"vocab_size": 100, "hidden_size": 256, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 32}


def write_config(folder, generation=None, **fields):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


MODEL_TYPES = {"Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV2ForCausalLM": "deepseek_v2",
               "DeepseekV3ForCausalLM": "deepseek_v3"}  # the others: the class name's prefix, lower case


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_minimal_config_means_what_it_means_to_transformers(arch, tmp_path):
    model_type = MODEL_TYPES.get(arch, arch[:-len("ForCausalLM")].lower())
    extra = {"num_experts_per_tok": 2} if arch == "DeepseekV2ForCausalLM" else {}  # transformers' default: None
    write_config(tmp_path, architectures=[arch], model_type=model_type, **MINIMAL, **extra)
    ours = load_model_config(tmp_path)
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert ours.architecture == arch
    assert ours.num_key_value_heads == hf.num_key_value_heads
    if ours.mla is not None:  # transformers' head_dim is the rotary part; a head is nope + rope
        assert ours.head_dim == hf.qk_nope_head_dim + hf.qk_rope_head_dim
        assert (ours.mla.q_lora_rank, ours.mla.kv_lora_rank, ours.mla.v_head_dim) == (hf.q_lora_rank,
                                                                                        hf.kv_lora_rank, hf.v_head_dim)
        first_dense = hf.first_k_dense_replace
        assert ours.moe.sparse_layers == tuple(i >= first_dense for i in range(hf.num_hidden_layers))
        assert (ours.moe.num_experts, ours.moe.top_k) == (hf.n_routed_experts, hf.num_experts_per_tok)
    else:
        assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.rope_theta == rope_parameters(hf)["rope_theta"] and ours.rope_scaling is None
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_ids == (() if hf.eos_token_id is None else (hf.eos_token_id,))
    assert ours.sliding_window == getattr(hf, "sliding_window", None)
    assert ours.torch_dtype == torch.float32


def test_model_type_alone_names_the_architecture(tmp_path):
    write_config(tmp_path, model_type="qwen2", **MINIMAL, num_key_value_heads=2)
    config = load_model_config(tmp_path)
    assert config.architecture == "Qwen2ForCausalLM" and config.attention_bias and not config.attention_out_bias


def test_variant_flags(tmp_path):
    llama = load_model_config(write_config(tmp_path / "l", architectures=["LlamaForCausalLM"], attention_bias=True,
                                           mlp_bias=True, **MINIMAL))
    assert (llama.attention_bias, llama.attention_out_bias, llama.mlp_bias, llama.qk_norm) == (True, True, True, False)
    qwen3 = load_model_config(write_config(tmp_path / "q", architectures=["Qwen3ForCausalLM"], head_dim=24,
                                           num_key_value_heads=1, tie_word_embeddings=True, **MINIMAL))
    assert (qwen3.qk_norm, qwen3.attention_bias, qwen3.head_dim, qwen3.num_key_value_heads) == (True, False, 24, 1)
    assert qwen3.tie_word_embeddings


@pytest.mark.parametrize("layout", ["old", "new"])
def test_rope_settings_in_either_layout(layout, tmp_path):
    scaling = {"factor": 4.0, "original_max_position_embeddings": 1024}
    if layout == "old":
        fields = {"rope_theta": 1e6, "rope_scaling": {"type": "yarn", **scaling}}
    else:
        fields = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, **scaling}}
    write_config(tmp_path, architectures=["Qwen2ForCausalLM"], model_type="qwen2", max_position_embeddings=4096,
                 **fields, **MINIMAL)
    config = load_model_config(tmp_path)
    hf = rope_parameters(transformers.AutoConfig.from_pretrained(tmp_path))
    assert config.rope_theta == hf["rope_theta"] == 1e6
    assert config.rope_scaling == {"rope_type": "yarn", **scaling}
    assert hf["rope_type"] == "yarn" and hf["original_max_position_embeddings"] == 1024
    assert config.max_context_len == 4096


def test_llama3_original_length_defaults_like_transformers(tmp_path):
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4 refuses a llama3 rope_scaling without original_max_position_embeddings, so it "
                    "has no default to compare with")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    write_config(tmp_path, architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=8192,
                 rope_scaling=scaling, **MINIMAL)
    config = load_model_config(tmp_path)
    hf = rope_parameters(transformers.AutoConfig.from_pretrained(tmp_path))
    assert config.rope_scaling["original_max_position_embeddings"] == hf["original_max_position_embeddings"]
    assert config.max_context_len == 8192


def test_linear_and_dynamic_scale_the_usable_context(tmp_path):
    for rope_type in ("linear", "dynamic"):
        write_config(tmp_path / rope_type, architectures=["LlamaForCausalLM"], max_position_embeddings=2048,
                     rope_scaling={"rope_type": rope_type, "factor": 2.0}, **MINIMAL)
        assert load_model_config(tmp_path / rope_type).max_context_len == 4096


def test_dtype_under_either_key(tmp_path):
    assert load_model_config(write_config(tmp_path / "a", architectures=["LlamaForCausalLM"], dtype="bfloat16",
                                          **MINIMAL)).torch_dtype == torch.bfloat16
    config = load_model_config(write_config(tmp_path / "b", architectures=["LlamaForCausalLM"],
                                            torch_dtype="float16", **MINIMAL))
    assert config.torch_dtype == torch.float16
    assert resolve_dtype("auto", config) == torch.float16 and resolve_dtype("float32", config) == torch.float32
    with pytest.raises(ConfigError, match="model.dtype"):
        resolve_dtype("float64", config)


def test_generation_config_eos_merged_with_config(tmp_path):
    write_config(tmp_path, generation={"eos_token_id": [7, 9], "bos_token_id": 5},
                 architectures=["LlamaForCausalLM"], eos_token_id=9, bos_token_id=1, **MINIMAL)
    config = load_model_config(tmp_path)
    assert config.eos_token_ids == (7, 9) and config.bos_token_id == 5
    write_config(tmp_path, generation={"eos_token_id": 3}, architectures=["LlamaForCausalLM"],
                 eos_token_id=[4, 3], **MINIMAL)
    assert load_model_config(tmp_path).eos_token_ids == (3, 4)


def test_sliding_window_caps_the_context(tmp_path):
    hf_dir = tmp_path / "m"
    build_hf_model(hf_dir, "mistral", sliding_window=32, max_position_embeddings=128, tokenizer=False)
    config = load_model_config(hf_dir)
    assert config.sliding_window == 32 and config.max_context_len == 32
    model = load_model(hf_dir, runtime=ReferenceRuntime(), dtype=torch.float32)
    assert model.max_positions == 32
    with pytest.raises(ModelLoadError, match="sliding_window=32"):
        load_model(hf_dir, runtime=ReferenceRuntime(), dtype=torch.float32, max_model_len=64)
    qwen = load_model_config(write_config(tmp_path / "q", architectures=["Qwen2ForCausalLM"], sliding_window=16,
                                          use_sliding_window=False, max_position_embeddings=64, **MINIMAL))
    assert qwen.sliding_window is None and qwen.max_context_len == 64


@pytest.mark.parametrize("fields, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel is not supported; supported: LlamaForCausalLM"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_size": None}, "hidden_size"),
    ({"architectures": ["LlamaForCausalLM"], "vocab_size": "many"}, "'vocab_size' has bad value"),
    ({"architectures": ["LlamaForCausalLM"], "num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
     "'longrope' is not supported; supported: default, linear, dynamic, yarn, llama3"),
    ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "llama3", "factor": 2.0}},
     "needs field.*low_freq_factor"),
    ({"architectures": ["LlamaForCausalLM"], "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"architectures": ["LlamaForCausalLM"], "dtype": "float8_e4m3fn"}, "dtype 'float8_e4m3fn' is not supported"),
    ({"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "gptq"}}, "quantized"),
    ({"architectures": ["DeepseekV2ForCausalLM"]}, "required field 'num_experts_per_tok' is missing"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "scoring_func": "softmax"}, "scoring_func='softmax' is not what"),
    ({"architectures": ["DeepseekV2ForCausalLM"], "num_experts_per_tok": 2, "topk_method": "noaux_tc"},
     "topk_method='noaux_tc' is not supported for DeepseekV2ForCausalLM; supported: greedy, group_limited_greedy"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "n_group": 6}, "must form n_group equal groups"),
])
def test_bad_configs_are_refused_with_the_reason(fields, message, tmp_path):
    raw = {**MINIMAL, **fields}
    write_config(tmp_path, **{k: v for k, v in raw.items() if v is not None})
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model_config(tmp_path)
    assert "config.json" in str(info.value)


def test_missing_or_broken_files(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_config(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="config.json not found"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json is not readable JSON"):
        load_model_config(tmp_path)
