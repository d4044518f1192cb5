"""Every supported architecture computes transformers' logits through the paged cache."""

from __future__ import annotations

import pytest
import torch

from kunlun_infer.models import load_model
from tests.models.hf_factory import ARCHITECTURES, VOCAB_SIZE, load_hf_model
from tests.models.paged import PagedKV, hf_logits, max_relative_error

PROMPT_LENGTHS = [1, 3, 4, 5, 8, 9, 17, 40]  # around block size 4


def random_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for i, n in enumerate(lengths)}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_prefill_batch_and_decode_match_transformers(arch, hf_folder, runtime):
    folder, hf = hf_folder(arch)
    model = load_model(folder, runtime=runtime, dtype=torch.float32)
    kv = PagedKV(model, block_size=4)
    prompts = random_prompts(PROMPT_LENGTHS)

    out = kv.step(prompts)  # every prompt in one flat batch
    for i, tokens in prompts.items():
        assert max_relative_error(out[i], hf_logits(hf, tokens)) < 1e-4, f"prompt {i} ({len(tokens)} tokens)"

    for _ in range(2):  # decode steps read the K/V cached by the prefill
        chosen = {i: [int(out[i][-1].argmax())] for i in prompts}
        out = kv.step(chosen)
        for i in prompts:
            prompts[i] += chosen[i]
            assert max_relative_error(out[i], hf_logits(hf, prompts[i])[-1:]) < 1e-4


def test_chunked_prefill_mixed_with_decode(hf_folder, runtime):
    folder, hf = hf_folder("llama")
    model = load_model(folder, runtime=runtime, dtype=torch.float32)
    kv = PagedKV(model, block_size=4)
    long, short = random_prompts([23, 6], seed=3).values()
    kv.step({1: short})
    first = kv.step({0: long[:7], 1: [5]})  # first chunk of one prompt beside a decode step
    rest = kv.step({0: long[7:]})  # the rest attends to the cached first chunk
    reference = hf_logits(hf, long)
    assert max_relative_error(first[0], reference[:7]) < 1e-4
    assert max_relative_error(rest[0], reference[7:]) < 1e-4
    assert max_relative_error(first[1], hf_logits(hf, short + [5])[-1:]) < 1e-4


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_half_precision_checkpoint(dtype, tolerance, hf_folder, runtime):
    # rounding differs from transformers' in low precision; the bound is about its own distance from fp32
    folder, hf = hf_folder("qwen3", dtype=dtype)
    prompts = random_prompts([5, 12], seed=1)

    model = load_model(folder, runtime=runtime, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    out = PagedKV(model, block_size=4).step(prompts)
    for i, tokens in prompts.items():
        assert max_relative_error(out[i], hf_logits(hf, tokens)) < tolerance

    upcast = load_model(folder, runtime=runtime, dtype=torch.float32)  # bf16 weights computed in fp32
    out = PagedKV(upcast, block_size=4).step(prompts)
    hf32 = load_hf_model(folder, torch.float32)
    for i, tokens in prompts.items():
        assert max_relative_error(out[i], hf_logits(hf32, tokens)) < 1e-4


def test_model_reports_its_cache_geometry(hf_folder, runtime):
    folder, _ = hf_folder("qwen3")
    model = load_model(folder, runtime=runtime, dtype=torch.float32)
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, 32)
    assert set(model.required_ops) <= set(runtime.resolve_ops(model.required_ops).ops)
    params = list(model.parameters())
    # the ops plugin may repack linear weights (then the originals are gone): each tensor counted once
    repacked = [m.packed_weight for m in model.modules() if isinstance(getattr(m, "packed_weight", None), torch.Tensor)
                and all(m.packed_weight.data_ptr() != p.data_ptr() for p in params)]
    assert model.weight_nbytes() == sum(t.numel() * 4 for t in params + repacked)


@pytest.mark.parametrize("arch, overrides", [("llama", {"attention_bias": True, "mlp_bias": True}),
                                             ("qwen3", {"attention_bias": True, "tie_word_embeddings": True}),
                                             ("llama", {"num_key_value_heads": 4, "head_dim": 8})])
def test_config_variants_match_transformers(arch, overrides, hf_folder, runtime):
    folder, hf = hf_folder(arch, **overrides)
    model = load_model(folder, runtime=runtime, dtype=torch.float32)
    prompts = random_prompts([2, 11], seed=5)
    out = PagedKV(model, block_size=4).step(prompts)
    for i, tokens in prompts.items():
        assert max_relative_error(out[i], hf_logits(hf, tokens)) < 1e-4
