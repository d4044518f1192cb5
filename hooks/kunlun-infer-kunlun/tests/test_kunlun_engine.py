"""The engine on ``ops=kunlun`` (CPU device, stand-in ``kunlun_ops``) token for token with transformers."""

import logging
import sys

from kunlun_infer import LLM, SamplingParams

from kunlun_infer_kunlun.ops import VENDOR_OPS

ENGINE = ["device=cpu", "ops=kunlun", "model.max_model_len=256", "scheduler.max_num_seqs=8",
          "scheduler.max_num_batched_tokens=128", "cache.block_size=16", "cache.num_blocks=48"]


def generate(model, *extra):
    with LLM(model=str(model.folder), overrides=[*ENGINE, *extra]) as llm:
        assert llm.engine.runtime.plugin_for("ops") == "kunlun"
        params = SamplingParams(max_tokens=model.max_tokens, temperature=0)
        return [o.token_ids for o in llm.generate(model.prompts, params, use_tqdm=False)]


def test_vendor_kernels_run_the_model_token_for_token(standin, tiny_model, caplog):
    with caplog.at_level(logging.WARNING, logger="kunlun_infer"):
        assert generate(tiny_model) == tiny_model.references
    assert all(standin.calls[f] > 0 for functions in VENDOR_OPS.values() for f in functions)
    assert "plain-torch reference" not in caplog.text  # every vendor op was served by its kernel


def test_without_the_library_the_run_is_correct_and_says_once_what_fell_back(monkeypatch, tiny_model, caplog):
    monkeypatch.setitem(sys.modules, "kunlun_ops", None)
    with caplog.at_level(logging.WARNING, logger="kunlun_infer"):
        assert generate(tiny_model) == tiny_model.references
    assert caplog.text.count("using the plain-torch reference") == 1
    assert "add_rms_norm, rms_norm, rotary_embedding, silu_and_mul" in caplog.text
