"""Faults: a plugin that raises in allocate, in an op or in all_reduce, mid-run.

The ``flaky`` plugin (:mod:`tests.hardening.fault_plugin`) is installed through
the entry-point group like any plugin. What a user must see:

- an allocate that fails while the engine starts fails the start with a
  ``PluginError`` naming plugin, hook and layer, and leaves nothing allocated;
- an op that fails mid-run ends the requests of that step with ``error``
  naming plugin, hook and layer (``finish_reason="abort"``), their KV blocks
  freed; with ``scheduler.on_step_error=recover`` the engine then serves the
  other and the next requests correctly, with ``shutdown`` it ends every
  request the same way and closes;
- an all_reduce that fails on a tensor-parallel rank ends the step the same
  way and, with ``shutdown``, the engine closes and its worker process is gone.
"""

from __future__ import annotations

import psutil
import pytest

from kunlun_infer import LLM, SamplingParams
from kunlun_infer.errors import EngineStepError, KunlunInferError, PluginError
from tests.hardening import fault_plugin
from tests.hardening.conftest import tiny_overrides
from tests.hardening.kv_audit import assert_kv_conserved

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def flaky_llm(folder, **keys) -> LLM:
    return LLM(overrides=tiny_overrides(folder, scheduler__max_num_seqs=2, **keys))


@pytest.fixture(scope="module")
def reference(tiny_folder):
    """Greedy tokens of each prompt on a healthy engine."""
    with LLM(overrides=tiny_overrides(tiny_folder)) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_a_failing_allocate_fails_start_up_naming_the_plugin_and_leaves_nothing_allocated(flaky, tiny_folder):
    with flaky_llm(tiny_folder, memory="flaky"):
        pass
    (healthy,) = fault_plugin.ALLOCATORS
    assert healthy.calls >= 4 and not healthy.live  # warm-up scratch and KV cache, all given back at close
    for n in range(1, healthy.calls + 1):  # every allocation the start-up makes, each failing in turn
        with pytest.raises(PluginError) as caught:
            flaky_llm(tiny_folder, memory="flaky", memory__fail_at=n)
        error = caught.value
        assert (error.plugin, error.hook, error.layer) == ("flaky", "memory.allocate", "plugin")
        assert f"injected fault in allocate call {n}" in str(error) and "plugin 'flaky'" in str(error)
        assert fault_plugin.ALLOCATORS[-1].live == {}, f"allocate #{n} failing left tensors allocated"


def run_until_failure(llm: LLM, op: str) -> tuple[EngineStepError, list[str]]:
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]  # two run, the third waits (max_num_seqs=2)
    engine.step()
    engine.step()
    engine.runtime.ops.arm(op)
    with pytest.raises(EngineStepError) as caught:
        engine.step()
    return caught.value, ids


@pytest.mark.parametrize("op", ["linear", "paged_attention", "rms_norm"])
def test_an_op_failing_mid_run_ends_its_step_and_the_engine_recovers(flaky, tiny_folder, reference, op):
    with flaky_llm(tiny_folder, ops="flaky") as llm:
        engine = llm.engine
        error, (first, second, third) = run_until_failure(llm, op)
        assert (error.plugin, error.hook, error.layer, error.shut_down) == ("flaky", f"ops.{op}", "plugin", False)
        for text in ("plugin 'flaky'", f"ops.{op}", "layer: plugin", "injected fault"):
            assert text in str(error)
        assert {o.request_id for o in error.outputs} == {first, second}
        assert all(o.finished and o.finish_reason == "abort" and o.error and f"ops.{op}" in o.error
                   for o in error.outputs)
        assert_kv_conserved(engine)
        assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]  # the third holds none yet
        finals = {}
        while engine.has_unfinished():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
            assert_kv_conserved(engine)
        assert {r: finals[r].error for r in (first, second)} == {o.request_id: o.error for o in error.outputs}
        assert finals[third].error is None and finals[third].token_ids == reference[2]  # it never noticed
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # the next requests: served as if nothing happened
        assert [o.token_ids for o in again] == reference and all(o.error is None for o in again)
        assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]


def test_an_op_failing_mid_run_shuts_the_engine_down_when_configured(flaky, tiny_folder):
    llm = flaky_llm(tiny_folder, ops="flaky", scheduler__on_step_error="shutdown")
    engine = llm.engine
    error, ids = run_until_failure(llm, "linear")
    assert error.shut_down and (error.plugin, error.hook) == ("flaky", "ops.linear")
    assert "shut down" in str(error) and "scheduler.on_step_error=shutdown" in str(error)
    assert sorted(o.request_id for o in error.outputs) == sorted(ids)  # the waiting one too
    assert all(o.finish_reason == "abort" and "ops.linear" in o.error for o in error.outputs)
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and not engine.has_unfinished()
    assert engine.runtime.closed and engine.runner.kv_caches == []  # device closed, cache given back
    with pytest.raises(KunlunInferError, match="closed after step 3 failed: plugin 'flaky'"):
        engine.add_request([1, 2, 3], GREEDY)
    llm.close()  # still fine to call


