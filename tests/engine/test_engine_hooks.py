"""Observability plugins hear about the engine's life; a failing step is reported and contained."""

import pytest

from kunlun_infer import SamplingParams
from kunlun_infer.engine.engine import LLMEngine
from kunlun_infer.errors import EngineStepError
from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.runtime import PluginManager, Runtime, compose_config
from tests.engine.tiny_models import engine_overrides


class Observer:
    """An observability plugin that records every engine event."""

    def __init__(self):
        self.events = []

    @hookimpl
    def kunlun_infer_plugin_info(self):
        return PluginInfo(name="observer", version="0.0.1", api=">=1.0,<2")

    @hookimpl
    def kunlun_infer_engine_start(self, info):
        self.events.append(("start", dict(info)))

    @hookimpl
    def kunlun_infer_engine_step(self, stats):
        self.events.append(("step", dict(stats)))

    @hookimpl
    def kunlun_infer_request_finished(self, output):
        self.events.append(("finished", output))

    @hookimpl
    def kunlun_infer_engine_stop(self, stats):
        self.events.append(("stop", dict(stats)))


@pytest.fixture
def observed_engine(tiny_model):
    observer = Observer()
    manager = PluginManager.load()
    manager.register(observer)
    cfg = compose_config(engine_overrides(model__path=str(tiny_model("llama"))))
    runtime = Runtime.from_config(cfg, plugin_manager=manager)
    engine = LLMEngine(cfg, runtime=runtime)
    yield engine, observer
    engine.close()
    runtime.close()


def test_observers_hear_start_steps_finished_requests_and_stop(observed_engine):
    engine, observer = observed_engine
    kind, info = observer.events[0]
    assert kind == "start" and info["kv_blocks_total"] == engine.stats()["kv_blocks_total"]
    assert info["plugins"]["ops"] and info["block_size"] == 16
    request = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    steps = [e[1] for e in observer.events if e[0] == "step"]
    assert len(steps) == 3 and steps[0]["num_prefill_tokens"] == 3 and steps[1]["num_decode_tokens"] == 1
    assert all(s["duration_s"] >= 0 for s in steps)
    finished = [e[1] for e in observer.events if e[0] == "finished"]
    assert [o.request_id for o in finished] == [request] and finished[0].finish_reason == "length"
    engine.close()
    assert observer.events[-1][0] == "stop" and observer.events[-1][1]["num_requests_finished"] == 1


def test_failing_step_aborts_its_requests_and_the_engine_keeps_serving(observed_engine, monkeypatch):
    engine, _ = observed_engine
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    doomed = engine.add_request([1, 2, 3], params)

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "execute", broken)
        with pytest.raises(EngineStepError, match="kernel exploded"):
            engine.step()
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [(doomed, "abort")]
    survivor = engine.add_request([4, 5], params)
    finals = []
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    assert [(o.request_id, len(o.token_ids)) for o in finals] == [(survivor, 4)]
