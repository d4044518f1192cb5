"""A plugin written for hook API 1.1 (the simulated chip) decodes greedily under 1.8, which added
``greedy_tokens`` to the op table.

Its ops plugin has no ``greedy_tokens``: the engine's sampler takes the
reference's argmax and says so at info level rather than warning, and the
tokens are transformers' greedy ones (``ops.strict`` does not refuse such a
plugin: ``tests/runtime/test_optable.py``). The built-in ``cpu`` ops answer
with their native pass where the machine has one.
"""

import logging

from tests.hooks.conftest import MAX_TOKENS, SIMCHIP, overrides, require_package

require_package("kunlun_infer_simchip", "kunlun-infer-simchip")

from kunlun_infer import LLM, SamplingParams  # noqa: E402
from kunlun_infer.hookspecs import HOOK_API_VERSION  # noqa: E402
from kunlun_infer.plugins import cpu_kernels, cpu_native  # noqa: E402
from kunlun_infer.runtime.guard import unwrap  # noqa: E402

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


def test_a_1_1_ops_plugin_decodes_greedily_on_the_reference(llama_dir, prompts, references, caplog):
    assert HOOK_API_VERSION >= (1, 8)
    with caplog.at_level(logging.INFO, logger="kunlun_infer.runtime"):
        with LLM(model=str(llama_dir), overrides=overrides(*SIMCHIP)) as llm:
            assert llm.engine.runtime.plugin_for("ops") == "simchip"
            assert not unwrap(llm.engine.runtime.ops).supports("greedy_tokens")  # written before 1.8
            assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == references
    said = [r for r in caplog.records if "greedy_tokens" in r.getMessage()]
    assert said and all(r.levelno == logging.INFO for r in said)
    assert "has no greedy_tokens, sample_tokens: the plain-torch reference serves" in said[0].getMessage()


def test_the_cpu_ops_decode_greedily_through_their_own_pass(llama_dir, prompts, references, monkeypatch):
    calls = []
    native = cpu_kernels.greedy_tokens
    monkeypatch.setattr(cpu_kernels, "greedy_tokens", lambda logits: calls.append(logits.shape) or native(logits))
    with LLM(model=str(llama_dir), overrides=overrides("ops=cpu")) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == references
    assert calls and all(len(shape) == 2 for shape in calls)
    assert cpu_native.library() is None or any(shape[0] > 1 for shape in calls)  # several rows a call
