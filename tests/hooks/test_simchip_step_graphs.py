"""A plugin written for hook API 1.1 (the simulated chip) runs unchanged under 1.5, whose engine captures steps.

Its ops provider has no ``capture`` of its own and its attention backend no
``update_metadata`` (both added in 1.5): with ``ops.step_graphs`` on, as by
default, every decode step runs eagerly, and the tokens are transformers'
greedy ones, as the built-in ``cpu`` ops' are while they replay captured steps.
"""

from tests.hooks.conftest import MAX_TOKENS, SIMCHIP, overrides, require_package

require_package("kunlun_infer_simchip", "kunlun-infer-simchip")

from kunlun_infer import LLM, SamplingParams  # noqa: E402
from kunlun_infer.hookspecs import HOOK_API_VERSION  # noqa: E402

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


def test_a_1_1_plugin_runs_every_step_eagerly_under_step_graphs(llama_dir, prompts, references):
    assert HOOK_API_VERSION >= (1, 5)
    with LLM(model=str(llama_dir), overrides=overrides(*SIMCHIP)) as llm:
        assert llm.engine.runtime.plugin_for("ops") == "simchip"
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == references
        graphs = llm.engine.runner.graphs
        assert graphs.replays == 0 and graphs.batch_sizes == []
        # its backend (1.1) cannot update metadata in place: nothing is captured, every step runs eagerly
        assert graphs.refused and set(graphs.refused.values()) == {
            "attention backend 'simchip-kunlun-layout' cannot update its metadata in place"}
    with LLM(model=str(llama_dir), overrides=overrides()) as llm:  # the built-in cpu ops replay the same steps
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == references
        assert llm.engine.runner.graphs.replays > 0
