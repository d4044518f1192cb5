"""The plugin's Triton kernels and the backend built on them, run in Triton's interpreter on CPU tensors.

No GPU is needed: :func:`kunlun_infer_cuda.triton_kernels.launch` interprets
a kernel whose tensors are on the host. What is checked, in float32 and
float16 (the interpreter is not exact for bfloat16); where a GPU is, the
kernel tests run compiled on it too, in bfloat16 as well:

- ``decode_attention`` against the torch ``paged_attention`` for grouped-query
  sizes, even and odd block sizes, shuffled block tables, contexts of one
  token, of a partial block and long enough for several splits, with one
  split and with several merged; every output row must be written;
- ``prefill_attention`` for prompts, chunked prefills and prompts longer than
  one query tile, leaving the decode rows in front of them untouched;
- ``store_kv``: exactly the addressed slots, nothing for slot ``-1``, from
  strided views of a wider tensor;
- ``rms_norm``, ``add_rms_norm``, ``rotary_embedding`` (bit for bit: the
  reference's roundings) and ``silu_and_mul`` against the torch ops;
- ``TritonAttentionBackend`` passes the framework's conformance check (and a
  broken variant fails it), its metadata updates in place for a later
  decode step of the same batch size (hook API 1.5) and its padding
  sequences store nothing (1.6);
- ``TorchCudaOps``: what ``ops.attention`` / ``ops.fused_kernels`` choose, their
  errors, ``capture`` off a GPU;
- the engine on the Triton backend and fused kernels gives transformers'
  greedy tokens, eager and with its decode steps replayed padded to
  ``ops.step_graph_sizes`` (a capture stood in for by running it again);
- a bad ``ops.attention`` is refused when the runtime is built, naming the key.
"""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

from kunlun_infer_cuda import ops as cuda_ops
from kunlun_infer_cuda import triton_kernels as tk
from kunlun_infer_cuda.attention import TritonAttentionBackend
from kunlun_infer_cuda.ops import TorchCudaOps, add_rms_norm, paged_attention, rms_norm, rotary_embedding, silu_and_mul

from kunlun_infer.capabilities import CapturedStep
from kunlun_infer.layers.rotary import rope_cos_sin_cache
from kunlun_infer.ops.attention import AttentionSpec
from kunlun_infer.ops.attention_step import AttentionStep
from kunlun_infer.ops.reference import rotary_embedding as reference_rotary
from kunlun_infer.testing.attention import check_backend
from kunlun_infer.testing.compare import ConformanceError

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.float16]
#: (rtol, atol) of a kernel's output against the float32 reference of the same inputs
CLOSE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
#: where and in which dtypes the kernel tests run: interpreted on the host, and compiled on a GPU when there is one
PLACES = [pytest.param(CPU, dtype, id=f"interpreted-{str(dtype)[6:]}") for dtype in DTYPES] + (
    [pytest.param(torch.device("cuda", 0), dtype, id=f"gpu-{str(dtype)[6:]}")
     for dtype in (*DTYPES, torch.bfloat16)] if torch.cuda.is_available() else [])


