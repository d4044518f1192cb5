"""``kunlun-infer plan``: the figures follow the memory formula, and the engine allocates what the plan says."""

from __future__ import annotations

import json

import pytest

from tests.tools.fixed_memory_plugin import CAPACITY

GIB = 2**30
#: Llama-2-7B's config.json fields that size it (its published parameter count is 6,738,415,616)
LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "torch_dtype": "float16"}


@pytest.fixture
def llama_7b_config(tmp_path):
    """A model folder holding only config.json: the plan must not need weights."""
    folder = tmp_path / "llama-7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_7B))
    return folder


def test_plan_for_a_card_you_do_not_have_follows_the_formula(cli, llama_7b_config):
    result = cli("plan", f"model.path={llama_7b_config}", "--device-memory", "80GiB", "--json")
    assert result.code == 0, result.err
    plan = result.json()
    layers, kv_heads, head_dim, fp16 = 32, 32, 128, 2
    assert plan["num_params"] == 6_738_415_616
    assert plan["weights"] == 6_738_415_616 * fp16
    assert plan["kv"]["bytes_per_token"] == 2 * layers * kv_heads * head_dim * fp16
    assert plan["kv"]["bytes_per_block"] == 16 * plan["kv"]["bytes_per_token"]
    usable = int(0.9 * 80 * GIB)
    assert plan["reserve"] == 80 * GIB - usable
    assert plan["activation_source"] == "estimated" and plan["activations"] > 0
    by_memory = (usable - plan["weights"] - plan["activations"] - plan["comm_buffers"]) // plan["kv"]["bytes_per_block"]
    assert plan["blocks_by_memory"] == by_memory
    blocks_per_seq = 4096 // 16
    assert plan["num_blocks"] == min(by_memory, 16 * blocks_per_seq)  # capped by scheduler.max_num_seqs=16
    assert plan["max_concurrency"] == by_memory // blocks_per_seq


def test_plan_per_tensor_parallel_rank(cli, llama_7b_config):
    result = cli("plan", f"model.path={llama_7b_config}", "device_memory=80GiB", "parallel.tensor_size=2",
                 "scheduler.max_num_seqs=256", "--json")
    assert result.code == 0, result.err
    plan = result.json()
    norms = 32 * 2 * 4096 + 4096  # RMSNorm weights are replicated on every rank
    assert plan["params_per_rank"] == (6_738_415_616 - norms) // 2 + norms
    assert plan["kv"]["num_kv_heads_per_rank"] == 16
    assert plan["kv"]["bytes_per_token"] == 2 * 32 * 16 * 128 * 2
    tp1 = cli("plan", f"model.path={llama_7b_config}", "device_memory=80GiB", "scheduler.max_num_seqs=256",
              "--json").json()
    assert plan["max_concurrency"] > 2 * tp1["max_concurrency"]  # half the weights and half the KV per rank


def test_plan_compares_tensor_sizes_in_text(cli, llama_7b_config):
    result = cli("plan", f"model.path={llama_7b_config}", "--device-memory=24GiB", "tensor_sizes=1,2,4")
    assert result.code == 0, result.err
    assert "KV per token: 2 × 32 layers × 32 KV heads × 128 head dim × 2 B = 512.00 KiB" in result.out
    assert "concurrency at model.max_model_len=4096:" in result.out
    rows = [line.split() for line in result.out.splitlines() if line.strip()[:1] in ("1", "2", "4")
            and "GiB" in line]
    assert [row[0] for row in rows] == ["1", "2", "4"]


def test_plan_says_when_nothing_fits(cli, llama_7b_config):
    result = cli("plan", f"model.path={llama_7b_config}", "device_memory=8GiB")
    assert result.code == 1
    assert "none fit" in result.out


def test_plan_refuses_a_malformed_device_memory(cli, llama_7b_config):
    result = cli("plan", f"model.path={llama_7b_config}", "device_memory=lots")
    assert result.code == 2
    assert "device_memory='lots' is not a size" in result.err


def test_engine_allocates_the_planned_kv_blocks(cli, tiny_model):
    import tests.tools.fixed_memory_plugin as module
    from kunlun_infer.engine.engine import LLMEngine
    from kunlun_infer.runtime import PluginManager, Runtime, compose_config

    overrides = ["device=fixedmem", f"model.path={tiny_model}", "model.max_model_len=512",
                 "scheduler.max_num_seqs=256", "scheduler.max_num_batched_tokens=64"]
    result = cli("plan", "register=tests.tools.fixed_memory_plugin", *overrides, "--json")
    assert result.code == 0, result.err
    plan = result.json()
    assert plan["device_memory"] == CAPACITY and plan["activation_source"] == "measured"
    assert plan["blocks_by_memory"] < plan["blocks_by_concurrency"]  # memory, not concurrency, decides

    manager = PluginManager.load()
    manager.register(module)
    cfg = compose_config(overrides, plugin_manager=manager)
    with Runtime.from_config(cfg, plugin_manager=manager) as runtime:
        engine = LLMEngine(cfg, runtime=runtime)
        try:
            allocated = engine.stats()["kv_blocks_total"]
            assert engine.runner.model.weight_nbytes() == plan["weights"]
        finally:
            engine.close()
    assert abs(allocated - plan["num_blocks"]) <= 0.01 * plan["num_blocks"]


