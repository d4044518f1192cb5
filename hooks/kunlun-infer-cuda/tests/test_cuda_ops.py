"""The CUDA op table against the references, run on CPU tensors (the kernels name no device)."""

import math

import pytest
import torch

from kunlun_infer.engine.sampler import SAMPLER_OPS
from kunlun_infer.layers.quantization import INT8_OPS
from kunlun_infer.ops import OP_SPECS, TOLERANCES, reference

from kunlun_infer_cuda.ops import KERNELS, TorchCudaOps


def test_covers_the_whole_table():
    # int8 ops (API 1.3) and the sampler's (1.8; torch's own argmax on the device): references
    assert set(TorchCudaOps().available()) == set(OP_SPECS) - set(INT8_OPS) - set(SAMPLER_OPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", sorted(set(KERNELS) - {"pack_moe_weights"}))  # that one: through fused_moe
def test_each_kernel_matches_its_reference(op, dtype):
    spec = OP_SPECS[op]
    rtol, atol = TOLERANCES[dtype]
    for seed in range(3):
        args, kwargs = spec.sample(dtype, torch.device("cpu"), torch.Generator().manual_seed(seed))
        ref_args, _ = spec.sample(dtype, torch.device("cpu"), torch.Generator().manual_seed(seed))
        if op == "linear":
            args = (args[0], KERNELS["pack_linear_weight"](args[1]), *args[2:])
        if op == "fused_moe":
            args = (args[0], KERNELS["pack_moe_weights"](*args[1]), *args[2:])
        got, want = KERNELS[op](*args, **kwargs), spec.reference(*ref_args, **kwargs)
        if spec.in_place_arg is not None:
            got, want = args[spec.in_place_arg], ref_args[spec.in_place_arg]
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert g.dtype == w.dtype and g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


@pytest.mark.parametrize("hq,hk", [(8, 8), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_sdpa_paged_attention_on_mixed_batches(hq, hk):
    """Prefills, chunked prefills and decodes in one batch, with garbage in unused block-table entries."""
    g = torch.Generator().manual_seed(7)
    block_size, num_blocks, d = 8, 40, 32
    seqs = [(1, 1), (17, 17), (33, 1), (20, 5), (8, 8), (9, 1)]  # (context incl. new tokens, new tokens)
    max_blocks = max(math.ceil(c / block_size) for c, _ in seqs) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.randint(10_000, 20_000, (len(seqs), max_blocks), generator=g, dtype=torch.int32)
    for i, (ctx, _) in enumerate(seqs):
        for b in range(math.ceil(ctx / block_size)):
            tables[i, b] = perm.pop()
    qsl = torch.tensor([0, *itertools_accumulate([q for _, q in seqs])], dtype=torch.int32)
    lens = torch.tensor([c for c, _ in seqs], dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, hk, d, generator=g)
    v_cache = torch.randn(num_blocks, block_size, hk, d, generator=g)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g)
    got = KERNELS["paged_attention"](q, k_cache, v_cache, tables, lens, qsl, d ** -0.5)
    safe_tables = tables.clamp(max=num_blocks - 1)  # the reference reads only the used entries anyway
    want = reference.paged_attention(q, k_cache, v_cache, safe_tables, lens, qsl, d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def itertools_accumulate(values):
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out