def test_on_step_error_accepts_only_recover_or_shutdown(tiny_folder):
    with pytest.raises(KunlunInferError, match="scheduler.on_step_error=later must be recover or shutdown"):
        LLM(overrides=tiny_overrides(tiny_folder, scheduler__on_step_error="later"))


class ExplodingObserver:
    """An observability plugin that fails in every hook."""

    from kunlun_infer.hookspecs import hookimpl

    @hookimpl
    def kunlun_infer_plugin_info(self):
        from kunlun_infer.hookspecs import PluginInfo

        return PluginInfo(name="exploding-observer", version="0.0.1", api=">=1.0,<2")

    @hookimpl
    def kunlun_infer_engine_step(self, stats):
        from kunlun_infer.errors import ConfigError

        raise ConfigError("observer setting broke")  # one of the project's own errors, not a PluginError

    @hookimpl
    def kunlun_infer_request_finished(self, output):
        raise RuntimeError("observer broke")


def test_a_failing_observer_is_logged_and_never_stops_a_step(tiny_folder, reference, caplog):
    from kunlun_infer.engine.engine import LLMEngine
    from kunlun_infer.runtime import PluginManager, Runtime, compose_config

    manager = PluginManager.load(entry_points=False)
    manager.register(ExplodingObserver())
    cfg = compose_config(tiny_overrides(tiny_folder), plugin_manager=manager)
    with Runtime.from_config(cfg, plugin_manager=manager) as runtime, LLMEngine(cfg, runtime=runtime) as engine:
        llm = LLM.__new__(LLM)
        llm.engine = engine
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outputs] == reference
    assert "plugin 'exploding-observer' failed in kunlun_infer_request_finished" in caplog.text
    assert "plugin 'exploding-observer' failed in kunlun_infer_engine_step" in caplog.text


def my_children() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def test_an_all_reduce_failing_on_a_tensor_parallel_rank_ends_the_step_and_shuts_down(
        flaky, tiny_folder, make_distribution, monkeypatch):
    import os

    # the spawned rank must find the plugin too: it discovers entry points on its own sys.path
    site = str(make_distribution.root)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([site, os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    llm = LLM(overrides=tiny_overrides(tiny_folder, comm="flaky", comm__fail_at=12, comm__timeout_s=10,
                                       parallel__tensor_size=2, scheduler__on_step_error="shutdown"))
    (pid,) = llm.engine.parallel.workers.pids
    request = llm.engine.add_request(PROMPTS[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    with pytest.raises(EngineStepError) as caught:
        for _ in range(50):
            llm.engine.step()
    error = caught.value
    assert error.shut_down and (error.plugin, error.hook, error.layer) == ("flaky", "comm.all_reduce", "plugin")
    assert "injected fault in all_reduce call 12" in str(error)
    assert [(o.request_id, o.finish_reason) for o in error.outputs] == [(request, "abort")]
    assert "comm.all_reduce" in error.outputs[0].error
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not [p for p in my_children() if p.pid == pid]
    llm.close()


def test_an_op_failing_on_rank_1_ends_its_step_and_the_tensor_parallel_group_serves_on(
        flaky, tiny_folder, make_distribution, monkeypatch, reference):
    import os

    site = str(make_distribution.root)  # rank 1 finds the flaky plugin through its entry point too
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([site, os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    llm = LLM(overrides=tiny_overrides(tiny_folder, ops="flaky", ops__fail_op="silu_and_mul", ops__fail_at=3,
                                       ops__fail_rank=1, parallel__tensor_size=2, comm__timeout_s=30))
    try:
        (pid,) = llm.engine.parallel.workers.pids
        requests = [llm.engine.add_request(p, GREEDY) for p in PROMPTS]
        with pytest.raises(EngineStepError) as caught:
            for _ in range(50):
                llm.engine.step()
        error = caught.value
        assert not error.shut_down
        assert (error.plugin, error.hook, error.layer) == ("flaky", "ops.silu_and_mul", "plugin")
        assert "tensor-parallel rank 1" in str(error) and "injected fault in silu_and_mul call 3" in str(error)
        ended = {o.request_id: o for o in llm.engine.step() if o.finished}  # the step's requests, with the error
        assert set(ended) == set(requests)
        assert all(o.finish_reason == "abort" and "rank 1" in o.error and "ops.silu_and_mul" in o.error
                   for o in ended.values())
        # the group serves on: the next hundred requests all finish, with the tokens of a healthy engine
        outs = llm.generate([PROMPTS[i % 3] for i in range(100)], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == [reference[i % 3] for i in range(100)]
        assert running(pid) and llm.engine.parallel.workers.pids == [pid]
        stats = llm.engine.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    finally:
        llm.close()
    assert not running(pid)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
