"""``model.quantization=int8``: smaller weights, logits close to the unquantized model, on every kernel set.

The int8 kernels themselves equal the reference bit for bit
(``tests/plugins/test_cpu_kernels.py``); here a whole model is quantized at
load and compared with transformers' unquantized logits, its weights are
counted, the head and embedding switches are honoured, and a plugin written
before the int8 ops existed still serves a quantized model through the
references.
"""

from __future__ import annotations

import pytest
import torch

from kunlun_infer.layers.quantization import Quantization
from kunlun_infer.models import load_model
from kunlun_infer.plugins import cpu_gemm
from kunlun_infer.testing import build_runtime
from tests.kernel_sets import kernel_set  # noqa: F401 - fixture
from tests.models.paged import PagedKV, hf_logits, max_relative_error

PROMPTS = {0: [5, 9, 2, 7, 11, 3], 1: list(range(3, 20))}


def _logits(model) -> dict[int, torch.Tensor]:
    kv = PagedKV(model, block_size=4)
    out = kv.step(PROMPTS)
    decode = kv.step({i: [int(out[i][-1].argmax())] for i in PROMPTS})  # one decode step on top of the prefill
    return {i: torch.cat([out[i], decode[i]]) for i in PROMPTS}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch, overrides", [("qwen3", {"tie_word_embeddings": True}), ("llama", {})])
def test_int8_model_is_close_to_transformers_and_its_weights_shrink(hf_folder, kernel_set, dtype, arch, overrides):
    folder, hf = hf_folder(arch, dtype=dtype, **overrides)
    with build_runtime(["ops=cpu"]) as rt:
        full = load_model(folder, runtime=rt, dtype=dtype)
        int8 = load_model(folder, runtime=rt, dtype=dtype, quantization=Quantization())
        full_logits, int8_logits = _logits(full), _logits(int8)
        linears = [m for m in int8.modules() if hasattr(m, "packed_weight")]
        assert linears and all(m.packed_weight is not None and getattr(m, "weight", None) is None for m in linears)
        if kernel_set != "torch":  # packed for the native int8 GEMM of the chosen set
            assert all(cpu_gemm.is_packed_int8(m.packed_weight) for m in linears)
        assert int8.model.embed_tokens.qweight.dtype == torch.int8 and int8.model.embed_tokens.weight is None
        # int8 values and a float32 scale per row, against 2 or 4 bytes per value
        assert int8.weight_nbytes() < (0.62 if dtype is torch.bfloat16 else 0.32) * full.weight_nbytes()
    hf32 = hf.float()
    for i, tokens in PROMPTS.items():
        want = hf_logits(hf32, tokens + [int(full_logits[i][len(tokens) - 1].argmax())])
        full_error = max_relative_error(full_logits[i], want)
        int8_error = max_relative_error(int8_logits[i], want)
        # random weights are the hard case for int8 (no structure to spare); the trained default model loses
        # well under 1% of its validation loss (tests/models/test_quantization_default_model.py)
        assert int8_error < 0.08, (full_error, int8_error)
        assert int8_error > full_error  # the quantization is really applied


def test_head_and_embedding_switches(hf_folder):
    folder, _ = hf_folder("qwen3", tie_word_embeddings=True)
    with build_runtime(["ops=torch"]) as rt:  # reference kernels: packed weights are the (int8, scale) pairs
        full = load_model(folder, runtime=rt, dtype=torch.float32)
        head_only = load_model(folder, runtime=rt, dtype=torch.float32,
                               quantization=Quantization(head=True, embedding=False))
        assert head_only.model.embed_tokens.qweight is None and head_only.model.embed_tokens.weight is not None
        assert head_only.lm_head.packed_weight[0].dtype == torch.int8
        neither = load_model(folder, runtime=rt, dtype=torch.float32,
                             quantization=Quantization(head=False, embedding=False))
        assert neither.lm_head.packed_weight.dtype == torch.float32
        both = load_model(folder, runtime=rt, dtype=torch.float32, quantization=Quantization())
        # the tied head reuses the embedding's int8 rows: counted once
        assert both.lm_head.packed_weight[0].data_ptr() == both.model.embed_tokens.qweight.data_ptr()
        table = full.model.embed_tokens.weight.numel()
        assert head_only.weight_nbytes() - both.weight_nbytes() == 4 * table  # the float32 table kept for lookups
        ids = torch.tensor([3, 0, 7, 3])
        rows = both.model.embed_tokens(ids)
        assert rows.dtype == torch.float32
        half_step = full.model.embed_tokens.weight.abs().max() / 254  # at most half a step of the row's scale
        assert (rows - full.model.embed_tokens(ids)).abs().max() <= half_step * 1.001


def test_quantization_config_is_checked_and_reaches_the_engine():
    import kunlun_infer as ki
    from kunlun_infer.runtime import compose_config

    assert Quantization.from_config(compose_config([]).model) is None
    assert Quantization.from_config(compose_config(["model.quantization=int8", "model.quantize_head=false"]).model) \
        == Quantization("int8", head=False, embedding=True)
    with pytest.raises(ki.ConfigError, match=r"model.quantization=.?int4.*none, int8"):
        ki.LLM(overrides=["model.quantization=int4"])
    with ki.LLM(overrides=["model.quantization=int8"]) as llm:
        assert llm.engine.quantization == Quantization()
        assert llm.engine.runner.model.model.embed_tokens.qweight is not None
        out = llm.generate("def add(a, b):", ki.SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
        assert len(out.token_ids) == 8


def _plan(*argv: str) -> dict:
    import io
    import json

    from kunlun_infer.cli import main

    out = io.StringIO()
    assert main(["plan", "--json", *argv], stdout=out, stderr=io.StringIO()) == 0
    return json.loads(out.getvalue())


def test_plan_counts_the_int8_weights():
    full, int8 = _plan(), _plan("model.quantization=int8")  # the weights as loaded
    assert int8["quantization"] == "int8" and full["quantization"] is None
    assert full["weight_source"] == int8["weight_source"] == "loaded"
    # the default model is float32: int8 weights take about a quarter, the norms stay float32
    assert 0.2 * full["weights"] < int8["weights"] < 0.3 * full["weights"]
    # from the model's shapes alone, on a given memory: the same count, and what it frees goes to the KV cache
    full_given = _plan("--device-memory", "1GiB")
    int8_given = _plan("--device-memory", "1GiB", "model.quantization=int8")
    assert int8_given["weight_source"] == "config"
    assert abs(int8_given["weights"] - int8["weights"]) < 0.02 * int8["weights"]
    assert int8_given["kv_cache"] - full_given["kv_cache"] == full_given["weights"] - int8_given["weights"]
