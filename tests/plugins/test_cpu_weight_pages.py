"""Packed weights of at least one huge page start on a 2 MiB boundary of a mapping of their own (so the system
can back them with huge pages), and multiply as the weights they came from; the mapping lives as long as a view
of it."""

import mmap

import pytest
import torch

from kunlun_infer.plugins import cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm.available(torch.float32), reason="the native CPU kernels do not build here")


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no transparent huge pages on this system")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_packed_weight_is_aligned_to_huge_pages_and_multiplies_right(dtype):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(2048, 640, generator=g).to(dtype)  # 5 MiB in float32, 2.5 MiB in bf16
    packed = cpu_gemm.pack(weight)
    assert packed.data_ptr() % (2 << 20) == 0
    x = torch.randn(3, 640, generator=g).to(dtype)
    want = (x.float() @ weight.float().T).to(dtype)
    torch.testing.assert_close(cpu_gemm.linear(x, packed), want, rtol=2e-2 if dtype is torch.bfloat16 else 1e-4,
                               atol=2e-2 if dtype is torch.bfloat16 else 1e-4)


def test_a_small_packed_weight_keeps_ordinary_memory_and_the_mapping_lives_with_the_weight():
    small = cpu_gemm.weight_buffer(1000, torch.float32)
    assert small.numel() == 1000 and small.untyped_storage().nbytes() == 4000
    big = cpu_gemm.weight_buffer(1 << 20, torch.float32)
    big.fill_(3.0)
    alias = big[:10]
    del big
    assert (alias == 3.0).all()  # a view keeps the whole mapping alive
