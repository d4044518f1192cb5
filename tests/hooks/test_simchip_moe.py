"""A plugin written for hook API 1.1 (the simulated chip, which has no mixture-of-experts ops) serves a
mixture-of-experts model.

``moe_route``, ``pack_moe_weights`` and ``fused_moe`` arrived in 1.4; an ops plugin written before lacks
them, so the runtime serves them by the references (logged, shown by ``kunlun-infer plugins``), and the run
equals the built-in CPU ops' run token for token.
"""

import logging

import pytest

from tests.hooks.conftest import MAX_TOKENS, SIMCHIP, overrides, require_package
from tests.engine.tiny_models import build_tiny_model

require_package("kunlun_infer_simchip", "kunlun-infer-simchip")

from kunlun_infer import LLM, SamplingParams  # noqa: E402
from kunlun_infer.hookspecs import HOOK_API_VERSION  # noqa: E402
from kunlun_infer.layers.moe import MOE_OPS  # noqa: E402

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("hooks-mixtral"), "mixtral")


def test_a_1_1_ops_plugin_runs_a_mixture_of_experts_model_on_the_references(mixtral_dir, prompts, caplog):
    assert HOOK_API_VERSION >= (1, 4)
    with LLM(model=str(mixtral_dir), overrides=overrides()) as llm:
        assert llm.engine.runtime.plugin_for("ops") == "torch-ops"
        want = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with caplog.at_level(logging.WARNING, logger="kunlun_infer.runtime"):
        with LLM(model=str(mixtral_dir), overrides=overrides(*SIMCHIP, "device.capacity=256MiB")) as llm:
            assert llm.engine.runtime.plugin_for("ops") == "simchip"
            assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert all(op in caplog.text for op in MOE_OPS)
