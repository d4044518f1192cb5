"""Attention backends (hook API 1.1): a 1.0 ops plugin runs unchanged; a backend of its own layout runs everything.

The ``padded`` test backend keeps one tensor per layer in a layout of its
own and lays batches out longest query first; its cache comes from a memory
plugin whose tensors refuse any use outside the backend. Greedy tokens must
still equal transformers' under chunked prefill, prefix caching, preemption
and ``n > 1``.
"""

from __future__ import annotations

import pytest

import tests.tools.padded_attention_plugin as padded
from kunlun_infer import PluginError, SamplingParams
from kunlun_infer.capabilities import OpsProvider
from kunlun_infer.engine.engine import LLMEngine
from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.plugins.torch_ops import kernels
from kunlun_infer.runtime import PluginManager, Runtime, compose_config
from tests.engine.tiny_models import engine_overrides, hf_greedy

#: one token, whole blocks (their first decode needs a new block), a shared two-block prefix, 8 full blocks
PROMPTS = [[7], list(range(30, 46)), list(range(40, 80)), list(range(40, 72)) + list(range(1, 17)),
           list(range(100, 228))]
MAX_TOKENS = 6


class CountingOps(OpsProvider):
    """An ops provider written for hook API 1.0: supports/get only, with its own store_kv and paged_attention."""

    name = "counting"

    def __init__(self):
        self.calls = {"store_kv": 0, "paged_attention": 0}
        self._kernels = kernels()

    def supports(self, op):
        return op in self._kernels

    def get(self, op):
        kernel = self._kernels[op]
        if op not in self.calls:
            return kernel

        def counted(*args):
            self.calls[op] += 1
            return kernel(*args)

        return counted


class OldOpsPlugin:
    made: list[CountingOps] = []

    @hookimpl
    def kunlun_infer_plugin_info(self):
        return PluginInfo(name="old-ops", version="1.0.0", api=">=1.0,<2", capabilities=("ops",))

    @hookimpl
    def kunlun_infer_ops_factories(self):
        def make(*, config, device):
            self.made.append(CountingOps())
            return self.made[-1]

        return {"oldops": make}


def run(folder, plugin, overrides, prompts=PROMPTS, params=None, then=()):
    """Greedy tokens of ``prompts``, then of ``then`` (one list per output), with ``plugin``; and the engine."""
    manager = PluginManager.load()
    manager.register(plugin)
    cfg = compose_config(engine_overrides(model__path=str(folder), **overrides), plugin_manager=manager)
    with Runtime.from_config(cfg, plugin_manager=manager) as runtime:
        engine = LLMEngine(cfg, runtime=runtime)
        try:
            params = params or SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            tokens = [t for wave in (prompts, then) for t in _generate(engine, wave, params)]
            stats = engine.stats()
            assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
            return tokens, engine
        finally:
            engine.close()


def _generate(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[list[int]]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id].append(out.token_ids)
    return [t for i in ids for t in done[i]]