def test_plan_and_engine_agree_on_kv_bytes_of_a_backend_with_its_own_layout(cli, tiny_model):
    import tests.tools.fixed_memory_plugin as fixed
    import tests.tools.padded_attention_plugin as padded
    from kunlun_infer.engine.engine import LLMEngine
    from kunlun_infer.runtime import PluginManager, Runtime, compose_config

    overrides = ["device=fixedmem", "ops=padded", f"model.path={tiny_model}", "model.max_model_len=512",
                 "scheduler.max_num_seqs=256", "scheduler.max_num_batched_tokens=64"]
    register = ["register=tests.tools.fixed_memory_plugin", "register=tests.tools.padded_attention_plugin"]
    plan = cli("plan", *register, *overrides, "--json").json()
    kv = plan["kv"]
    padded_bytes = 2 * 16 * 2 * (16 + padded.PAD) * 4  # K and V, 16 tokens, 2 KV heads, padded head, float32
    assert kv["attention_backend"] == "padded" and kv["bytes_per_block"] == 2 * padded_bytes  # 2 layers
    assert kv["layer_tensors"] == [{"name": "kv", "shape": [plan["num_blocks"], 2, 16, 2, 16 + padded.PAD],
                                    "dtype": "float32"}]
    text = cli("plan", *register, *overrides).out
    assert "layout of attention backend 'padded', per layer: kv" in text

    manager = PluginManager.load()
    manager.register(fixed)
    manager.register(padded)
    cfg = compose_config(overrides, plugin_manager=manager)
    with Runtime.from_config(cfg, plugin_manager=manager) as runtime:
        engine = LLMEngine(cfg, runtime=runtime)
        try:
            blocks = engine.stats()["kv_blocks_total"]
            allocated = sum(t.numel() * t.element_size() for layer in engine.runner.kv_caches for t in layer)
        finally:
            engine.close()
    assert allocated == blocks * kv["bytes_per_block"]
    assert abs(blocks - plan["num_blocks"]) <= 0.01 * plan["num_blocks"]


def test_plan_for_a_card_you_do_not_have_asks_its_ops_plugin_for_the_layout(cli, llama_7b_config):
    result = cli("plan", "register=tests.tools.padded_attention_plugin", "ops=padded",
                 "register=tests.tools.unreachable_device_plugin", "device=unreachable",
                 f"model.path={llama_7b_config}", "--device-memory", "80GiB", "--json")
    assert result.code == 0, result.err
    assert "device 'unreachable' not available" in result.err  # planned without a runtime
    kv = result.json()["kv"]
    assert kv["attention_backend"] == "padded"
    assert kv["bytes_per_block"] == 32 * 2 * 16 * 32 * (128 + 8) * 2  # layers × K,V × tokens × heads × dim × fp16


#: DeepSeek-V2-Lite's config.json fields that size it (published: 15.7 B parameters)
DEEPSEEK_V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
                    "hidden_size": 2048, "intermediate_size": 10944, "num_hidden_layers": 27,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "max_position_embeddings": 163840, "first_k_dense_replace": 1, "n_routed_experts": 64,
                    "n_shared_experts": 2, "moe_intermediate_size": 1408, "num_experts_per_tok": 6,
                    "topk_method": "greedy", "torch_dtype": "bfloat16",
                    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}}


def test_plan_sizes_the_latent_cache_of_multi_head_latent_attention(cli, tmp_path):
    folder = tmp_path / "deepseek-v2-lite"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(DEEPSEEK_V2_LITE))
    result = cli("plan", f"model.path={folder}", "device_memory=80GiB", "model.max_model_len=4096", "--json")
    assert result.code == 0, result.err
    plan = result.json()
    assert plan["num_params"] == 15_706_484_224
    kv = plan["kv"]
    layers, latent, rope, bf16 = 27, 512, 64, 2
    assert kv["kind"] == "mla" and kv["attention_backend"] == "torch-mla"
    assert kv["bytes_per_token"] == layers * (latent + rope) * bf16  # not 2 × 16 heads × 192 × 2 B per layer
    assert kv["layer_tensors"][0]["shape"][-1] == latent + rope
    two_ranks = cli("plan", f"model.path={folder}", "device_memory=80GiB", "model.max_model_len=4096",
                    "parallel.tensor_size=2", "--json").json()["kv"]
    assert two_ranks["bytes_per_token"] == kv["bytes_per_token"]  # every rank caches the whole latent
    text = cli("plan", f"model.path={folder}", "device_memory=80GiB", "model.max_model_len=4096").out
    assert "multi-head latent attention" in text and "512 latent + 64 rotary key" in text


#: Qwen3-30B-A3B's config.json fields that size it: 48 layers of 128 experts (8 routed per token)
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("expert_size", [1, 2])
def test_plan_sizes_expert_weights_per_rank(cli, tmp_path, expert_size):
    folder = tmp_path / "qwen3-30b-a3b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    hidden, layers, vocab = 2048, 48, 151936
    attention = hidden * (32 * 128) * 2 + hidden * (4 * 128) * 2
    experts = 128 * 3 * hidden * 768
    replicated = 2 * 128 + 2 * hidden + 128 * hidden  # q/k norms, layer norms, router
    whole = cli("plan", f"model.path={folder}", "device_memory=80GiB", "--json").json()
    assert whole["num_params"] == 2 * vocab * hidden + layers * (attention + experts + replicated) + hidden
    assert whole["num_params"] == 30_532_122_624  # Qwen3-30B-A3B's published size
    two = cli("plan", f"model.path={folder}", "device_memory=80GiB", "parallel.tensor_size=2",
              f"parallel.expert_size={expert_size}", "--json")
    assert two.code == 0, two.err
    # expert_size=1: every expert's half; expert_size=2: half the experts, whole — the same bytes per rank
    assert two.json()["params_per_rank"] == vocab * hidden + layers * (attention // 2 + experts // 2 + replicated) \
        + hidden
