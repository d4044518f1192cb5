"""The logits-processor hook (API 1.2): a plugin's processor serves structured output; 1.0 plugins run on."""

import pytest
import torch

from kunlun_infer import SamplingParams
from kunlun_infer.capabilities import ConstraintState, LogitsProcessor
from kunlun_infer.engine.engine import LLMEngine
from kunlun_infer.errors import EngineStepError, PluginError
from kunlun_infer.hookspecs import HOOK_API_VERSION, PluginInfo, hookimpl
from kunlun_infer.runtime import PluginManager, Runtime, compose_config
from tests.engine.tiny_models import EOS_ID, engine_overrides


class EvenState(ConstraintState):
    def __init__(self, log):
        self.log = log

    def accept(self, token_id):
        self.log.append(token_id)
        return token_id % 2 == 0 or token_id == EOS_ID

    def rollback(self, num_tokens):
        del self.log[len(self.log) - num_tokens:]


class EvenTokens(LogitsProcessor):
    """Allows only even token ids (and EOS); ``choice`` says how many tokens before EOS is forced."""

    name = "evens"

    def __init__(self, context, fail_on_apply=False):
        self.context = context
        self.fail_on_apply = fail_on_apply
        self.accepted = []
        self.calls = []

    def compile(self, spec):
        return len(spec.choice[0])

    def new_state(self, compiled, *, stop_token_ids):
        state = EvenState([])
        state.length = compiled
        self.accepted.append(state.log)
        return state

    def apply(self, logits, rows, states):
        if self.fail_on_apply:
            raise RuntimeError("grammar engine crashed")
        self.calls.append(list(rows))
        for row, state in zip(rows, states):
            if len(state.log) >= state.length:
                keep = logits[row, EOS_ID].clone()
                logits[row] = float("-inf")
                logits[row, EOS_ID] = keep
            else:
                logits[row, 1::2] = float("-inf")
                logits[row, EOS_ID] = float("-inf")


class EvensPlugin:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.made = []

    @hookimpl
    def kunlun_infer_plugin_info(self):
        return PluginInfo(name="evens", version="0.1", api=">=1.2,<2")

    @hookimpl
    def kunlun_infer_logits_processor_factories(self):
        def factory(*, context):
            self.made.append(EvenTokens(context, **self.kwargs))
            return self.made[-1]
        return {"evens": factory}


class PluginForOnePointZero:
    """Written for hook API 1.0: an observer that knows nothing of logits processors."""

    def __init__(self):
        self.steps = 0

    @hookimpl
    def kunlun_infer_plugin_info(self):
        return PluginInfo(name="old-observer", version="1.0.0", api=">=1.0,<2")

    @hookimpl
    def kunlun_infer_engine_step(self, stats):
        self.steps += 1


def engine_with(plugins, folder, **keys):
    manager = PluginManager.load()
    for plugin in plugins:
        manager.register(plugin)
    cfg = compose_config(engine_overrides(model__path=str(folder), **keys), plugin_manager=manager)
    runtime = Runtime.from_config(cfg, plugin_manager=manager)
    return LLMEngine(cfg, runtime=runtime), runtime


def run(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[i] for i in ids]


def test_a_plugins_processor_masks_each_constrained_row_and_follows_its_tokens(tiny_model):
    assert HOOK_API_VERSION >= (1, 2)
    plugin, old = EvensPlugin(), PluginForOnePointZero()
    engine, runtime = engine_with([plugin, old], tiny_model("llama"), structured__backend="evens")
    try:
        constrained = SamplingParams(max_tokens=20, temperature=1.0, seed=5, structured={"choice": ["x" * 6]})
        free = SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
        outs = run(engine, [[1, 2, 3], [4, 5, 6, 7]], constrained) + run(engine, [[1, 2, 3]], free)
        for out in outs[:2]:
            assert out.token_ids[:-1] == [t for t in out.token_ids[:-1] if t % 2 == 0]
            assert len(out.token_ids) == 7 and out.token_ids[-1] == EOS_ID and out.finish_reason == "stop"
        assert any(t % 2 for t in outs[2].token_ids)  # the free request was never masked
        processor = plugin.made[0]
        assert processor.context.vocab_size == 257 and processor.context.eos_token_ids == (EOS_ID,)
        # every token a sequence generated was accepted by its own state, in order, before the next mask
        assert sorted(map(tuple, processor.accepted)) == sorted(tuple(o.token_ids[:-1]) for o in outs[:2])
        assert max(len(rows) for rows in processor.calls) == 2  # both rows in one call
        assert old.steps == engine.stats()["num_steps"] > 0  # the 1.0 plugin loaded and ran alongside
    finally:
        engine.close()
        runtime.close()


def test_a_failing_processor_is_named_and_only_its_step_fails(tiny_model):
    engine, runtime = engine_with([EvensPlugin(fail_on_apply=True)], tiny_model("llama"),
                                  structured__backend="evens")
    try:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, structured={"choice": ["ab"]}))
        with pytest.raises(EngineStepError) as info:
            while engine.has_unfinished():
                engine.step()
        assert info.value.plugin == "evens" and "grammar engine crashed" in str(info.value)
        out = run(engine, [[1, 2]], SamplingParams(max_tokens=3, temperature=0.0))[0]
        assert len(out.token_ids) == 3
    finally:
        engine.close()
        runtime.close()


def test_an_unknown_backend_is_named_with_the_ones_installed(tiny_model):
    engine, runtime = engine_with([], tiny_model("llama"), structured__backend="nope")
    try:
        with pytest.raises(PluginError, match="no plugin provides logits_processor 'nope'; available: xgrammar"):
            engine.add_request([1, 2], SamplingParams(structured={"regex": "a"}))
    finally:
        engine.close()
        runtime.close()
