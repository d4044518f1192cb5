"""Four ranks: KV heads replicated when there are fewer than ranks, vocabulary padded; logits still transformers'.

Runs the four ranks as threads of this process with the thread comm of the
model tests (no processes), so it is quick.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.paged import PagedKV, hf_logits, max_relative_error
from tests.models.test_tensor_parallel import load_rank, run_ranks


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # 2 KV heads (each on two ranks), 1 KV head (on all four)
def test_four_ranks_with_replicated_kv_heads_compute_transformers_logits(arch, tiny_model):
    import transformers as tf

    folder = tiny_model(arch)
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(2)
    prompts = {i: torch.randint(0, 256, (n,), generator=g).tolist() for i, n in enumerate([1, 9, 20])}

    def rank(r, comm):
        model = load_rank(folder, r, comm, tp_size=4)
        qkv = model.model.layers[0].self_attn.qkv_proj
        kv = PagedKV(model, block_size=4)
        return model.num_kv_heads, qkv.packed_weight[qkv.q_size:qkv.q_size + qkv.kv_size].clone(), \
            kv.step(prompts), kv.step({i: [9] for i in prompts})

    results = run_ranks(rank, world_size=4)
    assert [r[0] for r in results] == [1, 1, 1, 1]
    k_full = hf.model.layers[0].self_attn.k_proj.weight.detach()
    head_dim = k_full.shape[0] // hf.config.num_key_value_heads
    replicas = 4 // hf.config.num_key_value_heads
    for r, (_, k_part, _, _) in enumerate(results):  # rank r holds the KV head its query heads use
        head = r // replicas
        assert torch.equal(k_part, k_full[head * head_dim:(head + 1) * head_dim])
    _, _, prefill, decode = results[0]
    for i, tokens in prompts.items():
        assert max_relative_error(prefill[i], hf_logits(hf, tokens)) < 1e-4
        assert max_relative_error(decode[i], hf_logits(hf, tokens + [9])[-1:]) < 1e-4
