"""The Kunlun attention backend against the stand-in ``kunlun_ops``: layout, metadata, kernel calls, fallbacks."""

import functools
import logging
import sys
import types

import pytest
import torch

import kunlun_ops_standin
from kunlun_infer.commands.coverage import ops_coverage
from kunlun_infer.ops.attention import AttentionSpec
from kunlun_infer.ops.attention_step import AttentionStep
from kunlun_infer.runtime import PluginManager
from kunlun_infer.testing.attention import check_attention_backend, check_backend
from kunlun_infer.testing.compare import ConformanceError

from kunlun_infer_kunlun.attention import KunlunAttention, build_step
from kunlun_infer_kunlun.ops import KunlunOps
from kunlun_infer_kunlun.vendor import VendorKernels
from test_kunlun_ops import library

CPU = torch.device("cpu")
HOST = types.SimpleNamespace(torch_device=CPU, supported_dtypes=lambda: {torch.float32, torch.bfloat16, torch.float16})
SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float32)


def backend(module=None, spec=SPEC):
    return KunlunOps(VendorKernels(module if module is not None else library())).attention_backend(spec)


def test_the_backend_attends_like_the_reference_on_the_vendor_kernels(standin):
    checked = check_attention_backend(KunlunOps(), HOST)  # prefills, chunked prefill, a prefix hit, decodes
    assert len(checked) == 6  # two head shapes in three dtypes
    for function in ("reshape_and_cache_flash", "speculative_attention", "prefill_attention",
                     "prefill_attention:prefix_cache"):
        assert standin.calls[function] > 0, function
    assert standin.calls["paged_attention"] == 0  # speculative_attention is preferred for decodes


def test_cache_layout_and_batch_order():
    kunlun = backend()
    (kv,) = kunlun.kv_cache_tensors(num_blocks=10, block_size=16)
    assert kv.shape == (2, 10, 2, 16, 64) and kv.dtype == torch.float32  # keys/values, blocks, heads, tokens, dim
    assert list(kunlun.order_batch([5, 1, 7, 1], [0, 9, 16, 3])) == [1, 3, 0, 2]  # decodes first


def test_metadata_splits_decodes_from_prefills_with_int32_host_and_device_lengths():
    # two decodes, then a chunked prefill (16 cached + 5 new) and a fresh prompt of 3
    step = AttentionStep(block_size=16, query_lens=[1, 1, 5, 3], context_lens=[20, 3, 16, 0],
                         block_tables=[[4, 7], [2], [9, 1], [5]], slot_mapping=[116, 35, 16, 17, 18, 19, 20, 80, 81,
                                                                                 82])
    meta = build_step(step)
    assert meta.slot_mapping.dtype == torch.int32 and meta.slot_mapping.tolist() == step.slot_mapping
    decode, prefill = meta.decode, meta.prefill
    assert decode.num_seqs == 2 and decode.block_tables.tolist() == [[4, 7], [2, 0]]
    assert decode.context_lens.host.tolist() == [21, 4] and decode.context_lens.host.device.type == "cpu"
    assert decode.context_lens.device.dtype == decode.context_lens.host.dtype == torch.int32
    assert prefill.first_token == 2 and prefill.prefix_cache
    assert prefill.query_lod.host.tolist() == [0, 5, 8] and prefill.kv_lod.host.tolist() == [0, 21, 24]
    assert prefill.block_tables.tolist() == [[9, 1], [5, 0]]
    fresh = build_step(AttentionStep(16, [3, 2], [0, 0], [[0], [1]], [0, 1, 2, 16, 17]))
    assert fresh.decode is None and not fresh.prefill.prefix_cache


def test_paged_attention_serves_decodes_when_speculative_attention_is_missing(standin):
    kunlun = backend(library(exclude=("speculative_attention",)))
    assert kunlun.decode_fn == "paged_attention"
    check_backend(kunlun, SPEC, CPU)
    assert standin.calls["paged_attention"] > 0


def test_an_older_speculative_attention_without_a_window_leaves_decodes_to_paged_attention(standin):
    def speculative_attention(*, out, q, k_cache, v_cache, context_lens_cpu, context_lens_xpu, batch_num, qlen,
                              max_context_len, head_num, head_dim, scale, kv_head_num, block_size,
                              max_num_blocks_per_seq, block_tables):
        raise AssertionError("an older speculative_attention must not be called")

    kunlun = backend(library(speculative_attention=speculative_attention))
    assert kunlun.decode_fn == "paged_attention"
    check_backend(kunlun, SPEC, CPU)
    assert standin.calls["paged_attention"] > 0


def test_paged_attention_cannot_apply_another_scale_so_those_decodes_take_the_torch_path(standin, caplog):
    kunlun = backend(library(exclude=("speculative_attention",)))
    q = torch.randn(1, 8, 64)
    k = torch.randn(1, 2, 64)
    step = AttentionStep(16, [1], [0], [[0]], [0])
    cache = torch.zeros(kunlun.kv_cache_tensors(1, 16)[0].shape)
    meta = kunlun.build_metadata(step)
    kunlun.store_kv(k, k, (cache,), meta)
    with caplog.at_level(logging.WARNING, logger="kunlun_infer.plugin.kunlun"):
        out = kunlun.attend(q, k, k, (cache,), meta, scale=0.5)
    torch.testing.assert_close(out, k.repeat_interleave(4, dim=1))  # one key: softmax is 1, output is its value
    assert standin.calls["paged_attention"] == 0 and "scales by 1/sqrt(head_dim) only" in caplog.text


