"""The ``cpu`` ops option: tuned host kernels agree with the plain-torch references and serve a model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kunlun_infer.ops import reference
from kunlun_infer.plugins import cpu_kernels
from kunlun_infer.testing import build_runtime, check_ops
from tests.plugins.test_torch_ops import _batch

needs_onednn = pytest.mark.skipif(not cpu_kernels.onednn_linear_available(),
                                  reason="this torch build has no oneDNN prepacked linear")


def test_cpu_ops_cover_and_conform_in_every_dtype():
    with build_runtime(["ops=cpu"]) as rt:
        checked = check_ops(rt.ops, rt.device)
    assert {op for op, _ in checked} >= {"rms_norm", "paged_attention", "linear", "store_kv"}
    assert len({dtype for _, dtype in checked}) == 3


@pytest.mark.parametrize("seqs", [
    [(5, 1), (17, 1), (1, 1), (40, 1)],  # decode only, ragged lengths
    [(9, 9), (1, 1)],  # a prompt beside a one-token prompt
    [(12, 4), (7, 1), (30, 30), (3, 1)],  # chunked prefill, decode and prefill mixed
])
@pytest.mark.parametrize("hq, hk", [(4, 4), (8, 2), (6, 1)])
def test_paged_attention_matches_reference(seqs, hq, hk):
    args = _batch(seqs, hq=hq, hk=hk)
    torch.testing.assert_close(cpu_kernels.paged_attention(*args), reference.paged_attention(*args),
                               rtol=1e-4, atol=1e-5)


def test_paged_attention_low_precision_keeps_its_dtype_and_accuracy():
    args = _batch([(6, 1), (8, 3), (33, 1), (20, 20)], hq=8, hk=2, dtype=torch.bfloat16)
    out = cpu_kernels.paged_attention(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference.paged_attention(*args), rtol=2e-2, atol=2e-2)


@needs_onednn
def test_bf16_weights_are_prepacked_and_multiply_like_f_linear():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=g).to(torch.bfloat16)
    bias = torch.randn(48, generator=g).to(torch.bfloat16)
    packed = cpu_kernels.pack_linear_weight(weight)
    assert packed is not weight and packed.shape == weight.shape
    for rows in (1, 7, 64):
        x = torch.randn(rows, 40, generator=g).to(torch.bfloat16)
        out = cpu_kernels.linear(x, packed, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 48)
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=2e-2, atol=2e-2)


def test_float32_weights_stay_as_they_are():
    weight = torch.randn(8, 4)
    assert cpu_kernels.pack_linear_weight(weight) is weight
    x = torch.randn(3, 4)
    torch.testing.assert_close(cpu_kernels.linear(x, weight), F.linear(x, weight))


@needs_onednn
def test_bf16_model_on_cpu_ops_matches_transformers_and_counts_packed_weights(tmp_path):
    from kunlun_infer.models import load_model
    from tests.models.hf_factory import build_hf_model
    from tests.models.paged import PagedKV, hf_logits, max_relative_error

    hf = build_hf_model(tmp_path, "qwen3", dtype=torch.bfloat16, tie_word_embeddings=True)
    with build_runtime(["ops=cpu"]) as rt:
        model = load_model(tmp_path, runtime=rt, dtype=torch.bfloat16)
        # every linear weight was replaced by its packed copy; the tied embedding is kept beside the LM head's
        params = sum(p.numel() for p in hf.parameters())
        embedding = hf.get_input_embeddings().weight.numel()
        assert model.weight_nbytes() == 2 * (params + embedding)
        prompts = {0: [5, 9, 2, 7, 11], 1: list(range(3, 15))}
        out = PagedKV(model, block_size=4).step(prompts)
    for i, tokens in prompts.items():
        assert max_relative_error(out[i], hf_logits(hf, tokens)) < 3e-2
