"""``ops=kunlun`` on the vendor's kernels, against a strict stand-in ``kunlun_ops``: calls, fallbacks, coverage."""

import logging
import sys
import types

import pytest
import torch

import kunlun_ops_standin
from kunlun_infer.engine.sampler import SAMPLER_OPS
from kunlun_infer.layers.quantization import INT8_OPS
from kunlun_infer.ops import OP_SPECS, reference
from kunlun_infer.runtime import PluginManager
from kunlun_infer.commands.coverage import ops_coverage
from kunlun_infer.testing.compare import ConformanceError
from kunlun_infer.testing.ops import check_op

from kunlun_infer_kunlun.ops import VENDOR_OPS, KunlunOps
from kunlun_infer_kunlun.vendor import VendorKernels, load_vendor_kernels

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def library(exclude=(), **replace):
    """A ``kunlun_ops`` module made of the stand-in's functions, without ``exclude``, with ``replace``."""
    module = types.ModuleType("kunlun_ops")
    for name in ("rmsnorm", "add_rmsnorm", "swiglu", "rotary_embedding", "reshape_and_cache_flash",
                 "paged_attention", "speculative_attention", "prefill_attention", "moe_softmax_topk",
                 "moe_softmax_topk_norm", "gen_block_statistic", "moe_pre_sorted", "moe_fc", "moe_post"):
        if name not in exclude:
            setattr(module, name, replace.get(name, getattr(kunlun_ops_standin, name)))
    return module


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(VENDOR_OPS))
def test_each_op_calls_its_kernel_and_matches_the_reference(standin, op, dtype):
    ops = KunlunOps()
    assert ops.kernel_source(op) == ", ".join(f"kunlun_ops.{f}" for f in VENDOR_OPS[op])
    for seed in range(OP_SPECS[op].variants):  # moe_route: with and without renormalisation, and the torch cases
        check_op(ops, op, dtype, CPU, seed=seed)
    assert all(standin.calls[f] >= 1 for f in VENDOR_OPS[op])  # the kernels ran, not a torch path