@pytest.mark.parametrize("missing,role", [(("reshape_and_cache_flash",), "store"),
                                          (("speculative_attention", "paged_attention"), "decode"),
                                          (("prefill_attention",), "prefill")])
def test_each_missing_kernel_falls_back_alone(standin, missing, role, caplog):
    with caplog.at_level(logging.WARNING, logger="kunlun_infer.plugin.kunlun"):
        kunlun = backend(library(exclude=missing))
    assert kunlun.calls[role] is None and f"{role}: torch" in kunlun.name
    assert sum(fn is not None for fn in kunlun.calls.values()) == 2
    assert caplog.text.count(f"lacks the kernel for {role}") == 1
    check_backend(kunlun, SPEC, CPU)
    assert all(standin.calls[f] == 0 for f in missing)


def test_no_backend_without_the_library_its_attention_kernels_or_a_served_head_size():
    assert KunlunOps(VendorKernels(None, reason="kunlun_ops is not installed")).attention_backend(SPEC) is None
    no_attention = library(exclude=("reshape_and_cache_flash", "speculative_attention", "paged_attention",
                                    "prefill_attention"))
    assert backend(no_attention) is None
    assert backend(spec=AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)) is None
    assert backend(spec=AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                                      kind="mla")) is None


# wrong calls the backend could make: each must be refused by the stand-in or give a wrong answer
def _keywords(**changes):
    def change(args, kwargs):
        for key, value in changes.items():
            kwargs[key] = value(kwargs) if callable(value) else value
        return args, kwargs
    return change


def _swap_caches(args, kwargs):
    args[2], args[3] = args[3], args[2]
    return args, kwargs


def _int64_slots(args, kwargs):
    args[4] = args[4].long()
    return args, kwargs


def _kv_lods_from_queries(args, kwargs):
    if kwargs.get("is_prefix_cache"):
        kwargs["context_kvlen_lod_cpu"], kwargs["context_kvlen_lod_xpu"] = (kwargs["context_qlen_lod_cpu"],
                                                                            kwargs["context_qlen_lod_xpu"])
    return args, kwargs


ATTENTION_MUTATIONS = {
    "store: token-major (BLHD) layout": ("reshape_and_cache_flash", _keywords(BLHD_LAYOUT=True)),
    "store: key and value caches swapped": ("reshape_and_cache_flash", _swap_caches),
    "store: int64 slots": ("reshape_and_cache_flash", _int64_slots),
    "decode: context lengths without the new token": (
        "speculative_attention", _keywords(context_lens_cpu=lambda kw: kw["context_lens_cpu"] - 1,
                                           context_lens_xpu=lambda kw: kw["context_lens_xpu"] - 1)),
    "decode: key and value caches swapped": (
        "speculative_attention", _keywords(k_cache=lambda kw: kw["v_cache"], v_cache=lambda kw: kw["k_cache"])),
    "decode: the scale passed as alpha-style 1.0": ("speculative_attention", _keywords(scale=1.0)),
    "prefill: the model's scale passed as alpha": ("prefill_attention", _keywords(alpha=SPEC.head_dim ** -0.5)),
    "prefill: query lods not starting at 0": (
        "prefill_attention", _keywords(context_qlen_lod_cpu=lambda kw: kw["context_qlen_lod_cpu"] + 1,
                                       context_qlen_lod_xpu=lambda kw: kw["context_qlen_lod_xpu"] + 1)),
    "prefill: key lods replaced by query lods": ("prefill_attention", _kv_lods_from_queries),
}


@pytest.mark.parametrize("mutation", list(ATTENTION_MUTATIONS))
def test_a_wrong_kernel_call_fails(mutation):
    function, change = ATTENTION_MUTATIONS[mutation]
    kernel = getattr(kunlun_ops_standin, function)

    @functools.wraps(kernel)  # the same signature: the backend inspects it
    def mutated(*args, **kwargs):
        args, kwargs = change(list(args), dict(kwargs))
        return kernel(*args, **kwargs)

    with pytest.raises((kunlun_ops_standin.Rejected, ConformanceError)):
        check_backend(backend(library(**{function: mutated})), SPEC, CPU)


def test_a_token_major_cache_is_refused():
    class TokenMajor(KunlunAttention):  # the 1.0 layout inside blocks: [blocks, block_size, kv_heads, head_dim]
        def kv_cache_tensors(self, num_blocks, block_size):
            (kv,) = super().kv_cache_tensors(num_blocks, block_size)
            return (type(kv)((2, num_blocks, block_size, SPEC.num_kv_heads, SPEC.head_dim), kv.dtype, "kv"),)

    with pytest.raises(kunlun_ops_standin.Rejected, match="head-major"):
        check_backend(TokenMajor(SPEC, VendorKernels(library())), SPEC, CPU)


def test_plugins_coverage_names_the_backend_and_where_each_call_runs(monkeypatch):
    def attention_of(module):
        monkeypatch.setitem(sys.modules, "kunlun_ops", module)
        return ops_coverage(PluginManager.load())["kunlun"]["attention"]

    assert attention_of(library()) == ("kunlun (store: kunlun_ops.reshape_and_cache_flash, decode: "
                                       "kunlun_ops.speculative_attention, prefill: kunlun_ops.prefill_attention)")
    assert "prefill: torch" in attention_of(library(exclude=("prefill_attention",)))
    assert attention_of(None) == "reference"  # without the library: the op table's torch store_kv/paged_attention
