"""resolve_ops: coverage is checked before the first step; fallbacks are logged once and counted."""

from __future__ import annotations

import logging

import pytest
import torch

from kunlun_infer import OpsCoverageError, PluginError, compose_config
from kunlun_infer.capabilities import DictOpsProvider
from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.ops import OP_SPECS, reference
from kunlun_infer.runtime import PluginManager, Runtime

MODEL_OPS = ["rms_norm", "add_rms_norm", "rotary_embedding", "silu_and_mul", "linear", "embedding", "store_kv",
             "paged_attention"]


def _broken_silu(x):
    raise RuntimeError("kernel launch failed")


class PartialOpsPlugin:
    """An ops plugin covering two ops, one of them failing, plus half of the linear pair."""

    @hookimpl
    def kunlun_infer_plugin_info(self):
        return PluginInfo(name="partial", version="0.1", capabilities=("ops",))

    @hookimpl
    def kunlun_infer_ops_factories(self):
        return {
            "partial": lambda *, config, device: DictOpsProvider(
                {"rms_norm": reference.rms_norm, "silu_and_mul": _broken_silu, "linear": reference.linear,
                 "fused_magic": lambda x: x * 2}),
        }


@pytest.fixture
def manager():
    manager = PluginManager.load(entry_points=False)
    manager.register(PartialOpsPlugin())
    return manager


def runtime(manager, *overrides):
    return Runtime.from_config(compose_config(list(overrides), plugin_manager=manager), plugin_manager=manager)


def test_builtin_torch_ops_cover_every_op(manager):
    with runtime(manager) as rt:
        table = rt.resolve_ops(list(OP_SPECS))
        assert table.fallbacks == []
        assert {table.source(op) for op in OP_SPECS} == {"torch-ops"}
        x, w = torch.randn(3, 8), torch.randn(8)
        torch.testing.assert_close(table.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))


def test_missing_ops_fall_back_to_reference_logged_once_and_counted(manager, caplog):
    caplog.set_level(logging.WARNING, logger="kunlun_infer.runtime")
    with runtime(manager, "ops=partial") as rt:
        table = rt.resolve_ops(MODEL_OPS)
        assert table.source("rms_norm") == "partial"
        # linear without its pack_linear_weight partner is not mixed with the reference's packing
        assert table.source("linear") == "reference" and table.source("pack_linear_weight") == "reference"
        assert set(table.fallbacks) == set(MODEL_OPS) - {"rms_norm", "silu_and_mul"} | {"pack_linear_weight"}
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "ops plugin 'partial'" in warnings[0] and "paged_attention" in warnings[0]

        rt.resolve_ops(MODEL_OPS)  # the same gaps again: no second warning
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1

        ids, weight = torch.tensor([1, 0, 1]), torch.randn(2, 4)
        table.embedding(ids, weight)
        table.embedding(ids, weight)
        assert table.fallback_calls["embedding"] == 2 and table.fallback_calls["rms_norm"] == 0


def test_strict_refuses_with_the_list_of_missing_ops(manager):
    with runtime(manager, "ops=partial", "ops.strict=true") as rt:
        with pytest.raises(OpsCoverageError) as info:
            rt.resolve_ops(MODEL_OPS)
    error = info.value
    assert set(error.missing) == set(MODEL_OPS) - {"rms_norm", "silu_and_mul"} | {"pack_linear_weight"}
    assert "ops.strict=true" in str(error) and "paged_attention" in str(error) and error.plugin == "partial"


def test_strict_with_full_coverage_passes(manager):
    with runtime(manager, "ops.strict=true") as rt:
        assert rt.resolve_ops(MODEL_OPS).fallbacks == []


def test_vendor_op_without_reference(manager):
    with runtime(manager, "ops=partial") as rt:
        assert rt.resolve_ops(["fused_magic"]).fused_magic(torch.ones(2)).tolist() == [2.0, 2.0]
    with runtime(manager) as rt:
        with pytest.raises(OpsCoverageError, match="fused_magic.*no reference"):
            rt.resolve_ops(["fused_magic"])


def test_kernel_failure_names_plugin_and_op(manager):
    with runtime(manager, "ops=partial") as rt:
        table = rt.resolve_ops(["silu_and_mul"])
        with pytest.raises(PluginError) as info:
            table.silu_and_mul(torch.randn(2, 8))
    assert (info.value.plugin, info.value.hook) == ("partial", "ops.silu_and_mul")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_unresolved_op_access_says_what_was_resolved(manager):
    with runtime(manager) as rt:
        table = rt.resolve_ops(["rms_norm"])
        with pytest.raises(AttributeError, match="op 'embedding' was not resolved.*rms_norm"):
            table.embedding


