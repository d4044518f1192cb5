"""The engine on ``ops=kunlun`` (CPU device, stand-in ``kunlun_ops``) token for token with transformers.

With the stand-in installed the run uses every vendor call: the norms,
SwiGLU and rotary kernels, the expert routing and pipeline (Qwen3-MoE), and the Kunlun attention backend (head-major
cache, decodes first, ``reshape_and_cache_flash``, ``speculative_attention``
and ``prefill_attention`` in both its modes) — under chunked prefill, prefix
caching, preemption, ``n`` samples and two tensor-parallel ranks. Without the library the same run is just as correct,
on the torch path, and says once what fell back.
"""

import logging
import os
import sys
from pathlib import Path

import pytest

import kunlun_ops_standin
from kunlun_infer import LLM, SamplingParams

from kunlun_infer.layers.moe import MOE_OPS
from kunlun_infer_kunlun.ops import VENDOR_OPS

ENGINE = ["device=cpu", "ops=kunlun", "model.max_model_len=256", "scheduler.max_num_seqs=8",
          "scheduler.max_num_batched_tokens=128", "cache.block_size=16", "cache.num_blocks=48"]
SCHEDULES = {
    "batched": [],
    "chunked prefill": ["scheduler.max_num_batched_tokens=24"],
    "preemption": ["cache.num_blocks=8"],  # the longest request needs 4 blocks, the batch about 12
}
ATTENTION_CALLS = ("reshape_and_cache_flash", "speculative_attention", "prefill_attention")


def generate(model, *extra, batches=None):
    """Greedy tokens of each batch of prompts (default: the model's prompts) in turn, and the engine's stats."""
    with LLM(model=str(model.folder), overrides=[*ENGINE, *extra]) as llm:
        assert llm.engine.runtime.plugin_for("ops") == "kunlun"
        params = SamplingParams(max_tokens=model.max_tokens, temperature=0)
        tokens = [o.token_ids for prompts in batches or [model.prompts]
                  for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # nothing leaked
        return tokens, stats


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_vendor_kernels_run_the_model_token_for_token(standin, tiny_model, schedule, caplog):
    with caplog.at_level(logging.WARNING, logger="kunlun_infer"):
        tokens, stats = generate(tiny_model, *SCHEDULES[schedule])
    assert tokens == tiny_model.references
    dense = [f for op, functions in VENDOR_OPS.items() if op not in MOE_OPS for f in functions]
    assert all(standin.calls[f] > 0 for f in dense)
    if tiny_model.experts:  # routing renormalised, then the whole expert pipeline
        assert all(standin.calls[f] > 0 for f in ("moe_softmax_topk_norm", *VENDOR_OPS["fused_moe"]))
    assert all(standin.calls[f] > 0 for f in ATTENTION_CALLS)
    assert "plain-torch reference" not in caplog.text and "torch path" not in caplog.text
    if schedule == "chunked prefill":  # later chunks read the earlier ones from the cache
        assert standin.calls["prefill_attention:prefix_cache"] > 0
    if schedule == "preemption":
        assert stats["num_preemptions"] > 0


def test_a_prefix_cache_hit_reads_the_cached_blocks_through_the_prefix_mode(standin, tiny_model):
    longest = max(tiny_model.prompts, key=len)
    expected = tiny_model.references[tiny_model.prompts.index(longest)]
    tokens, stats = generate(tiny_model, batches=[[longest], [longest + [7], longest]])
    assert tokens[0] == tokens[2] == expected
    assert stats["prefix_cache_hit_tokens"] > 0 and standin.calls["prefill_attention:prefix_cache"] > 0


def test_samples_sharing_a_prompt_each_give_the_greedy_continuation(standin, tiny_model):
    longest = max(tiny_model.prompts, key=len)
    expected = tiny_model.references[tiny_model.prompts.index(longest)]
    with LLM(model=str(tiny_model.folder), overrides=ENGINE) as llm:
        params = SamplingParams(n=3, max_tokens=tiny_model.max_tokens, temperature=0)
        outs = llm.generate([longest], params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [expected] * 3
    assert standin.calls["speculative_attention"] > 0


def test_without_the_library_the_run_is_correct_and_says_once_what_fell_back(monkeypatch, tiny_model, caplog):
    monkeypatch.setitem(sys.modules, "kunlun_ops", None)
    with caplog.at_level(logging.WARNING, logger="kunlun_infer"):
        tokens, _ = generate(tiny_model)
    assert tokens == tiny_model.references
    assert caplog.text.count("using the plain-torch reference") == 1
    fallen = "fused_moe, moe_route, pack_moe_weights, " if tiny_model.experts else ""
    assert f"add_rms_norm, {fallen}rms_norm, rotary_embedding, silu_and_mul" in caplog.text


def test_two_ranks_on_the_vendor_kernels_match_transformers(standin, tiny_model, tmp_path, monkeypatch):
    # rank 1 is a process of its own: it imports the stand-in as kunlun_ops from a folder on its path
    (tmp_path / "kunlun_ops.py").write_text(
        "import os, pathlib\n"
        "from kunlun_ops_standin import *  # noqa: F403\n"
        f"pathlib.Path({str(tmp_path)!r}, f'imported-by-{{os.getpid()}}').touch()\n")
    path = [str(tmp_path), str(Path(kunlun_ops_standin.__file__).parent), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))
    tokens, _ = generate(tiny_model, "parallel.tensor_size=2")
    assert tokens == tiny_model.references
    assert [p.name for p in tmp_path.glob("imported-by-*")] != []  # rank 1 found the stand-in
    assert standin.calls["speculative_attention"] > 0  # and rank 0 (this process) ran its kernels