@pytest.fixture(scope="module")
def references(tiny_model, hf_model):
    model = hf_model(tiny_model("llama"))
    return [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def test_an_ops_plugin_written_for_1_0_runs_unchanged_on_the_reference_backend(tiny_model, references):
    OldOpsPlugin.made.clear()
    tokens, engine = run(tiny_model("llama"), OldOpsPlugin(), {"ops": "oldops"})
    assert tokens == references
    assert engine.runner.attention.name == "reference"
    ops = OldOpsPlugin.made[-1]
    assert ops.calls["store_kv"] > 0 and ops.calls["paged_attention"] > 0  # its own kernels served attention


@pytest.mark.parametrize("overrides", [
    {},
    {"scheduler__max_num_batched_tokens": 24},  # chunked prefill
    {"cache__num_blocks": 16},  # preemption: the prompts fit, their first decodes do not
], ids=["plain", "chunked", "preempting"])
def test_a_backend_of_its_own_layout_gives_transformers_tokens(tiny_model, references, overrides):
    # the last prompt comes again once the first wave is done: its blocks are then a prefix-cache hit
    tokens, engine = run(tiny_model("llama"), padded, {"ops": "padded", "memory": "sealed", **overrides},
                         then=[PROMPTS[-1]])
    assert tokens == references + [references[-1]]
    assert engine.runner.attention.name == "padded"
    assert "store_kv" not in engine.runner.model.ctx.ops and "paged_attention" not in engine.runner.model.ctx.ops
    if "cache__num_blocks" in overrides:
        assert engine.stats()["num_preemptions"] > 0
    assert engine.stats()["prefix_cache_hit_tokens"] >= 112  # the repeated prompt's first seven blocks


def test_a_1_1_plugin_answering_every_spec_with_its_mha_backend_leaves_mla_to_the_reference(tiny_model, hf_model,
                                                                                           caplog):
    # the padded plugin predates MLA and returns its per-head backend for any spec: it must not serve DeepSeek
    folder = tiny_model("deepseek_v2")
    with caplog.at_level("WARNING", logger="kunlun_infer.runtime"):
        tokens, engine = run(folder, padded, {"ops": "padded"},
                             params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert tokens == [hf_greedy(hf_model(folder), p, MAX_TOKENS) for p in PROMPTS]
    assert engine.runner.attention.name == "reference-mla"
    assert "answered MLA attention with a PaddedBackend" in caplog.text


def test_n_samples_share_prompt_blocks_in_a_backend_of_its_own_layout(tiny_model, hf_model):
    folder = tiny_model("llama")
    params = SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    tokens, _ = run(folder, padded, {"ops": "padded", "memory": "sealed"}, prompts=[PROMPTS[2]], params=params)
    assert tokens == [hf_greedy(hf_model(folder), PROMPTS[2], MAX_TOKENS)] * 3


def test_the_cache_is_allocated_in_the_backend_layout_through_the_memory_plugin(tiny_model):
    manager = PluginManager.load()
    manager.register(padded)
    cfg = compose_config(engine_overrides(model__path=str(tiny_model("llama")), ops="padded", memory="sealed",
                                          cache__num_blocks=20), plugin_manager=manager)
    with Runtime.from_config(cfg, plugin_manager=manager) as runtime:
        engine = LLMEngine(cfg, runtime=runtime)
        try:
            layers = engine.runner.kv_caches
            assert len(layers) == 2 and all(len(layer) == 1 for layer in layers)
            assert all(isinstance(t, padded.SealedTensor) and tuple(t.shape) == (20, 2, 16, 2, 16 + padded.PAD)
                       for (t,) in layers)
            assert engine.runner.layout.nbytes(20) == 2 * 20 * 2 * 16 * 2 * (16 + padded.PAD) * 4
            with pytest.raises(AssertionError, match="outside the attention backend: __getitem__"):
                layers[0][0][0]
        finally:
            engine.close()


class DisorderlyBackend(padded.PaddedBackend):
    def order_batch(self, query_lens, context_lens):
        return [0] * len(query_lens)


class FailingBackend(padded.PaddedBackend):
    def attend(self, *args, **kwargs):
        raise RuntimeError("kernel launch failed")


def test_backend_failures_name_the_plugin_and_the_call(tiny_model, monkeypatch):
    folder = tiny_model("llama")
    monkeypatch.setattr(padded, "PaddedBackend", DisorderlyBackend)
    # the start-up warm-up step (16 sequences) already fails
    with pytest.raises(PluginError, match=r"order_batch returned \[0, 0.*not a permutation of the step's 16") as info:
        run(folder, padded, {"ops": "padded"}, prompts=PROMPTS[:2])
    assert (info.value.plugin, info.value.hook) == ("padded-attention", "attention.order_batch")
    monkeypatch.setattr(padded, "PaddedBackend", FailingBackend)
    with pytest.raises(PluginError, match="kernel launch failed") as info:
        run(folder, padded, {"ops": "padded"}, prompts=PROMPTS[:1])
    assert (info.value.plugin, info.value.hook) == ("padded-attention", "attention.attend")
