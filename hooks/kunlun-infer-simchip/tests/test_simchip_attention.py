"""The chip's attention backend: Kunlun's cache layout, decodes first, and kernels that refuse a wrong call."""

import pytest
import torch

from kunlun_infer.ops.attention import AttentionSpec
from kunlun_infer.ops.attention_step import AttentionStep
from kunlun_infer.testing.attention import check_backend

from kunlun_infer_simchip import attention_kernels as kernels
from kunlun_infer_simchip.attention import SimchipAttentionBackend
from kunlun_infer_simchip.ops import SimchipOps

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
BLOCK = 4


def backend():
    return SimchipOps().attention_backend(SPEC)


def cache(num_blocks=6):
    (tensor,) = backend().kv_cache_tensors(num_blocks, BLOCK)
    return torch.zeros(tensor.shape, dtype=tensor.dtype)


def test_one_head_major_cache_per_layer_and_decodes_first():
    (tensor,) = backend().kv_cache_tensors(10, BLOCK)
    assert tensor.shape == (2, 10, 2, BLOCK, 8) and tensor.dtype == torch.float32
    assert list(backend().order_batch([5, 1, 3, 1], [0, 9, 4, 2])) == [1, 3, 0, 2]


def test_a_stored_key_lands_head_major_in_its_block():
    b, kv = backend(), cache()
    step = AttentionStep(BLOCK, [3], [0], [[4, 2]], [4 * BLOCK + 0, 4 * BLOCK + 1, 4 * BLOCK + 2])
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    b.store_kv(key, value, (kv,), b.build_metadata(step))
    for t in range(3):
        assert torch.equal(kv[0, 4, :, t], key[t]) and torch.equal(kv[1, 4, :, t], value[t])
    assert int((kv != 0).sum()) == 2 * 3 * 2 * 8  # nothing else written


def test_metadata_has_int32_lengths_on_host_and_device_split_at_the_decodes():
    step = AttentionStep(BLOCK, [1, 1, 5, 2], [6, 2, 0, 4], [[0, 1], [2], [3, 4], [5, 0]], list(range(9)))
    meta = backend().build_metadata(step)
    assert meta.slot_mapping.dtype == torch.int32
    assert meta.decode.num == 2 and meta.decode.context_lens_host.tolist() == [7, 3]
    assert meta.decode.context_lens_device.dtype == meta.decode.block_tables.dtype == torch.int32
    assert meta.prefill.q_lod_host.tolist() == [0, 5, 7]
    assert meta.prefill.kv_lod_host.tolist() == [0, 5, 11]  # prefix mode: one prefill has cached context
    assert meta.prefill.block_tables.tolist() == [[3, 4], [5, 0]]


def test_a_batch_not_ordered_decodes_first_is_refused():
    step = AttentionStep(BLOCK, [3, 1], [0, 5], [[0], [1, 2]], list(range(4)))
    with pytest.raises(ValueError, match="decodes first"):
        backend().build_metadata(step)


def test_backend_matches_the_reference_backend_on_the_conformance_script():
    for dtype in (torch.float32, torch.bfloat16):
        spec = AttentionSpec(num_heads=6, num_kv_heads=2, head_dim=16, dtype=dtype)
        check_backend(SimchipAttentionBackend(spec), spec, torch.device("cpu"), block_size=BLOCK)


def decode_call(**changes):
    kv = cache()
    args = dict(query=torch.randn(2, 4, 8), kv_cache=kv, block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                context_lens_host=torch.tensor([5, 2], dtype=torch.int32),
                context_lens_device=torch.tensor([5, 2], dtype=torch.int32), scale=0.3, out=torch.empty(2, 4, 8))
    args.update(changes)
    kernels.paged_decode_attention(**args)
    return args["out"]


def test_the_decode_kernel_refuses_wrong_calls():
    decode_call()  # the right call runs
    with pytest.raises(TypeError, match="context_lens_host must be int32"):
        decode_call(context_lens_host=torch.tensor([5, 2]))
    with pytest.raises(ValueError, match="context_lens_host and context_lens_device disagree"):
        decode_call(context_lens_device=torch.tensor([2, 5], dtype=torch.int32))  # swapped order
    with pytest.raises(ValueError, match=r"kv_cache must be \(2, num_blocks, 2 kv heads, block_size, 8\)"):
        decode_call(kv_cache=torch.zeros(6, BLOCK, 2, 8))  # the reference layout, K only
    with pytest.raises(TypeError, match="block_tables must be int32"):
        decode_call(block_tables=torch.tensor([[0, 1], [2, 3]]))


def test_the_prefill_kernel_refuses_wrong_calls():
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    lod = torch.tensor([0, 2, 5], dtype=torch.int32)
    kernels.prefill_attention(query=q, key=k, value=v, out=torch.empty_like(q), q_lod_host=lod, q_lod_device=lod,
                              scale=0.3)
    with pytest.raises(ValueError, match="does not cover the 5 query tokens"):
        bad = torch.tensor([0, 2, 4], dtype=torch.int32)
        kernels.prefill_attention(query=q, key=k, value=v, out=torch.empty_like(q), q_lod_host=bad,
                                  q_lod_device=bad, scale=0.3)
    with pytest.raises(TypeError, match="kv_lod_host must be int32"):
        kernels.prefill_attention(query=q, key=k, value=v, out=torch.empty_like(q), q_lod_host=lod,
                                  q_lod_device=lod, scale=0.3, kv_cache=cache(),
                                  block_tables=torch.zeros(2, 2, dtype=torch.int32), kv_lod_host=lod.long(),
                                  kv_lod_device=lod)


def test_a_swapped_key_and_value_fails_the_conformance_check():
    class Swapped(SimchipAttentionBackend):
        def store_kv(self, key, value, kv_cache, metadata):
            super().store_kv(value, key, kv_cache, metadata)

    with pytest.raises(AssertionError, match="attend output differs from the reference"):
        check_backend(Swapped(SPEC), SPEC, torch.device("cpu"), block_size=BLOCK)
