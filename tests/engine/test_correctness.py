"""Greedy tokens equal transformers' for Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral and DeepSeek-V2/V3, under every
scheduling path, on every platform.

Nine prompts of varied lengths (one token, around the 16-token block size,
a few hundred tokens) are generated together and compared with
``transformers``' greedy ``generate`` on each prompt alone. The same
references must come out with chunked prefill, without prefix caching, with
prompts that hit the prefix cache, and with a KV cache so small that
sequences are preempted and recomputed — on the built-in CPU plugins and on
the simulated chip, whose attention backend keeps its own cache layout
(``tests/platforms.py``; DeepSeek's latent attention runs there on the
framework's reference MLA backend).
"""

import pytest
import torch

from tests.engine.tiny_models import hf_greedy
from kunlun_infer import SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"]
PROMPT_LENGTHS = [1, 15, 16, 17, 32, 33, 70, 150, 300]
MAX_TOKENS = 10


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def references(tiny_model, hf_model):
    cache = {}

    def get(arch):
        if arch not in cache:
            model = hf_model(tiny_model(arch))
            cache[arch] = [hf_greedy(model, p, MAX_TOKENS) for p in prompts()]
        return cache[arch]

    return get


def generate(llm):
    outputs = llm.generate(prompts(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_running"] == stats["num_waiting"] == 0
    return [o.token_ids for o in outputs], stats


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_varied_prompts_matches_transformers(arch, platform, tiny_model, make_llm, references):
    tokens, _ = generate(make_llm(tiny_model(arch), **platform))
    assert tokens == references(arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_gives_the_same_tokens(arch, platform, tiny_model, make_llm, references):
    tokens, stats = generate(make_llm(tiny_model(arch), scheduler__max_num_batched_tokens=24, **platform))
    assert tokens == references(arch)
    assert stats["num_steps"] > 300 // 24  # the long prompt really was cut into chunks


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_caching_off_gives_the_same_tokens(arch, tiny_model, make_llm, references):
    tokens, stats = generate(make_llm(tiny_model(arch), cache__prefix_caching="false"))
    assert tokens == references(arch)
    assert stats["prefix_cache_hit_tokens"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_give_the_same_tokens(arch, platform, tiny_model, hf_model, make_llm):
    g = torch.Generator().manual_seed(2)
    system = torch.randint(0, 256, (40,), generator=g).tolist()  # two full blocks and a partial one
    prompts = [system + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 30)]
    llm = make_llm(tiny_model(arch), **platform)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)  # chunked prefills on top of cached blocks
    assert all(o.num_cached_tokens == 32 for o in rest)
    hf = hf_model(tiny_model(arch))
    assert [o.token_ids for o in first + rest] == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_kv_cache_preempts_and_still_gives_the_same_tokens(arch, platform, tiny_model, make_llm, references):
    # 21 blocks of 16 tokens hold the longest request (310 tokens) but not the batch (~48 blocks)
    tokens, stats = generate(make_llm(tiny_model(arch), cache__num_blocks=21, **platform))
    assert stats["num_preemptions"] > 0
    assert tokens == references(arch)
