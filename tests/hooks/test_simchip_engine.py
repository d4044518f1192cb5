"""The engine on the simulated chip: token-for-token with transformers, clear out-of-memory, strict ops, mixing."""

import logging

import pytest

from tests.hooks.conftest import MAX_TOKENS, SIMCHIP, overrides, require_package

require_package("kunlun_infer_simchip", "kunlun-infer-simchip")

from kunlun_infer import LLM, ConfigError, DeviceOutOfMemoryError, OpsCoverageError, SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


def generate(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_simchip_run_matches_transformers_token_for_token(llama_dir, prompts, references, caplog):
    with caplog.at_level(logging.INFO, logger="kunlun_infer.runtime"):
        with LLM(model=str(llama_dir), overrides=overrides(*SIMCHIP, "device.capacity=256MiB")) as llm:
            assert generate(llm, prompts) == references
            runtime = llm.engine.runtime
            assert {c: runtime.plugin_for(c) for c in ("device", "memory", "ops", "streams")} == dict.fromkeys(
                ("device", "memory", "ops", "streams"), "simchip")
            # the KV cache lives in the arena: allocated in whole 2 MiB granules, visible in mem_get_info
            stats = runtime.memory.stats()
            free, total = runtime.device.mem_get_info()
            assert stats.allocated > 0 and stats.allocated % (2 * 2**20) == 0
            assert total == 256 * 2**20 and free <= total - stats.allocated
            assert llm.engine.stats()["kv_blocks_free"] == llm.engine.stats()["kv_blocks_total"]
            # attention ran on the chip's own backend: one Kunlun-layout cache tensor per layer
            runner = llm.engine.runner
            assert runner.attention.name == "simchip-kunlun-layout"
            blocks = llm.engine.stats()["kv_blocks_total"]
            assert [tuple(t.shape) for layer in runner.kv_caches for t in layer] == [(2, blocks, 2, 16, 16)] * 2
            assert "paged_attention" not in runner.model.ctx.ops
    # the chip lacks rotary_embedding: the run fell back to the reference and said so
    assert "lacks 1 op(s)" in caplog.text and "rotary_embedding" in caplog.text
    assert "serves attention with its backend 'simchip-kunlun-layout'" in caplog.text


def test_exhausting_the_arena_gives_a_clear_out_of_memory_error(llama_dir):
    # 4000 blocks x 4 KiB per layer (keys and values in one tensor) do not fit an 8 MiB chip
    with pytest.raises(DeviceOutOfMemoryError) as info:
        LLM(model=str(llama_dir), overrides=overrides(*SIMCHIP, "device.capacity=8MiB", "cache.num_blocks=4000"))
    err = info.value
    assert err.capacity == 8 * 2**20 and err.requested > err.free
    text = str(err)
    assert "simchip out of memory" in text and f"capacity 8.0 MiB ({8 * 2**20} bytes)" in text
    assert "device.capacity" in text


def test_a_chip_too_small_for_any_kv_cache_is_refused_with_numbers(llama_dir):
    with pytest.raises(DeviceOutOfMemoryError) as info:
        LLM(model=str(llama_dir), overrides=overrides(*SIMCHIP, "device.capacity=2MiB"))
    assert info.value.requested > 0 and info.value.free is not None and info.value.free < info.value.requested


def test_strict_ops_refuse_the_partial_op_set_listing_what_is_missing(llama_dir):
    with pytest.raises(OpsCoverageError) as info:
        LLM(model=str(llama_dir), overrides=overrides(*SIMCHIP, "ops.strict=true"))
    assert info.value.missing == ["rotary_embedding"]  # its attention backend needs no paged_attention op
    assert "ops.strict" in str(info.value)


def test_mixing_distributions_simchip_device_with_builtin_memory_and_ops(llama_dir, prompts, references):
    with LLM(model=str(llama_dir), overrides=overrides("device=simchip", "memory=caching", "ops=torch",
                                                       "device.capacity=64MiB")) as llm:
        assert generate(llm, prompts) == references
        runtime = llm.engine.runtime
        assert runtime.plugin_for("device") == "simchip"
        assert runtime.plugin_for("memory") != "simchip" and runtime.plugin_for("ops") != "simchip"


def test_bfloat16_on_simchip_runs_and_float16_is_refused(llama_dir, prompts):
    with LLM(model=str(llama_dir), overrides=overrides(*SIMCHIP, "model.dtype=bfloat16")) as llm:
        out = generate(llm, prompts[:2])
        assert all(len(tokens) == MAX_TOKENS for tokens in out)
    with pytest.raises(ConfigError, match="model.dtype=float16 is not supported by device 'simchip'"):
        LLM(model=str(llama_dir), overrides=overrides(*SIMCHIP, "model.dtype=float16"))


def test_three_distributions_in_one_run_simchip_chip_with_the_cuda_plugins_sdpa_ops(llama_dir, prompts, references):
    require_package("kunlun_infer_cuda", "kunlun-infer-cuda")
    # the cuda plugin's kernels name no device, so its SDPA paged attention runs on simchip's tensors
    with LLM(model=str(llama_dir), overrides=overrides("device=simchip", "memory=simchip", "streams=simchip",
                                                       "ops=cuda", "device.capacity=64MiB")) as llm:
        assert generate(llm, prompts) == references
        runtime = llm.engine.runtime
        assert (runtime.plugin_for("device"), runtime.plugin_for("ops")) == ("simchip", "cuda")