def _cache(num_blocks: int, kv_heads: int, block_size: int, dim: int, dtype: torch.dtype,
           g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys and values in the kernels' layout ``[num_blocks, kv_heads, block_size, dim]``."""
    return tuple(torch.randn(num_blocks, kv_heads, block_size, dim, generator=g).to(dtype) for _ in range(2))


def _tables(seq_lens: list[int], block_size: int, num_blocks: int, width: int, g: torch.Generator) -> torch.Tensor:
    """Block tables ``[B, width]`` of distinct shuffled blocks; entries past a sequence's last block are garbage
    (out of range): no kernel may read them."""
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.randint(10_000, 20_000, (len(seq_lens), width), generator=g, dtype=torch.int32)
    for i, n in enumerate(seq_lens):
        for j in range(-(-n // block_size)):
            tables[i, j] = perm.pop()
    return tables


def _reference(q, k_cache, v_cache, tables, seq_lens, query_start, scale):
    """The torch ``paged_attention`` in float32, on the reference layout ``[num_blocks, block_size, heads, dim]``."""
    return paged_attention(q.float(), k_cache.transpose(1, 2).float().contiguous(),
                           v_cache.transpose(1, 2).float().contiguous(), tables.clamp(0, k_cache.shape[0] - 1),
                           torch.tensor(seq_lens), torch.tensor(query_start, dtype=torch.int32), scale)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = CLOSE[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------- decode


@pytest.mark.parametrize("device,dtype", PLACES)
@pytest.mark.parametrize("hq,hk,dim", [(4, 4, 32), (8, 2, 32), (7, 1, 24)], ids=["group1", "group4", "group7-d24"])
@pytest.mark.parametrize("block_size", [16, 5])
def test_decode_attention_matches_the_reference(device, dtype, hq, hk, dim, block_size):
    g = torch.Generator().manual_seed(hq * 100 + block_size)
    seq_lens = [1, 23, 150, 2 * block_size]  # one token, a partial block, several splits, whole blocks
    width = -(-max(seq_lens) // block_size) + 1
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    k_cache, v_cache = _cache(num_blocks, hk, block_size, dim, dtype, g)
    tables = _tables(seq_lens, block_size, num_blocks, width, g)
    q = torch.randn(len(seq_lens), hq, dim, generator=g).to(dtype)
    scale = dim ** -0.5
    want = _reference(q, k_cache, v_cache, tables, seq_lens, list(range(len(seq_lens) + 1)), scale)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q, k_cache, v_cache, tables, lens = (t.to(device) for t in (q, k_cache, v_cache, tables, lens))

    several = tk.decode_splits(len(seq_lens), hk, width * block_size, programs=64)
    assert several[1] > 1 and several[0] * several[1] >= max(seq_lens)
    assert -(-max(seq_lens) // several[0]) > 1  # the long sequence really spans several splits
    for split_tokens, num_splits in ((width * block_size, 1), several):
        out = torch.full_like(q, float("nan"))  # a row the kernel does not write fails
        tk.decode_attention(q, k_cache, v_cache, tables, lens, out, scale, split_tokens, num_splits)
        assert out.dtype == dtype and not out.isnan().any(), f"{num_splits} split(s): rows left unwritten"
        _close(out.cpu(), want, dtype)


def test_decode_splits_cover_the_context_and_fill_the_device():
    for batch, heads, tokens, programs in ((1, 1, 1, 8), (4, 2, 160, 64), (2, 8, 4096, 264), (64, 8, 100, 16)):
        split_tokens, num_splits = tk.decode_splits(batch, heads, tokens, programs)
        assert split_tokens % tk.DECODE_TOKENS == 0 and split_tokens >= tk.DECODE_TOKENS
        assert split_tokens * num_splits >= tokens and split_tokens * (num_splits - 1) < tokens  # no empty split
    # a small batch of a long context is split until it fills the programs; a large batch is not split
    assert tk.decode_splits(1, 2, 4096, 64)[1] == 32
    assert tk.decode_splits(64, 8, 4096, 64)[1] == 1


# ---------------------------------------------------------------------- prefill


@pytest.mark.parametrize("device,dtype", PLACES)
@pytest.mark.parametrize("hq,hk,block_size", [(4, 2, 16), (3, 1, 5)], ids=["group2-bs16", "group3-bs5"])
def test_prefill_attention_matches_the_reference_and_leaves_decode_rows(device, dtype, hq, hk, block_size):
    g = torch.Generator().manual_seed(11)
    dim = 16
    # two decodes at the front, a prompt of two query tiles, a chunk after a cached prefix, a short prompt
    query_lens = [1, 1, tk.PREFILL_BLOCK_M + 6, 20, 5]
    context_lens = [9, 40, 0, 37, 0]
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    width = -(-max(seq_lens) // block_size)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    k_cache, v_cache = _cache(num_blocks, hk, block_size, dim, dtype, g)
    tables = _tables(seq_lens, block_size, num_blocks, width, g)
    query_start = [0]
    for n in query_lens:
        query_start.append(query_start[-1] + n)
    q = torch.randn(query_start[-1], hq, dim, generator=g).to(dtype)
    scale = dim ** -0.5
    want = _reference(q, k_cache, v_cache, tables, seq_lens, query_start, scale)

    tile_seq, tile_row = tk.prefill_tiles(query_lens, first_seq=2)
    assert tile_seq == [2, 2, 3, 4] and tile_row == [0, tk.PREFILL_BLOCK_M, 0, 0]
    ints = [torch.tensor(x, dtype=torch.int32, device=device) for x in (seq_lens, query_start, tile_seq, tile_row)]
    q, k_cache, v_cache, tables = (t.to(device) for t in (q, k_cache, v_cache, tables))
    out = torch.full_like(q, float("nan"))
    tk.prefill_attention(q, k_cache, v_cache, tables, *ints, out, scale)
    out = out.cpu()
    assert out[:2].isnan().all(), "the decode rows in front belong to the decode kernel"
    assert not out[2:].isnan().any()
    _close(out[2:], want[2:], dtype)


# ---------------------------------------------------------------------- KV store


@pytest.mark.parametrize("device,dtype", PLACES)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("layout", ["qkv-slices", "other-strides"])
def test_store_kv_writes_exactly_the_addressed_slots(device, dtype, block_size, layout):
    g = torch.Generator().manual_seed(block_size)
    hq, hk, dim, num_blocks = 4, 2, 24, 6
    k_cache, v_cache = (c.to(device) for c in _cache(num_blocks, hk, block_size, dim, dtype, g))
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = [3, -1, block_size * 4 + block_size - 1, 0, block_size * 2, -1, block_size * 5 + 1]
    tokens = len(slots)
    if layout == "qkv-slices":  # keys and values as the attention layer cuts them from one projection
        qkv = torch.randn(tokens, hq + 2 * hk, dim, generator=g).to(device, dtype)
        key, value = qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    else:  # keys every other element (copied to a unit last stride), values with padded heads
        key = torch.randn(tokens, hk, 2 * dim, generator=g).to(device, dtype)[..., ::2]
        value = torch.randn(tokens, hk, dim + 8, generator=g).to(device, dtype)[..., :dim]
        assert key.stride(-1) == 2 and value.stride()[1:] == (dim + 8, 1)
    assert not key.is_contiguous() and not value.is_contiguous()
    tk.store_kv(key, value, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64, device=device))

    want_k, want_v = k_before.clone(), v_before.clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            want_k[slot // block_size, :, slot % block_size] = key[t]
            want_v[slot // block_size, :, slot % block_size] = value[t]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert not torch.equal(k_cache, k_before)  # the test's slots really changed something

    tk.store_kv(key, value, k_cache, v_cache, torch.full((tokens,), -1, dtype=torch.int64, device=device))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)  # padding rows store nothing


# ---------------------------------------------------------------------- norms, rotary and SwiGLU


@pytest.mark.parametrize("device,dtype", PLACES)
@pytest.mark.parametrize("width", [64, 100])
def test_norms_match_the_torch_ops(device, dtype, width):
    g = torch.Generator().manual_seed(width)
    wide = torch.randn(2, 3, width + 8, generator=g).to(device, dtype)
    x = wide[..., :width]  # rows with a stride wider than the row
    residual = torch.randn(2, 3, width, generator=g).to(device, dtype)
    weight = (1 + 0.5 * torch.randn(width, generator=g)).to(device, dtype)
    rtol, atol = CLOSE[dtype]

    got = tk.rms_norm(x, weight, 1e-6)
    want = rms_norm(x, weight, 1e-6)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)

    normed, summed = tk.add_rms_norm(x, residual, weight, 1e-5)
    want_normed, want_summed = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual)  # the residual stream is carried exactly
    assert torch.equal(want_summed, summed)
    assert normed.shape == want_normed.shape and normed.dtype == want_normed.dtype
    torch.testing.assert_close(normed, want_normed, rtol=rtol, atol=atol)


@pytest.mark.parametrize("device,dtype", PLACES)
@pytest.mark.parametrize("hq,hk,dim", [(4, 2, 64), (3, 1, 24)], ids=["group2-d64", "mqa-d24"])
def test_rotary_embedding_is_the_torch_op_bit_for_bit(device, dtype, hq, hk, dim):
    g = torch.Generator().manual_seed(dim)
    table = rope_cos_sin_cache(dim, 300, 10_000.0, None, 300).to(device)
    positions = torch.tensor([0, 7, 299, 150, 8, 1], device=device)
    qkv = (2 * torch.randn(6, hq + 2 * hk, dim, generator=g)).to(device, dtype)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hk]  # views of one projection, as the attention layer passes them
    got = tk.rotary_embedding(positions, q, k, table)
    for ref in (rotary_embedding, reference_rotary):  # the plugin's torch op and the framework's reference
        want = ref(positions, q, k, table)
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()
            assert torch.equal(a, b), f"{ref.__module__}: max difference {(a.float() - b.float()).abs().max()}"
    assert not torch.equal(got[0], q)  # it did rotate
    wider = torch.zeros(6, 1, 2 * dim, device=device, dtype=dtype)
    with pytest.raises(ValueError, match=f"a table of width {dim} for heads of {2 * dim}"):
        tk.rotary_embedding(positions, wider, wider, table)


@pytest.mark.parametrize("device,dtype", PLACES)
@pytest.mark.parametrize("n", [48, 1500])  # one column block, several of them
def test_silu_and_mul_matches_the_torch_op(device, dtype, n):
    g = torch.Generator().manual_seed(n)
    x = (3 * torch.randn(2, 3, 2 * n, generator=g)).to(device, dtype)
    got, want = tk.silu_and_mul(x), silu_and_mul(x)
    assert got.shape == want.shape == (2, 3, n) and got.dtype == dtype
    rtol, atol = CLOSE[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------- backend conformance


@pytest.mark.parametrize("dtype,hq,hk,dim,block_size", [
    (torch.float32, 4, 2, 16, 16),
    (torch.float16, 4, 2, 32, 16),
    (torch.float32, 3, 1, 16, 5),
], ids=["f32-group2", "f16-group2", "f32-mqa-bs5"])
def test_backend_passes_the_conformance_check(dtype, hq, hk, dim, block_size):
    spec = AttentionSpec(num_heads=hq, num_kv_heads=hk, head_dim=dim, dtype=dtype)
    check_backend(TritonAttentionBackend(spec), spec, CPU, block_size=block_size)


class _WrongScale(TritonAttentionBackend):
    name = "wrong-scale"

    def attend(self, query, key, value, kv_cache, metadata, *, scale):
        return super().attend(query, key, value, kv_cache, metadata, scale=scale * 1.05)


class _SkipsASlot(TritonAttentionBackend):
    name = "skips-a-slot"

    def store_kv(self, key, value, kv_cache, metadata):
        tk.store_kv(key[1:], value[1:], kv_cache[0], kv_cache[1], metadata.slots[1:])


@pytest.mark.parametrize("broken", [_WrongScale, _SkipsASlot], ids=lambda c: c.name)
def test_a_broken_backend_fails_the_conformance_check(broken):
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    with pytest.raises(ConformanceError, match=broken.name):
        check_backend(broken(spec), spec, CPU, block_size=16)


# ---------------------------------------------------------------------- metadata updated in place


def _decode_step(context_lens: list[int], tables: list[list[int]], block_size: int) -> AttentionStep:
    slots = [t[c // block_size] * block_size + c % block_size for c, t in zip(context_lens, tables)]
    return AttentionStep(block_size, [1] * len(context_lens), list(context_lens), tables, slots, CPU)


def _wide(step: AttentionStep, width: int) -> AttentionStep:
    """``step`` with its block tables padded to ``width``, as ``StepGraphs`` builds a captured step's metadata."""
    return AttentionStep(step.block_size, step.query_lens, step.context_lens, step.padded_block_tables(width),
                         step.slot_mapping, step.device)


def _store_and_attend(backend, metadata, cache, q, k, v):
    backend.store_kv(k, v, cache, metadata)
    return backend.attend(q, k, v, cache, metadata, scale=q.shape[-1] ** -0.5)


def test_update_metadata_serves_a_later_decode_step_of_the_same_batch():
    g = torch.Generator().manual_seed(5)
    block_size, num_blocks, width, hq, hk, dim = 16, 40, 8, 4, 2, 16
    backend = TritonAttentionBackend(AttentionSpec(num_heads=hq, num_kv_heads=hk, head_dim=dim, dtype=torch.float32))
    cache = _cache(num_blocks, hk, block_size, dim, torch.float32, g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    first = _decode_step([3, 20, 0], [perm[0:1], perm[1:3], perm[3:4]], block_size)
    later = _decode_step([90, 17, 120], [perm[4:10], perm[10:12], perm[12:20]], block_size)  # 8 blocks: the width

    static = backend.build_metadata(_wide(first, width))
    assert backend.update_metadata(static, first)
    for step in (first, later):
        if step is later:
            assert backend.update_metadata(static, later)
        q, k, v = (torch.randn(3, h, dim, generator=g) for h in (hq, hk, hk))
        fresh_cache = tuple(c.clone() for c in cache)
        got = _store_and_attend(backend, static, cache, q, k, v)
        want = _store_and_attend(backend, backend.build_metadata(step), fresh_cache, q, k, v)
        assert all(torch.equal(a, b) for a, b in zip(cache, fresh_cache))  # the same slots written
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        reference = _reference(q, *cache, torch.tensor(step.padded_block_tables(width), dtype=torch.int32),
                               step.seq_lens, list(range(4)), dim ** -0.5)
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)

    # what a replay of the static metadata cannot serve
    prompt = AttentionStep(block_size, [2, 1, 1], [0, 5, 5], [perm[0:1], perm[1:2], perm[2:3]],
                           [perm[0] * block_size, perm[0] * block_size + 1, perm[1] * block_size + 5,
                            perm[2] * block_size + 5], CPU)
    assert not backend.update_metadata(static, prompt)
    assert not backend.update_metadata(static, _decode_step([3, 20], [perm[0:1], perm[1:3]], block_size))
    assert not backend.update_metadata(static, _decode_step([3, 20, 0, 1], [perm[0:1], perm[1:3], perm[3:4],
                                                                            perm[4:5]], block_size))
    too_wide = _decode_step([3, 20, 140], [perm[0:1], perm[1:3], perm[20:29]], block_size)  # 9 blocks > 8
    assert not backend.update_metadata(static, too_wide)
    with_tiles = backend.build_metadata(_wide(prompt, width))  # a static built for a step with a prompt
    assert with_tiles.num_tiles and not backend.update_metadata(with_tiles, later)
    # a refused update leaves the static metadata as the last good one
    assert static.seq_lens.tolist() == later.seq_lens


def test_metadata_parts_start_on_16_byte_boundaries_and_step_varying_arguments_are_not_specialised():
    """Triton compiles a kernel once per alignment of its pointers and per class (1, multiple of 16, other) of its
    integers: a part of the metadata buffer landing unaligned, or a table width reaching 16, would compile it
    again in the middle of serving."""
    backend = TritonAttentionBackend(AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32))
    for query_lens, context_lens in (([1], [5]), ([1, 1, 1], [3, 20, 7]), ([1, 3, 70], [9, 0, 17]),
                                     ([2, 5, 1, 1, 9], [0, 0, 0, 0, 0])):
        n = sum(-(-(q + c) // 16) for q, c in zip(query_lens, context_lens))
        blocks = iter(range(n))
        tables = [[next(blocks) for _ in range(-(-(q + c) // 16))] for q, c in zip(query_lens, context_lens)]
        slots = [t[p // 16] * 16 + p % 16 for q, c, t in zip(query_lens, context_lens, tables) for p in range(c, c + q)]
        step = AttentionStep(16, query_lens, context_lens, tables, slots, CPU)
        meta = backend.build_metadata(step)
        parts = {"slots": meta.slots, "seq_lens": meta.seq_lens, "query_start": meta.query_start,
                 "tile_seq": meta.tile_seq, "tile_row": meta.tile_row, "tables": meta.tables}
        for name, part in parts.items():
            assert (part.data_ptr() - meta.buffer.data_ptr()) % 16 == 0, f"{name} of {query_lens}"
        assert meta.slots.tolist() == slots and meta.seq_lens.tolist() == step.seq_lens
        assert meta.query_start.tolist() == step.query_start_loc
        assert meta.tables.tolist() == step.padded_block_tables(meta.width)
    for kernel, names in ((tk._decode_kernel, tk.STEP_VARYING), (tk._prefill_kernel, ["stride_tb"]),
                          (tk._merge_splits_kernel, ["num_splits"])):
        # Triton ignores a name that is not a parameter: a renamed argument would be specialised again
        assert set(names) <= set(inspect.signature(kernel.fn).parameters), kernel.fn.__name__
        assert set(kernel.do_not_specialize) == set(names)


def test_padding_sequences_store_nothing():
    g = torch.Generator().manual_seed(9)
    block_size, num_blocks, width, hq, hk, dim = 16, 12, 4, 4, 2, 16
    backend = TritonAttentionBackend(AttentionSpec(num_heads=hq, num_kv_heads=hk, head_dim=dim, dtype=torch.float32))
    cache = _cache(num_blocks, hk, block_size, dim, torch.float32, g)
    step = _decode_step([4, 33, 0], [[3], [5, 6, 7], [9]], block_size)
    padded = step.padded_to(8)
    assert padded.slot_mapping[3:] == [-1] * 5 and padded.block_tables[3:] == [[0]] * 5

    static = backend.build_metadata(_wide(padded, width))
    assert backend.update_metadata(static, padded)
    q, k, v = (torch.randn(8, h, dim, generator=g) for h in (hq, hk, hk))
    want_cache = tuple(c.clone() for c in cache)
    want = _store_and_attend(backend, backend.build_metadata(step), want_cache, q[:3], k[:3], v[:3])
    got = _store_and_attend(backend, static, cache, q, k, v)
    assert torch.equal(cache[0], want_cache[0]) and torch.equal(cache[1], want_cache[1])  # block 0 untouched
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- the op table


def test_capture_off_a_gpu_returns_none_without_running():
    calls = []
    for device in (None, CPU):
        assert TorchCudaOps(torch_device=device).capture(lambda: calls.append(1)) is None
    assert calls == []


def test_what_the_options_choose():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    auto = TorchCudaOps(torch_device=CPU)
    assert auto.describe() == {"attention": "sdpa-gather", "norms_rotary_swiglu": "torch"}
    assert auto.attention_backend(spec) is None and auto.get("rms_norm") is rms_norm
    forced = TorchCudaOps(torch_device=CPU, attention="triton", fused_kernels="on")
    assert forced.describe() == {"attention": "triton-paged", "norms_rotary_swiglu": "triton-fused"}
    assert isinstance(forced.attention_backend(spec), TritonAttentionBackend)
    assert {op: forced.get(op) for op in cuda_ops.FUSED_OPS} == {op: getattr(tk, op) for op in cuda_ops.FUSED_OPS}
    # on a GPU device, auto means Triton (nothing touches the GPU to decide it)
    gpu = TorchCudaOps(torch_device=torch.device("cuda", 0))
    assert gpu.describe() == {"attention": "triton-paged", "norms_rotary_swiglu": "triton-fused"}
    assert TorchCudaOps(torch_device=torch.device("cuda", 0), attention="sdpa", fused_kernels="off").describe() == \
        {"attention": "sdpa-gather", "norms_rotary_swiglu": "torch"}


def test_bad_values_name_their_key():
    with pytest.raises(ValueError, match="ops.attention='flash'"):
        TorchCudaOps(attention="flash")
    with pytest.raises(ValueError, match="ops.fused_kernels='maybe'"):
        TorchCudaOps(fused_kernels="maybe")


def test_without_triton_only_auto_and_torch_work(monkeypatch):
    monkeypatch.setattr(cuda_ops, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="ops.attention=triton needs the triton package"):
        TorchCudaOps(torch_device=CPU, attention="triton")
    with pytest.raises(ValueError, match="ops.fused_kernels=on needs the triton package"):
        TorchCudaOps(torch_device=CPU, fused_kernels="on")
    for device in (CPU, torch.device("cuda", 0)):
        assert TorchCudaOps(torch_device=device).describe() == {"attention": "sdpa-gather",
                                                                "norms_rotary_swiglu": "torch"}


# ---------------------------------------------------------------------- the engine


TRITON_RUN = ["device=cpu", "memory=caching", "ops=cuda", "streams=sync", "ops.attention=triton",
              "ops.fused_kernels=on"]


def test_engine_on_triton_kernels_gives_transformers_tokens(tiny_llama, tiny_llama_greedy, monkeypatch):
    from kunlun_infer import LLM, SamplingParams

    folder, _ = tiny_llama
    calls: dict[str, int] = {}

    def spy(name):
        real = getattr(tk, name)

        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)
        return counted

    for name in ("decode_attention", "prefill_attention", "rms_norm", "add_rms_norm", "rotary_embedding",
                 "silu_and_mul"):
        monkeypatch.setattr(tk, name, spy(name))

    prompts, want = tiny_llama_greedy
    overrides = [*TRITON_RUN, "model.max_model_len=256", "cache.block_size=16", "scheduler.max_num_seqs=8"]
    with LLM(model=str(folder), overrides=overrides) as llm:
        assert llm.engine.runner.attention.name == "triton-paged"
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0),
                                                 use_tqdm=False)]
    assert got == want
    assert set(calls) == {"decode_attention", "prefill_attention", "rms_norm", "add_rms_norm", "rotary_embedding",
                          "silu_and_mul"}


class _Rerun(CapturedStep):
    """A stand-in for a CUDA graph off a GPU: a replay runs the captured region again over the same buffers."""

    def __init__(self, fn):
        self.fn = fn
        self.result = fn()

    def replay(self):
        self.result.copy_(self.fn())
        return self.result


def _transformers_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of the transformers model after ``prompt``, end-of-sequence or not."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_padded_decode_steps_replay_on_the_triton_backend(tiny_llama, monkeypatch):
    """``ops.step_graph_sizes`` over the Triton backend: metadata updated in place, padding sequences appended,
    every decode step a replay, and the tokens transformers' (the engine's eager Triton steps give them too:
    test_engine_on_triton_kernels_gives_transformers_tokens)."""
    from kunlun_infer import LLM, SamplingParams

    folder, model = tiny_llama
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 299, (n,), generator=g).tolist() for n in (1, 15, 16, 17, 40, 3, 9)]
    lengths = (2, 6, 10, 4, 8, 12, 5)  # the batch shrinks from 7 through every captured size
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    monkeypatch.setattr(TorchCudaOps, "capture", lambda self, fn: _Rerun(fn))
    overrides = [*TRITON_RUN, "model.max_model_len=256", "cache.block_size=16", "scheduler.max_num_seqs=8",
                 "ops.step_graph_sizes=[2,4,8]"]
    with LLM(model=str(folder), overrides=overrides) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        graphs = llm.engine.runner.graphs
        assert graphs.batch_sizes == [2, 4, 8] and graphs.refused == {}
        assert graphs.replays == 11  # every decode step: the three sizes were captured at the start
    assert got == [_transformers_greedy(model, p, n) for p, n in zip(prompts, lengths)]


def test_a_bad_attention_choice_is_refused_naming_the_key():
    from kunlun_infer.errors import PluginError
    from kunlun_infer.runtime import PluginManager, Runtime, compose_config

    manager = PluginManager.load()
    cfg = compose_config([*TRITON_RUN[:4], "ops.attention=flash"], plugin_manager=manager)
    with pytest.raises(PluginError, match=r"ops\.attention='flash': choose one of auto, triton, sdpa"):
        Runtime.from_config(cfg, plugin_manager=manager)
