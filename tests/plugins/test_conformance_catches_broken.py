"""The conformance suite fails a plugin that is wrong, saying which op, dtype and tolerance."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from kunlun_infer.capabilities import DictOpsProvider
from kunlun_infer.ops import OP_SPECS, reference
from kunlun_infer.testing import ConformanceError, check_op

BROKEN_OPS_PLUGIN = '''
from kunlun_infer.capabilities import DictOpsProvider
from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.ops import OP_SPECS


def rms_norm_off_by_half(x, weight, eps):
    return OP_SPECS["rms_norm"].reference(x, weight, eps) + 0.5


def pack_doubles(weight):
    return weight * 2


@hookimpl
def kunlun_infer_plugin_info():
    return PluginInfo(name="broken", version="0.0.1", capabilities=("ops",))


@hookimpl
def kunlun_infer_ops_factories():
    kernels = {name: spec.reference for name, spec in OP_SPECS.items()}
    kernels.update(rms_norm=rms_norm_off_by_half, pack_linear_weight=pack_doubles)
    return {"broken": lambda *, config, device: DictOpsProvider(kernels)}
'''


def test_suite_run_fails_a_broken_ops_plugin_naming_op_dtype_and_tolerance(pytester):
    pytester.makepyfile(broken_ops=textwrap.dedent(BROKEN_OPS_PLUGIN))
    result = pytester.runpytest_subprocess(
        "--pyargs", "kunlun_infer.testing.suite", "-k", "op_matches_reference", "-p", "no:cacheprovider",
        "--kunlun-register", "broken_ops", "--kunlun-plugin", "ops=broken")
    outcomes = result.parseoutcomes()
    assert result.ret != 0
    assert outcomes["failed"] == 9  # rms_norm, pack_linear_weight and linear (checked as a pair), 3 dtypes each
    assert outcomes["passed"] == 3 * (len(OP_SPECS) - 3)
    result.stdout.fnmatch_lines([
        "*op 'rms_norm' (torch.float32, tolerance rtol=0.0001 atol=1e-05)*beyond tolerance*",
        "*op 'linear' (torch.bfloat16, tolerance rtol=0.02 atol=0.02) via linear(x, pack(w), ...)*",
    ])


def test_check_op_compares_the_argument_an_in_place_op_mutates():
    def store_kv_forgets_values(key, value, k_cache, v_cache, slot_mapping):
        reference.store_kv(key, value, k_cache, torch.zeros_like(v_cache), slot_mapping)

    provider = DictOpsProvider({"store_kv": store_kv_forgets_values})
    with pytest.raises(ConformanceError, match=r"op 'store_kv' \(torch.float32.*argument 3 \(updated in place\)"):
        check_op(provider, "store_kv", torch.float32, torch.device("cpu"))


def test_check_op_reports_wrong_shape_and_dtype():
    provider = DictOpsProvider({"silu_and_mul": lambda x: reference.silu_and_mul(x).float()})
    with pytest.raises(ConformanceError, match=r"op 'silu_and_mul' \(torch.bfloat16.*torch.float32.*reference gives"):
        check_op(provider, "silu_and_mul", torch.bfloat16, torch.device("cpu"))


def test_packing_without_linear_is_refused():
    provider = DictOpsProvider({"pack_linear_weight": reference.pack_linear_weight})
    with pytest.raises(ConformanceError, match="packs weights but has no 'linear'"):
        check_op(provider, "pack_linear_weight", torch.float32, torch.device("cpu"))


def test_attention_backend_check_passes_a_faithful_layout_and_names_a_wrong_store():
    from tests.tools.padded_attention_plugin import PaddedOps

    from kunlun_infer.plugins.cpu_device import CpuDevice
    from kunlun_infer.testing import check_attention_backend

    device = CpuDevice()
    checked = check_attention_backend(PaddedOps("padded"), device, dtypes=[torch.float32, torch.bfloat16])
    assert [(s.num_heads, s.num_kv_heads, s.dtype) for s in checked] == [
        (8, 2, torch.float32), (8, 2, torch.bfloat16), (4, 4, torch.float32), (4, 4, torch.bfloat16)]
    # keys overwritten by values: the first step attends over its own new keys and may pass; a later one cannot
    with pytest.raises(ConformanceError, match=r"attention backend 'padded' \(8 query / 2 kv heads of 64, "
                                               r"torch.float32.*step \d \(.*\): attend output differs"):
        check_attention_backend(PaddedOps("padded-broken", broken=True), device, dtypes=[torch.float32])


def test_attention_backend_check_refuses_a_bad_batch_order_and_a_nonlinear_cache():
    from tests.tools.padded_attention_plugin import PaddedBackend

    from kunlun_infer.ops.attention import AttentionSpec, CacheTensorSpec
    from kunlun_infer.testing.attention import check_backend

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)

    class Repeats(PaddedBackend):
        def order_batch(self, query_lens, context_lens):
            return [0] * len(query_lens)

    class Scratch(PaddedBackend):
        def kv_cache_tensors(self, num_blocks, block_size):
            return (*super().kv_cache_tensors(num_blocks, block_size), CacheTensorSpec((64,), torch.float32))

    with pytest.raises(ConformanceError, match=r"order_batch returned \[0, 0, 0\], not a permutation"):
        check_backend(Repeats(spec), spec, torch.device("cpu"))
    with pytest.raises(ConformanceError, match="same positive bytes per block"):
        check_backend(Scratch(spec), spec, torch.device("cpu"))


def test_suite_run_fails_a_broken_attention_backend(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[2]))  # the test plugin lives in this checkout
    result = pytester.runpytest_subprocess(
        "--pyargs", "kunlun_infer.testing.suite", "-k", "attention_backend", "-p", "no:cacheprovider",
        "--kunlun-register", "tests.tools.padded_attention_plugin", "--kunlun-plugin", "ops=padded-broken")
    outcomes = result.parseoutcomes()
    # 2 head shapes × 3 dtypes: every dtype the host computes in fails, the others are skipped; and the
    # 2 × 3 MLA cases skip: the plugin predates MLA (its MHA backend for every spec is no MLA backend)
    assert outcomes["failed"] >= 2 and outcomes["failed"] + outcomes.get("skipped", 0) == 12
    assert "passed" not in outcomes
    result.stdout.fnmatch_lines(["*attention backend 'padded'*attend output differs from the reference*"])


def test_check_op_catches_a_token_bitmask_read_in_the_wrong_bit_order():
    def bits_reversed(logits, bitmask, rows):
        flipped = torch.zeros_like(bitmask)
        for j in range(32):  # bit j of each word read as bit 31 - j
            flipped |= ((bitmask >> j) & 1) << (31 - j)
        reference.apply_token_bitmask(logits, flipped, rows)

    provider = DictOpsProvider({"apply_token_bitmask": bits_reversed})
    with pytest.raises(ConformanceError, match=r"op 'apply_token_bitmask'.*argument 0 \(updated in place\)"):
        check_op(provider, "apply_token_bitmask", torch.float32, torch.device("cpu"))
    check_op(DictOpsProvider({"apply_token_bitmask": reference.apply_token_bitmask}), "apply_token_bitmask",
             torch.float32, torch.device("cpu"))


def test_mla_backend_check_passes_the_cpu_backend_and_names_a_wrong_one():
    from kunlun_infer.ops.attention import mla_spec
    from kunlun_infer.plugins.torch_mla import TorchMLABackend
    from kunlun_infer.testing.attention import check_backend

    spec = mla_spec(num_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, kv_lora_rank=32, v_head_dim=12,
                    dtype=torch.float32)
    check_backend(TorchMLABackend(spec), spec, torch.device("cpu"))

    class DropsRotaryKey(TorchMLABackend):  # caches the latent but not the rotary key
        def store_latent(self, latent, k_rope, kv_cache, metadata):
            super().store_latent(latent, torch.zeros_like(k_rope), kv_cache, metadata)

    class ValueFromKeyHalf(TorchMLABackend):  # decompresses values with the key half of the up-projection
        def attend_latent(self, q_nope, q_rope, latent, k_rope, kv_cache, metadata, *, kv_up, scale):
            nope = q_nope.shape[-1]
            swapped = torch.cat([kv_up[:, :nope], kv_up[:, :kv_up.shape[1] - nope]], dim=1)
            return super().attend_latent(q_nope, q_rope, latent, k_rope, kv_cache, metadata, kv_up=swapped,
                                         scale=scale)

    for broken in (DropsRotaryKey, ValueFromKeyHalf):
        with pytest.raises(ConformanceError, match=r"MLA attention backend 'torch-mla' \(4 heads.*attend_latent "
                                                   r"output differs"):
            check_backend(broken(spec), spec, torch.device("cpu"))


def test_check_op_requires_indices_to_match_exactly_at_every_dtype():
    """An argmax one token off is wrong whatever the dtype's tolerance (2e-2 relative in bf16 would pass an index
    of 100 for 101), and so is a last-of-ties argmax."""
    def one_past(logits):
        return reference.greedy_tokens(logits) + 1

    def last_of_ties(logits):
        flipped = logits.flip(-1)
        return logits.shape[-1] - 1 - reference.greedy_tokens(flipped)

    for broken in (one_past, last_of_ties):
        for dtype in (torch.float32, torch.bfloat16):
            with pytest.raises(ConformanceError, match=rf"op 'greedy_tokens' \({dtype}.*exact match required"):
                check_op(DictOpsProvider({"greedy_tokens": broken}), "greedy_tokens", dtype, torch.device("cpu"))
    check_op(DictOpsProvider({"greedy_tokens": reference.greedy_tokens}), "greedy_tokens", torch.bfloat16,
             torch.device("cpu"))


def test_check_op_catches_a_draw_that_departs_from_the_reference():
    """``sample_tokens``' samples put each uniform mid-way through a token's share, so a kernel that draws from
    another distribution or reads its uniforms otherwise picks another token: one that ignores top-p, one that
    ignores the temperature, and one that swaps a row's two uniforms are each refused, and the reference passes."""
    def ignores_top_p(logits, temperature, top_k, top_p, min_p, uniforms):
        return reference.sample_tokens(logits, temperature, top_k, torch.ones_like(top_p), min_p, uniforms)

    def ignores_temperature(logits, temperature, top_k, top_p, min_p, uniforms):
        return reference.sample_tokens(logits, (temperature > 0).float(), top_k, top_p, min_p, uniforms)

    def swaps_uniforms(logits, temperature, top_k, top_p, min_p, uniforms):
        return reference.sample_tokens(logits, temperature, top_k, top_p, min_p, uniforms.flip(-1))

    for broken in (ignores_top_p, ignores_temperature, swaps_uniforms):
        with pytest.raises(ConformanceError, match=r"op 'sample_tokens' \(torch.float32.*exact match required"):
            for seed in range(2):  # (a swap of uniforms shows only where a row spans blocks: the first sample's)
                check_op(DictOpsProvider({"sample_tokens": broken}), "sample_tokens", torch.float32,
                         torch.device("cpu"), seed=seed)
    for seed in range(2):
        check_op(DictOpsProvider({"sample_tokens": reference.sample_tokens}), "sample_tokens", torch.float32,
                 torch.device("cpu"), seed=seed)
