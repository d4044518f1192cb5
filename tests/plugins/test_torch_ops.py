"""The built-in ``torch`` ops: the vectorised paged attention matches the reference."""

from __future__ import annotations

import pytest
import torch

from kunlun_infer.ops import reference
from kunlun_infer.plugins.torch_ops import paged_attention


def _batch(seqs, *, hq, hk, d=16, block_size=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-ctx // block_size) for ctx, _ in seqs)
    num_blocks = max_blocks * len(seqs) + 3
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seqs), max_blocks), 10_000, dtype=torch.int32)  # unused entries hold garbage
    used = 0
    for i, (ctx, _) in enumerate(seqs):
        n = -(-ctx // block_size)
        tables[i, :n] = perm[used:used + n].to(torch.int32)
        used += n
    qsl = torch.tensor([0] + list(torch.tensor([q for _, q in seqs]).cumsum(0)), dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hk, d, generator=g).to(dtype)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g).to(dtype)
    lens = torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32)
    return q, k_cache, v_cache, tables, lens, qsl, d ** -0.5


@pytest.mark.parametrize("seqs", [
    [(5, 1), (17, 1), (1, 1)],  # decode only, ragged lengths
    [(9, 9)],  # one prefill
    [(12, 4), (7, 1), (30, 30), (3, 1)],  # chunked prefill, decode and prefill mixed
])
@pytest.mark.parametrize("hq, hk", [(4, 4), (8, 2)])
def test_paged_attention_matches_reference(seqs, hq, hk):
    args = _batch(seqs, hq=hq, hk=hk)
    torch.testing.assert_close(paged_attention(*args), reference.paged_attention(*args), rtol=1e-4, atol=1e-5)


def test_paged_attention_low_precision_returns_input_dtype():
    args = _batch([(6, 1), (8, 3)], hq=4, hk=2, dtype=torch.bfloat16)
    out = paged_attention(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference.paged_attention(*args), rtol=2e-2, atol=2e-2)
