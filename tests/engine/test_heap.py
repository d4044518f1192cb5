"""A serving loop freezes the heap its engine built; the last loop to end unfreezes it, and closed engines are
collected."""

import gc
import weakref

import pytest

from kunlun_infer import LLM
from kunlun_infer.engine import heap
from tests.engine.tiny_models import engine_overrides


def _walked_by_collections(obj) -> bool:
    """Whether a full collection walks ``obj`` (frozen objects are in none of the collector's generations)."""
    return any(o is obj for o in gc.get_objects())


def _close_in_a_cycle(llm) -> weakref.ref:
    """Close ``llm`` with its engine in a reference cycle, which only the collector frees; a weak reference to
    the engine, to check once the caller's references are gone."""
    engine = llm.engine
    engine.itself = engine
    ref = weakref.ref(engine)
    llm.close()
    return ref


@pytest.fixture(autouse=True)
def _no_holder_left():
    assert heap.num_holders() == 0
    yield
    assert heap.num_holders() == 0 and gc.get_freeze_count() == 0


def test_a_held_engine_is_left_out_of_collections_and_collected_after_the_release(tiny_model):
    llm = LLM(model=str(tiny_model("llama")), overrides=engine_overrides())
    assert _walked_by_collections(llm.engine)  # the embedded LLM leaves its caller's heap alone
    with heap.held():
        assert not _walked_by_collections(llm.engine)
        assert llm.generate([[1, 2, 3]], use_tqdm=False)[0].token_ids  # serves as before
        ref = _close_in_a_cycle(llm)
        del llm
    gc.collect()
    assert ref() is None, "the closed engine stayed frozen: its cycles were never collected"


def test_the_heap_stays_frozen_until_the_last_holder_releases_it(tiny_model):
    first = LLM(model=str(tiny_model("llama")), overrides=engine_overrides())
    second = LLM(model=str(tiny_model("llama")), overrides=engine_overrides())
    heap.hold()
    heap.hold()
    try:
        ref = _close_in_a_cycle(first)
        del first
        heap.release()
        assert heap.num_holders() == 1 and not _walked_by_collections(second.engine)
        assert second.generate([[4, 5, 6]], use_tqdm=False)[0].token_ids
    finally:
        second.close()
        heap.release()
    gc.collect()
    assert ref() is None


def test_the_http_server_holds_the_heap_while_it_serves(tiny_model, monkeypatch):
    from kunlun_infer.runtime import compose_config
    from kunlun_infer.server import runner

    seen = {}

    def run_app(app, sock, model_name, *, on_ready=None, engine_loop=None):
        seen["holders"], seen["frozen"] = heap.num_holders(), gc.get_freeze_count()

    monkeypatch.setattr(runner, "run_app", run_app)
    cfg = compose_config([f"model.path={tiny_model('llama')}", *engine_overrides(), "server.port=0"])
    runner.serve(cfg)
    assert seen["holders"] == 1 and seen["frozen"] > 0
