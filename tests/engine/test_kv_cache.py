"""KV cache sizing and allocation: memory budget, concurrency cap, and the memory plugin's books."""

import pytest
import torch

from kunlun_infer.engine.engine import LLMEngine
from kunlun_infer.engine.kv_cache import KVLayout, blocks_for_budget
from kunlun_infer.errors import DeviceOutOfMemoryError, PluginError
from kunlun_infer.ops.attention import AttentionSpec, CacheTensorSpec
from kunlun_infer.ops.reference_attention import ReferenceAttentionBackend
from kunlun_infer.runtime import Runtime, compose_config
from tests.engine.tiny_models import engine_overrides

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
LAYOUT = KVLayout(num_layers=2, block_size=16, backend=ReferenceAttentionBackend(SPEC))


def test_block_bytes_cover_k_and_v_of_every_layer():
    assert LAYOUT.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    assert LAYOUT.nbytes(40) == 40 * LAYOUT.bytes_per_block


class FixedScratchBackend(ReferenceAttentionBackend):
    """A layout whose size does not grow with the blocks: a memory plan could not be made from it."""

    name = "fixed-scratch"

    def kv_cache_tensors(self, num_blocks, block_size):
        return (*super().kv_cache_tensors(num_blocks, block_size), CacheTensorSpec((1024,), torch.float32))


def test_a_layout_not_linear_in_the_blocks_is_refused_naming_the_backend():
    with pytest.raises(PluginError, match="attention backend 'fixed-scratch'.*same positive number of bytes"):
        KVLayout(2, 16, FixedScratchBackend(SPEC)).bytes_per_block


def test_memory_limits_the_blocks_after_activations():
    free = 100 * LAYOUT.bytes_per_block
    n = blocks_for_budget(LAYOUT, free_bytes=free, memory_fraction=0.5, activation_bytes=10 * LAYOUT.bytes_per_block,
                          max_num_seqs=64, max_model_len=4096)
    assert n == 40


def test_concurrency_caps_the_blocks_when_memory_is_plentiful():
    n = blocks_for_budget(LAYOUT, free_bytes=1 << 40, memory_fraction=0.9, activation_bytes=0,
                          max_num_seqs=4, max_model_len=100)
    assert n == 4 * 7


def test_no_room_for_a_single_block_is_a_clear_error():
    with pytest.raises(DeviceOutOfMemoryError, match="cache.memory_fraction"):
        blocks_for_budget(LAYOUT, free_bytes=LAYOUT.bytes_per_block, memory_fraction=0.5, activation_bytes=0,
                          max_num_seqs=1, max_model_len=16)


def test_kv_tensors_come_from_the_memory_plugin_and_go_back_on_close(tiny_model):
    cfg = compose_config(engine_overrides(model__path=str(tiny_model("llama")), cache__num_blocks=40))
    with Runtime.from_config(cfg) as runtime:
        before = runtime.memory.stats().allocated
        engine = LLMEngine(cfg, runtime=runtime)
        kv_bytes = 40 * LAYOUT.bytes_per_block
        assert runtime.memory.stats().allocated - before >= kv_bytes
        k_cache, v_cache = engine.runner.kv_caches[0]
        assert tuple(k_cache.shape) == (40, 16, 2, 16) and bool((v_cache == 0).all())
        engine.close()
        assert runtime.memory.stats().allocated == before
        assert not runtime.closed  # the engine leaves a runtime it was given open
