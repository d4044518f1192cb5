"""The partial op set: what it covers matches the references; what it lacks it says it lacks."""

import pytest
import torch

from kunlun_infer.layers.moe import MOE_OPS
from kunlun_infer.engine.sampler import SAMPLER_OPS
from kunlun_infer.layers.quantization import INT8_OPS
from kunlun_infer.ops import OP_SPECS, TOLERANCES

from kunlun_infer_simchip.ops import KERNELS, MISSING_OPS, SimchipOps


def test_coverage_is_deliberately_partial():
    ops = SimchipOps()
    # int8 ops (API 1.3), mixture-of-experts ops (1.4) and the sampler's (1.8) arrived after the chip's plugin:
    # references
    assert set(ops.available()) == (set(OP_SPECS) - set(MISSING_OPS) - set(INT8_OPS) - set(MOE_OPS)
                                    - set(SAMPLER_OPS))
    assert not ops.supports("paged_attention") and not ops.supports("rotary_embedding")
    assert ops.supports("linear") and ops.supports("pack_linear_weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", sorted(KERNELS))
def test_each_kernel_matches_its_reference(op, dtype):
    spec = OP_SPECS[op]
    rtol, atol = TOLERANCES[dtype]
    for seed in range(3):
        args, kwargs = spec.sample(dtype, torch.device("cpu"), torch.Generator().manual_seed(seed))
        ref_args, _ = spec.sample(dtype, torch.device("cpu"), torch.Generator().manual_seed(seed))
        if op == "linear":
            args = (args[0], KERNELS["pack_linear_weight"](args[1]), *args[2:])
        got = KERNELS[op](*args, **kwargs)
        want = spec.reference(*ref_args, **kwargs)
        if spec.in_place_arg is not None:
            got, want = args[spec.in_place_arg], ref_args[spec.in_place_arg]
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert g.dtype == w.dtype and g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
