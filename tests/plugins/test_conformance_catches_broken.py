"""The conformance suite fails a plugin that is wrong, saying which op, dtype and tolerance."""

from __future__ import annotations

import textwrap

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
        "*op 'linear' (torch.bfloat16, tolerance rtol=0.02 atol=0.02) via linear(x, pack(w), b)*",
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
