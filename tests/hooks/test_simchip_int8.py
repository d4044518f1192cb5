"""A plugin written for hook API 1.1 (the simulated chip, which has no int8 ops) serves an int8 model.

``pack_int8_linear_weight`` and ``int8_linear`` arrived in 1.3; an ops
plugin written before lacks them, so the runtime serves them by the
references (logged), and the run equals the reference ops' own int8 run
token for token.
"""

import logging

from tests.hooks.conftest import MAX_TOKENS, SIMCHIP, overrides, require_package

require_package("kunlun_infer_simchip", "kunlun-infer-simchip")

from kunlun_infer import LLM, SamplingParams  # noqa: E402
from kunlun_infer.hookspecs import HOOK_API_VERSION  # noqa: E402

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


def test_a_1_1_ops_plugin_runs_an_int8_model_on_the_references(llama_dir, prompts, caplog):
    assert HOOK_API_VERSION >= (1, 3)
    with LLM(model=str(llama_dir), overrides=overrides("ops=torch", "model.quantization=int8")) as llm:
        want = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with caplog.at_level(logging.WARNING, logger="kunlun_infer.runtime"):
        with LLM(model=str(llama_dir), overrides=overrides(*SIMCHIP, "device.capacity=256MiB",
                                                           "model.quantization=int8")) as llm:
            assert llm.engine.runtime.plugin_for("ops") == "simchip"
            assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert "int8_linear" in caplog.text and "pack_int8_linear_weight" in caplog.text
