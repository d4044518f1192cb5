"""A plugin written for hook API 1.1 (the simulated chip) runs unchanged under 1.7, whose engine overlaps steps.

Its streams plugin has no ``asynchronous`` (added in 1.7): with
``scheduler.overlap_steps=auto``, the default, every step runs as before;
asked for overlap (``on``), its decode steps go out behind the one in flight
through its own streams' events, and the tokens are transformers' greedy
ones either way.
"""

from tests.hooks.conftest import MAX_TOKENS, SIMCHIP, overrides, require_package

require_package("kunlun_infer_simchip", "kunlun-infer-simchip")

from kunlun_infer import LLM, SamplingParams  # noqa: E402
from kunlun_infer.hookspecs import HOOK_API_VERSION  # noqa: E402
from kunlun_infer.runtime.guard import unwrap  # noqa: E402

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


def test_a_1_1_streams_plugin_runs_steps_as_before_unless_overlap_is_asked_for(llama_dir, prompts, references):
    assert HOOK_API_VERSION >= (1, 7)
    with LLM(model=str(llama_dir), overrides=overrides(*SIMCHIP)) as llm:
        streams = unwrap(llm.engine.runtime.streams)
        assert llm.engine.runtime.plugin_for("streams") == "simchip"
        assert "asynchronous" not in vars(type(streams))  # written before 1.7: the contract's default
        assert llm.engine.overlap is False
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == references
    with LLM(model=str(llama_dir), overrides=overrides(*SIMCHIP, "scheduler.overlap_steps=on")) as llm:
        launched = []
        launch = llm.engine.runner.launch
        llm.engine.runner.launch = lambda *args: launched.append(args[2] is not None) or launch(*args)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == references
        assert sum(launched) >= MAX_TOKENS - 3  # decode steps went out behind the one in flight