def test_norms_accept_the_shapes_the_models_pass(standin):
    ops = KunlunOps()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 4, 32, generator=g), torch.randn(32, generator=g)  # per-head q/k norm of Qwen3
    torch.testing.assert_close(ops.get("rms_norm")(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    strided = torch.randn(5, 96, generator=g)[:, :64]  # a slice of a fused projection
    torch.testing.assert_close(ops.get("silu_and_mul")(strided), reference.silu_and_mul(strided))
    residual = torch.randn(5, 64, generator=g)
    got = ops.get("add_rms_norm")(strided, residual, w.repeat(2), 1e-6)
    for a, b in zip(got, reference.add_rms_norm(strided, residual, w.repeat(2), 1e-6)):
        torch.testing.assert_close(a, b)


def test_rotary_leaves_its_inputs_alone_and_converts_the_table_once(standin):
    ops = KunlunOps()
    args, _ = OP_SPECS["rotary_embedding"].sample(torch.float32, CPU, torch.Generator().manual_seed(1))
    positions, q, k, table = args
    q_before, k_before = q.clone(), k.clone()
    for _ in range(2):
        got = ops.get("rotary_embedding")(positions, q, k, table)
    torch.testing.assert_close(got, reference.rotary_embedding(positions, q, k, table))
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # the kernel rotated copies
    rotary = ops._kernels["rotary_embedding"]
    assert len(rotary._tables) == 1 and rotary._tables[next(iter(rotary._tables))].shape == (table.shape[0], 32)


def test_a_table_that_is_not_rotate_half_takes_the_torch_path_with_one_warning(standin, caplog):
    ops = KunlunOps()
    g = torch.Generator().manual_seed(2)
    table = torch.randn(16, 2, 8, generator=g)  # halves differ: not the NeoX layout the kernel takes
    positions, q, k = torch.arange(4), torch.randn(4, 2, 8, generator=g), torch.randn(4, 1, 8, generator=g)
    with caplog.at_level(logging.WARNING, logger="kunlun_infer.plugin.kunlun"):
        for _ in range(2):
            got = ops.get("rotary_embedding")(positions, q, k, table)
    torch.testing.assert_close(got, reference.rotary_embedding(positions, q, k, table))
    assert standin.calls["rotary_embedding"] == 0
    assert caplog.text.count("not in the rotate-half (NeoX) layout") == 1


# a wrong call of each kind must not pass unnoticed: the stand-in refuses it, or the result differs from the reference
def _swap(i, j):
    def change(args, kwargs):
        args[i], args[j] = args[j], args[i]
        return args, kwargs
    return change


def _swap_keywords(a, b):
    def change(args, kwargs):
        kwargs[a], kwargs[b] = kwargs[b], kwargs[a]
        return args, kwargs
    return change


def _set(keyword, value):
    def change(args, kwargs):
        kwargs[keyword] = value(kwargs[keyword]) if callable(value) else value
        return args, kwargs
    return change


def _change_arg(i, value):
    def change(args, kwargs):
        args[i] = value(args[i])
        return args, kwargs
    return change


def _framework_layout(table):
    """The vendor table ``cat(cos, sin)`` back in the framework's ``[max_pos, 2, head_dim]`` form."""
    half = table.shape[1] // 2
    return torch.stack((table[:, :half], table[:, half:]), dim=1).repeat(1, 1, 2)


MUTATIONS = {
    "rmsnorm: weight and output swapped": ("rms_norm", "rmsnorm", _swap(1, 2), torch.float32),
    "rmsnorm: eps and output swapped": ("rms_norm", "rmsnorm", _swap(2, 3), torch.float32),
    "add_rmsnorm: output and residual_output swapped": (
        "add_rms_norm", "add_rmsnorm", _swap_keywords("output", "residual_output"), torch.float32),
    "swiglu: input and output swapped": ("silu_and_mul", "swiglu", _swap_keywords("x", "y"), torch.float32),
    "rotary: the framework's [max_pos, 2, head_dim] table unconverted": (
        "rotary_embedding", "rotary_embedding", _set("cos_sin_cache", _framework_layout), torch.float32),
    "rotary: GPT-J layout instead of NeoX": ("rotary_embedding", "rotary_embedding", _set("is_neox", False),
                                             torch.float32),
    "rotary: half the head size": ("rotary_embedding", "rotary_embedding", _set("head_size", 16), torch.float32),
    "rotary: float32 table for bfloat16 queries": ("rotary_embedding", "rotary_embedding",
                                                   _set("cos_sin_cache", lambda t: t.float()), torch.bfloat16),
    "moe_softmax_topk_norm: weights and ids swapped": ("moe_route", "moe_softmax_topk_norm", _swap(1, 2),
                                                       torch.float32),
    "moe_softmax_topk_norm: logits in the model's dtype": ("moe_route", "moe_softmax_topk_norm",
                                                           _change_arg(0, lambda t: t.bfloat16()), torch.float32),
    "gen_block_statistic: int64 ids": ("fused_moe", "gen_block_statistic", _change_arg(0, lambda t: t.long()),
                                       torch.bfloat16),
    "moe_pre_sorted: statistic of other ids": ("fused_moe", "moe_pre_sorted",
                                               _set("block_statistic", lambda t: t.roll(1, dims=1)), torch.bfloat16),
    "moe_fc: weights as [E, in, out]": ("fused_moe", "moe_fc",
                                         _set("weight", lambda w: w.transpose(1, 2).contiguous()), torch.float32),
    "moe_fc: moe_topk of one": ("fused_moe", "moe_fc", _set("moe_topk", 1), torch.float32),
    "moe_post: rows taken in token order, not through moe_index": (
        "fused_moe", "moe_post", _set("moe_index", lambda t: torch.arange(t.numel(), dtype=torch.int32).view(t.shape)),
        torch.float32),
    "moe_post: the weights left out": ("fused_moe", "moe_post", _set("normed_scale", torch.ones_like),
                                       torch.float32),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_wrong_call_fails(mutation):
    op, function, change, dtype = MUTATIONS[mutation]
    kernel = getattr(kunlun_ops_standin, function)

    def mutated(*args, **kwargs):
        args, kwargs = change(list(args), dict(kwargs))
        return kernel(*args, **kwargs)

    check_op(KunlunOps(VendorKernels(library())), op, dtype, CPU)  # the faithful call passes
    with pytest.raises((kunlun_ops_standin.Rejected, ConformanceError)):
        check_op(KunlunOps(VendorKernels(library(**{function: mutated}))), op, dtype, CPU)


def test_without_the_library_the_vendor_ops_run_on_the_reference_and_coverage_says_so(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "kunlun_ops", None)  # "import kunlun_ops" fails as if not installed
    with caplog.at_level(logging.INFO, logger="kunlun_infer.plugin.kunlun"):
        coverage = ops_coverage(PluginManager.load())["kunlun"]
    assert coverage["error"] is None
    # int8 ops (API 1.3) and the sampler's (1.8; torch's own argmax on the device): references
    assert coverage["fallbacks"] == sorted([*VENDOR_OPS, *INT8_OPS, *SAMPLER_OPS])
    assert coverage["sources"]["linear"] == coverage["sources"]["paged_attention"] == "kunlun"
    assert "kunlun_ops is not installed" in caplog.text


def test_a_missing_function_costs_only_its_own_op(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "kunlun_ops", library(exclude=("swiglu",)))
    with caplog.at_level(logging.WARNING, logger="kunlun_infer.plugin.kunlun"):
        coverage = ops_coverage(PluginManager.load())["kunlun"]
    # int8 ops (API 1.3): references; the expert pipeline needs swiglu too
    assert coverage["fallbacks"] == sorted(["silu_and_mul", "fused_moe", "pack_moe_weights", *INT8_OPS,
                                            *SAMPLER_OPS])
    assert {coverage["sources"][op] for op in ("rms_norm", "add_rms_norm", "rotary_embedding")} == {"kunlun"}
    assert "has no swiglu; silu_and_mul, pack_moe_weights, fused_moe run on the plain-torch reference" in caplog.text


def test_a_library_that_fails_to_import_is_reported_not_raised():
    def import_module(name):
        if name == "kunlun_ops":
            raise OSError("libxpurt.so: cannot open shared object file")
        raise ModuleNotFoundError(f"No module named '{name}'", name=name)

    vendor = load_vendor_kernels(import_module)
    assert vendor.module is None and vendor.broken
    assert "OSError: libxpurt.so" in vendor.reason
    assert KunlunOps(vendor).available() == [op for op in OP_SPECS if op not in (*VENDOR_OPS, *INT8_OPS,
                                                                                  *SAMPLER_OPS)]