class Before18OpsPlugin:
    """An ops plugin written for hook API 1.7: every op of the table then, none of 1.8's ``greedy_tokens`` (nor 1.10's
    ``sample_tokens``)."""

    @hookimpl
    def kunlun_infer_plugin_info(self):
        return PluginInfo(name="before-1.8", version="0.1", capabilities=("ops",))

    @hookimpl
    def kunlun_infer_ops_factories(self):
        kernels = {name: spec.reference for name, spec in OP_SPECS.items()
                   if name not in ("greedy_tokens", "sample_tokens")}
        return {"before-1.8": lambda *, config, device: DictOpsProvider(kernels)}


def test_optional_ops_are_served_by_the_reference_without_a_warning_even_when_strict(manager, caplog):
    manager.register(Before18OpsPlugin())
    caplog.set_level(logging.INFO, logger="kunlun_infer.runtime")
    with runtime(manager, "ops=before-1.8", "ops.strict=true") as rt:
        assert rt.resolve_ops(MODEL_OPS).fallbacks == []  # the model's own ops: all the plugin's
        with pytest.raises(OpsCoverageError, match="greedy_tokens"):
            rt.resolve_ops(["greedy_tokens"])  # as a model's op, strict would refuse it
        table = rt.optional_ops(["greedy_tokens"])
        assert table.source("greedy_tokens") == "reference"
        logits = torch.tensor([[0.0, 2.0, 2.0], [float("nan"), 1.0, float("nan")]])
        assert table.greedy_tokens(logits).tolist() == [1, 0]
    said = [r for r in caplog.records if "greedy_tokens" in r.getMessage() and "before-1.8" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO]
    with runtime(manager, "ops.strict=true") as rt:  # the built-in torch ops have it
        assert rt.optional_ops(["greedy_tokens"]).source("greedy_tokens") == "torch-ops"


class Before110OpsPlugin:
    """An ops plugin written for hook API 1.9: every op of the table then, none of 1.10's ``sample_tokens``."""

    @hookimpl
    def kunlun_infer_plugin_info(self):
        return PluginInfo(name="before-1.10", version="0.1", capabilities=("ops",))

    @hookimpl
    def kunlun_infer_ops_factories(self):
        kernels = {name: spec.reference for name, spec in OP_SPECS.items() if name != "sample_tokens"}
        return {"before-1.10": lambda *, config, device: DictOpsProvider(kernels)}


def test_a_1_9_ops_plugin_samples_through_the_samplers_own_draw_even_when_strict(manager, caplog):
    """A 1.9 ops plugin has no ``sample_tokens``: it loads under ``ops.strict``, the engine's sampler takes its
    ``greedy_tokens`` and draws sampled rows itself (the same tokens the op's reference draws from the same
    uniforms), and says so at info level."""
    from kunlun_infer.engine.params import SamplingParams
    from kunlun_infer.engine.sampler import SAMPLER_OPS, Sampler

    manager.register(Before110OpsPlugin())
    caplog.set_level(logging.INFO, logger="kunlun_infer.runtime")
    with runtime(manager, "ops=before-1.10", "ops.strict=true") as rt:
        sampler = Sampler.for_runtime(rt, torch.Generator().manual_seed(0))
        assert sampler.sample is None
        table = rt.optional_ops(SAMPLER_OPS)
        assert (table.source("greedy_tokens"), table.source("sample_tokens")) == ("before-1.10", "reference")
        logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(1)) * 2
        params = [SamplingParams(temperature=0), SamplingParams(top_k=30), SamplingParams(top_p=0.8),
                  SamplingParams(min_p=0.1, temperature=0.5)]
        tokens = sampler(logits, params, [None] * 4).token_ids
        uniforms = torch.rand(4, 2, generator=torch.Generator().manual_seed(0))
        assert tokens == reference.sample_tokens(*Sampler.sample_arguments(logits, params), uniforms).tolist()
    said = [r for r in caplog.records if "sample_tokens" in r.getMessage() and "before-1.10" in r.getMessage()]
    assert said and all(r.levelno == logging.INFO for r in said)
