"""The ``cpu`` ops option: tuned host kernels agree with the plain-torch references and serve a model.

Every kernel set this CPU runs (``tests.kernel_sets``) is checked against the
references, and each test that depends on the set asks which one was chosen.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import subprocess

import pytest
import torch
import torch.nn.functional as F

from kunlun_infer.ops import reference
from kunlun_infer.plugins import cpu_attention, cpu_gemm, cpu_kernels, cpu_native, cpu_tuning
from kunlun_infer.testing import build_runtime, check_ops
from tests.kernel_sets import kernel_set, native_kernel_set  # noqa: F401 - fixtures
from tests.plugins.test_torch_ops import _batch

needs_onednn = pytest.mark.skipif(not cpu_kernels.onednn_linear_available(),
                                  reason="this torch build has no oneDNN prepacked linear")


def test_cpu_ops_cover_and_conform_in_every_dtype(kernel_set):
    with build_runtime(["ops=cpu"]) as rt:
        checked = check_ops(rt.ops, rt.device)
    assert {op for op, _ in checked} >= {"rms_norm", "paged_attention", "linear", "store_kv"}
    assert len({dtype for _, dtype in checked}) == 3


@pytest.mark.parametrize("seqs", [
    [(5, 1), (17, 1), (1, 1), (40, 1)],  # decode only, ragged lengths
    [(9, 9), (1, 1)],  # a prompt beside a one-token prompt
    [(12, 4), (7, 1), (30, 30), (3, 1)],  # chunked prefill, decode and prefill mixed
])
@pytest.mark.parametrize("hq, hk", [(4, 4), (8, 2), (6, 1), (12, 1)])
def test_paged_attention_matches_reference(seqs, hq, hk, kernel_set):
    args = _batch(seqs, hq=hq, hk=hk)
    torch.testing.assert_close(cpu_kernels.paged_attention(*args), reference.paged_attention(*args),
                               rtol=1e-4, atol=1e-5)


def _record_prompt_routes(monkeypatch) -> tuple[list[int], list[list[int]]]:
    """Lists that fill as prompts are attended: the context of each prompt sent to SDPA, and the new-token counts
    of each call of the native prompt kernel."""
    sdpa, prompt_kernel = [], []
    original_sdpa, original_kernel = cpu_attention.prefill_attention, cpu_attention.native_prompt_attention
    monkeypatch.setattr(cpu_attention, "prefill_attention", lambda *a: sdpa.append(a[-2]) or original_sdpa(*a))
    monkeypatch.setattr(cpu_attention, "native_prompt_attention",
                        lambda *a: prompt_kernel.append(list(a[6])) or original_kernel(*a))
    return sdpa, prompt_kernel


def test_prompts_take_the_native_prompt_kernel_in_one_call_and_agree(kernel_set, monkeypatch):
    """With native kernels every sequence with new tokens beyond one (prompts, a chunk after a cached prefix) goes to
    the prompt kernel in one call and the decode rows to the decode kernel, SDPA never; without them each prompt runs
    one SDPA. A batch mixing them matches the reference either way."""
    sdpa, prompt_kernel = _record_prompt_routes(monkeypatch)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        sdpa.clear(), prompt_kernel.clear()
        args = _batch([(12, 4), (7, 1), (40, 40), (3, 3), (30, 9), (1, 1)], hq=14, hk=2, dtype=dtype)
        torch.testing.assert_close(cpu_kernels.paged_attention(*args), reference.paged_attention(*args),
                                   rtol=tol, atol=tol)
        if kernel_set == "torch":
            assert sorted(sdpa) == [3, 12, 30, 40] and not prompt_kernel
        else:
            assert prompt_kernel == [[4, 40, 3, 9]] and not sdpa


def test_bf16_prompts_multiply_on_the_amx_tiles_where_granted(native_kernel_set):
    """The prompt kernel takes bf16 prompts of a head size that is a multiple of 32 to the AMX tiles exactly where
    the ``amx`` set runs and the OS granted the tile state; float32 and other head sizes stay on the vector units.
    (The tests below check either way against the reference on every kernel set this CPU runs.)"""
    granted = native_kernel_set == "amx" and bool(cpu_native.selection().library.kunlun_amx_tiles())
    assert cpu_attention.prompts_on_tiles(torch.bfloat16, 64) == granted
    assert cpu_attention.prompts_on_tiles(torch.bfloat16, 128) == granted
    assert not cpu_attention.prompts_on_tiles(torch.bfloat16, 48)
    assert not cpu_attention.prompts_on_tiles(torch.float32, 64)


def test_bf16_decode_rows_multiply_on_the_amx_tiles_where_granted(native_kernel_set):
    """The decode kernel takes bf16 rows of a head size that is a multiple of 32 to the AMX tiles exactly where the
    ``amx`` set runs and the OS granted the tile state, and where a KV head has enough query heads for the tiles to
    win (6 or more); the others stay on the vector units. (The tests around check either way against the reference
    on every kernel set this CPU runs.)"""
    granted = native_kernel_set == "amx" and bool(cpu_native.selection().library.kunlun_amx_tiles())
    for d, hq, hk in ((64, 14, 2), (128, 16, 1), (32, 6, 1), (128, 48, 8), (256, 32, 4), (64, 71, 1)):
        assert cpu_attention.decode_on_tiles(torch.bfloat16, d, hq, hk) == granted
    for d, hq, hk in ((64, 8, 2), (128, 40, 8), (48, 14, 2)):  # too few query heads (twice), head size
        assert not cpu_attention.decode_on_tiles(torch.bfloat16, d, hq, hk)
    assert not cpu_attention.decode_on_tiles(torch.float32, 64, 14, 2)


@pytest.mark.parametrize("hq, hk, d, block_size", [
    (14, 2, 64, 16),  # the 0.5B model: 16 keys of a block in one tile load, in place
    (16, 1, 128, 32),  # a whole tile of query heads; two tile loads a block
    (32, 4, 256, 16),  # wide token rows; four passes of 64 features over the values
    (7, 1, 32, 5),  # blocks shorter than a tile: keys gathered
    (21, 3, 96, 16),  # head size 96: three 32-feature lines a row, 7 query heads a KV head
    (17, 1, 64, 16),  # more query heads than a tile holds: two tiles of lanes, the second of one head
    (40, 1, 64, 16),  # three tiles of lanes
    (48, 8, 128, 16),  # 8 KV heads of 128, six query heads each: tiles of lanes six wide
    (4, 2, 64, 16),  # too few query heads a KV head for the tiles: the vector kernel
])
def test_native_decode_attention_in_bf16_matches_reference_in_place_and_gathered(hq, hk, d, block_size,
                                                                                native_kernel_set):
    """bf16 decode rows, on the tiles where they go there, against the reference: contexts ending inside a tile of 16
    keys and of 32 (1, 15, 17, 33), at one (16), and long (300); the cache past each context and in blocks no
    sequence owns is NaN and must not reach the output."""
    seqs = [(1, 1), (15, 1), (16, 1), (17, 1), (33, 1), (300, 1)]
    q, k_cache, v_cache, tables, lens, qsl, scale = _batch(seqs, hq=hq, hk=hk, d=d, block_size=block_size,
                                                           dtype=torch.bfloat16, seed=d + block_size)
    expected = reference.paged_attention(q, k_cache, v_cache, tables, lens, qsl, scale)
    owned = torch.zeros(k_cache.shape[0], block_size, dtype=torch.bool)
    for i, (ctx, _) in enumerate(seqs):
        for t in range(ctx):
            owned[int(tables[i, t // block_size]), t % block_size] = True
    k_cache[~owned] = float("nan")
    v_cache[~owned] = float("nan")
    out = cpu_kernels.paged_attention(q, k_cache, v_cache, tables, lens, qsl, scale)
    assert out.dtype == torch.bfloat16 and bool(out.isfinite().all())
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("seqs", [
    [(300, 300)],  # a prompt longer than a block of keys and of queries, keys past several cache blocks
    [(700, 257), (5, 2), (64, 1)],  # a chunk after a cached prefix, drafts, a decode row
    [(129, 129), (2, 2)],  # a block of query rows ending one short of a block of keys
])
@pytest.mark.parametrize("hq, hk, d, block_size", [(14, 2, 64, 16), (8, 8, 32, 5), (64, 1, 128, 16), (3, 1, 48, 7)])
def test_native_prompt_attention_matches_reference_on_long_prompts(seqs, hq, hk, d, block_size, native_kernel_set):
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
        args = _batch(seqs, hq=hq, hk=hk, d=d, block_size=block_size, dtype=dtype)
        torch.testing.assert_close(cpu_kernels.paged_attention(*args), reference.paged_attention(*args),
                                   rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_prompt_attention_follows_a_max_that_jumps_late(native_kernel_set, dtype):
    """Keys past the first blocks whose scores dwarf the earlier ones (their logits 40 above): the sums kept for the
    earlier blocks move to the new maximum (on the AMX tiles only once a block's max passes a lane's by 2^8)."""
    q, k_cache, v_cache, tables, lens, qsl, scale = _batch([(300, 300), (260, 31)], hq=14, hk=2, d=64,
                                                           block_size=16, dtype=dtype)
    for seq, keys in ((0, (150, 151, 290)), (1, (200, 250))):
        for key in keys:
            block, row = int(tables[seq, key // 16]), key % 16
            k_cache[block, row] *= 40.0 / (scale * float(k_cache[block, row].float().norm()) * 8.0 ** 0.5)
    expected = reference.paged_attention(q, k_cache, v_cache, tables, lens, qsl, scale)
    tol = 2e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(cpu_kernels.paged_attention(q, k_cache, v_cache, tables, lens, qsl, scale), expected,
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("d, dtype", [(16, torch.float32), (32, torch.bfloat16)])  # bf16, 32: on AMX tiles
def test_native_prompt_attention_reads_only_its_rows_and_blocks(d, dtype, native_kernel_set):
    """Rows of sequences not given are neither read nor written, nor are cache blocks no given sequence owns."""
    q, k_cache, v_cache, tables, lens, qsl, scale = _batch([(9, 9), (20, 6)], hq=4, hk=2, d=d, block_size=4,
                                                           dtype=dtype)
    expected = reference.paged_attention(q, k_cache, v_cache, tables, lens, qsl, scale)
    unused = torch.ones(k_cache.shape[0], dtype=torch.bool)
    unused[tables[1, :5].long()] = False
    k_cache[unused] = float("nan")
    v_cache[unused] = float("nan")
    q[:9] = float("nan")  # the first sequence's rows: not given
    out = torch.full_like(q, 7.0)
    assert cpu_attention.native_prompt_attention(q, k_cache, v_cache, tables[1:], lens[1:], [9], [6], out, scale)
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(out[9:], expected[9:], rtol=tol, atol=tol)
    assert bool((out[:9] == 7.0).all())


def test_native_prompt_attention_refuses_what_it_cannot_read(native_kernel_set):
    q, k_cache, v_cache, tables, lens, qsl, scale = _batch([(9, 9), (20, 6)], hq=4, hk=2, d=16, block_size=4)
    out = torch.empty_like(q)
    bad_block = tables.clone()
    bad_block[1, 4] = k_cache.shape[0]  # a block id past the cache, inside the context
    for table, seq_lens, counts in ((bad_block, lens, [9, 6]), (tables, lens, [9, 21]),  # more new tokens than context
                                    (tables, torch.tensor([9, 4 * tables.shape[1] + 1]), [9, 6])):  # past the table
        with pytest.raises(IndexError, match="block"):
            cpu_attention.native_prompt_attention(q, k_cache, v_cache, table, seq_lens, [0, 9], counts, out, scale)


@pytest.mark.parametrize("d, block_size", [(32, 16), (64, 5), (128, 16), (48, 16), (16, 4), (8, 4)])  # head size 8: no native kernel
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_attention_over_long_contexts_and_head_sizes(d, block_size, dtype, tol, kernel_set):
    args = _batch([(1, 1), (15, 1), (16, 1), (17, 1), (300, 1)], hq=14, hk=2, d=d, block_size=block_size, dtype=dtype)
    torch.testing.assert_close(cpu_kernels.paged_attention(*args), reference.paged_attention(*args),
                               rtol=max(tol, 1e-4), atol=tol)


def test_paged_attention_low_precision_keeps_its_dtype_and_accuracy(kernel_set):
    args = _batch([(6, 1), (8, 3), (33, 1), (20, 20)], hq=8, hk=2, dtype=torch.bfloat16)
    out = cpu_kernels.paged_attention(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference.paged_attention(*args), rtol=2e-2, atol=2e-2)
    decode_only = _batch([(6, 1), (40, 1)], hq=8, hk=2, dtype=torch.bfloat16)
    torch.testing.assert_close(cpu_kernels.paged_attention(*decode_only), reference.paged_attention(*decode_only),
                               rtol=2e-2, atol=2e-2)


def test_native_decode_attention_reads_the_cache_in_place(native_kernel_set):
    q, k_cache, v_cache, tables, lens, qsl, scale = _batch([(9, 1), (4, 1)], hq=4, hk=2, d=16, block_size=4)
    before = cpu_attention.native_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    unused = torch.ones(k_cache.shape[0], dtype=torch.bool)
    unused[tables[0, :3].long()] = False
    unused[tables[1, :1].long()] = False
    k_cache[unused] = float("nan")  # blocks no sequence owns are never read
    v_cache[unused] = float("nan")
    after = cpu_attention.native_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_native_decode_attention_refuses_a_table_that_points_outside_the_cache(native_kernel_set):
    q, k_cache, v_cache, tables, lens, qsl, scale = _batch([(9, 1), (4, 1)], hq=4, hk=2, d=16, block_size=4)
    tables[0, 2] = k_cache.shape[0]  # a block id past the cache, inside the context
    with pytest.raises(IndexError, match="block"):
        cpu_attention.native_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    tables[0, 2] = 0
    lens[1] = 4 * tables.shape[1] + 1  # a context longer than its table
    with pytest.raises(IndexError, match="block"):
        cpu_attention.native_decode_attention(q, k_cache, v_cache, tables, lens, scale)


def _assert_linear_like_f_linear(pack, linear, out_features, in_features, rows_list, bias=True,
                                 dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None
    packed = pack(weight)
    assert packed is not weight
    for rows in rows_list:
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        out = linear(x, packed, b)
        assert out.dtype == dtype and out.shape == (rows, out_features)
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        # as close to the exact product as F.linear's own result is (one rounding to dtype, K-long sums), or within
        # the bound of any order of the K-long sum in float32 and one rounding to dtype (F.linear sums in blocks on
        # some CPUs, which is closer than one sequential pass; a term left out or counted twice is far outside both)
        ulp = torch.finfo(dtype).eps / 2
        magnitude = F.linear(x.double().abs(), weight.double().abs(), None if b is None else b.double().abs())
        any_order = (in_features + 1) * 2.0 ** -24 * magnitude + ulp * exact.abs()
        like_f_linear = (F.linear(x, weight, b).double() - exact).abs().max() * 2 + (1e-2 if dtype is torch.bfloat16
                                                                                     else 1e-5)
        assert ((out.double() - exact).abs() <= torch.clamp(any_order, min=like_f_linear)).all(), rows


#: row counts covering every block size of the GEMMs (blocks of 6 rows on AVX2, 12 on AVX-512; 48 / 96 per pass)
_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 24, 31, 100]


def _gemm_ways() -> list[str]:
    """The ways the loaded GEMMs can take a tile of many rows: as this CPU measured (``cpu_tuning``), and where the
    build has a second way (AVX2), every such tile in chunks and every one whole."""
    return ["as measured", "in chunks", "whole"] if cpu_tuning.has_chunks(cpu_native.selection().library) \
        else ["as measured"]


@contextlib.contextmanager
def _gemm_way(way: str):
    lib = cpu_native.selection().library
    if way == "as measured":
        yield
        return
    before = cpu_tuning.chunk_rows_of(lib)
    rows = 0 if way == "in chunks" else None  # 0: from the first row past one block; None: never
    cpu_tuning.set_chunk_rows(lib, dict.fromkeys(before, rows))
    try:
        yield
    finally:
        cpu_tuning.set_chunk_rows(lib, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_features, in_features", [(64, 32), (48, 40), (100, 2), (1, 6), (33, 258)])
def test_native_gemm_matches_f_linear_for_every_row_count(native_kernel_set, dtype, out_features, in_features):
    assert cpu_gemm.can_pack(torch.zeros(out_features, in_features, dtype=dtype))
    for way in _gemm_ways():
        with _gemm_way(way):  # ragged tiles (out features not a multiple of the tile) and every row-block remainder
            _assert_linear_like_f_linear(cpu_gemm.pack, cpu_gemm.linear, out_features, in_features, _ROWS,
                                         dtype=dtype)
            _assert_linear_like_f_linear(cpu_gemm.pack, cpu_gemm.linear, out_features, in_features, [3],
                                         bias=False, dtype=dtype)


@pytest.mark.parametrize("rows", [18, 100, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_gemm_of_many_rows_sums_exactly_as_a_few_rows_at_a_time(native_kernel_set, dtype, rows):
    """With AVX2 a GEMM of more rows than one block may take K in chunks of 256 (600 features: three, the last
    ragged) and keep the sums between chunks: the same additions in the same order as a call with one block
    of 4-6 rows (one pass over K), so 18 rows at once equal three calls of 6 bit for bit, whichever way this
    CPU measured faster (``cpu_tuning``) and either way forced. 100 rows are packed 96 at a time, the last
    block of 4 rows short; 300 in four passes, packed into two buffers in turn while other threads may still
    multiply the pass before (the weight's three tiles do not share evenly among two threads)."""
    g = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(40, 600, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    x = torch.randn(rows, 600, generator=g).to(dtype)
    packed = cpu_gemm.pack(weight)
    apart = torch.cat([cpu_gemm.linear(x[i:i + 6], packed, bias) for i in range(0, rows, 6)])
    for way in _gemm_ways():
        with _gemm_way(way):
            together = cpu_gemm.linear(x, packed, bias)
        assert torch.equal(together, apart), way
    exact = F.linear(x.double(), weight.double(), bias.double())
    rounding = 2.0 ** -8 if dtype is torch.bfloat16 else 2.0 ** -20  # the output's own rounding, and some
    assert ((together.double() - exact).abs() <= rounding * exact.abs() + 1e-3).all()


@pytest.mark.parametrize("weights", ["bf16", "int8", "float32"])
def test_gemm_of_rows_past_one_pass_equals_the_rows_a_few_at_a_time(native_kernel_set, weights):
    """On the AMX tiles a GEMM takes its rows in passes that fit 3/4 of the core's L2 (amx.h's pass_bytes;
    with 2 MiB, 96 rows of 8192 bf16 features, 192 of 8192 int8 ones); with AVX-512 a float32-weight GEMM takes K
    in chunks whose pass of rows fits half of it, its sums kept in Y between chunks (the second tile, 8 columns, a
    ragged one). 100 and 200 rows, a ragged last pass, equal the
    same rows taken six at a time bit for bit (on every kernel set: a row's result does not depend on the others),
    and the float32 ones are as close to the exact product as one pass over K would be."""
    g = torch.Generator().manual_seed(11)
    weight, bias = torch.randn(40, 8192, generator=g), torch.randn(40, generator=g).to(torch.bfloat16)
    x = torch.randn(200, 8192, generator=g)
    if weights == "bf16":
        packed = cpu_gemm.pack(weight.to(torch.bfloat16))
        linear, x = cpu_gemm.linear, x[:100].to(torch.bfloat16)
    elif weights == "int8":
        packed = cpu_kernels.pack_int8_linear_weight(*reference.quantize_int8(weight))
        linear, x = cpu_kernels.int8_linear, x.to(torch.bfloat16)
    else:
        packed, linear, x, bias = cpu_gemm.pack(weight), cpu_gemm.linear, x[:100], bias.float()
        chunk = cpu_native.selection().library.kunlun_gemm_f32_chunk(100, 8192)  # in chunks where L2 < 10.5 MB
        assert (chunk < 8192) == native_kernel_set.startswith(("amx", "avx512")), chunk
    together = linear(x, packed, bias)
    assert torch.equal(together, torch.cat([linear(x[i:i + 6], packed, bias) for i in range(0, len(x), 6)]))
    if weights == "float32":
        exact = F.linear(x.double(), weight.double(), bias.double())
        bound = 8193 * 2.0 ** -24 * F.linear(x.double().abs(), weight.double().abs(), bias.double().abs())
        assert ((together.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("weights", ["bf16", "int8"])
@pytest.mark.parametrize("rows, in_features, order", [(224, 1000, "each tile"), (200, 8200, "across tiles")])
def test_tile_gemms_taking_k_in_chunks_equal_whole_tiles_bit_for_bit(native_kernel_set, weights, rows, in_features,
                                                                     order):
    """On the AMX tiles a GEMM of 192 rows or more takes K in chunks of 512 bytes a row (amx.h's amx_plan), its
    blocks' sums kept between chunks: each tile's chunks in turn where the pass's rows fit L2 over all of K (224
    rows of 1000 features, the last chunk ragged), or every tile's first chunk before any tile's second where that
    saves passes over the weight (200 rows of 8200: one pass, not four; three tiles, the last ragged, shared
    unevenly between two threads). Either way the result equals the same rows six at a time (whole tiles) bit for
    bit, on every kernel set, and is as close to the exact product as the output's rounding."""
    lib = cpu_native.selection().library
    reduction = in_features * 2 if weights == "bf16" else (in_features + 3) // 4 * 4
    xrow = reduction if weights == "bf16" else (in_features + 63) // 64 * 64
    if native_kernel_set == "amx" and lib.kunlun_amx_tiles():
        for team in (1, 2):
            plan = (ctypes.c_int64 * 4)()
            lib.kunlun_amx_gemm_plan(*map(ctypes.c_int64, (rows, 72, reduction, xrow, team)), plan)
            chunk, pass_rows, group = plan[0], plan[1], plan[2]
            assert chunk == 512 and pass_rows == rows, (team, list(plan))
            assert (group == 1) == (order == "each tile") and group <= 3, (team, list(plan))
    g = torch.Generator().manual_seed(13)
    weight, bias = torch.randn(72, in_features, generator=g), torch.randn(72, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    if weights == "bf16":
        weight = weight.to(torch.bfloat16)
        packed, linear = cpu_gemm.pack(weight), cpu_gemm.linear
    else:
        q, scale = reference.quantize_int8(weight)
        packed, linear = cpu_kernels.pack_int8_linear_weight(q, scale), cpu_kernels.int8_linear
        weight = q * scale[:, None]
    together = linear(x, packed, bias)
    assert torch.equal(together, torch.cat([linear(x[i:i + 6], packed, bias) for i in range(0, rows, 6)]))
    exact = F.linear(x.double(), weight.double(), bias.double())
    if weights == "bf16":  # the output's rounding
        assert ((together.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + 1e-3).all()
    else:  # and the rows' quantization to int8
        assert (together.double() - exact).norm() < 0.02 * exact.norm()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linear_keeps_leading_dims_and_refuses_a_wrong_width(kernel_set, dtype):
    weight = torch.randn(64, 32).to(dtype)
    packed = cpu_kernels.pack_linear_weight(weight)
    native = cpu_gemm.available(dtype)
    assert native == (kernel_set != "torch")
    assert cpu_gemm.is_packed(packed) == native
    x = torch.randn(2, 3, 32).to(dtype)
    assert cpu_kernels.linear(x, packed).shape == (2, 3, 64)
    assert cpu_kernels.linear(x[:0], packed).shape == (0, 3, 64)
    with pytest.raises((ValueError, RuntimeError)):
        cpu_kernels.linear(torch.randn(3, 31).to(dtype), packed)
    if dtype is torch.bfloat16:  # odd in-features do not fit the bf16 pairs of the AVX-512 layout: left as is
        assert not cpu_gemm.is_packed(cpu_kernels.pack_linear_weight(torch.randn(8, 5).to(torch.bfloat16)))


@needs_onednn
def test_onednn_path_multiplies_like_f_linear(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "can_pack", lambda weight: False)
    _assert_linear_like_f_linear(cpu_kernels.pack_linear_weight, cpu_kernels.linear, 48, 40, [1, 7, 64])


def test_weights_of_other_dtypes_stay_as_they_are(kernel_set):
    weight = torch.randn(8, 4).to(torch.float16)
    assert cpu_kernels.pack_linear_weight(weight) is weight
    x = torch.randn(3, 4).to(torch.float16)
    torch.testing.assert_close(cpu_kernels.linear(x, weight), F.linear(x, weight))


def _packed_nbytes(shape: tuple[int, int], dtype: torch.dtype) -> tuple[int, bool]:
    """Bytes an ``[out, in]`` weight occupies once ``ops=cpu`` packed it, and whether packing made a copy."""
    weight = torch.zeros(shape, dtype=dtype)
    packed = cpu_kernels.pack_linear_weight(weight)
    return packed.numel() * packed.element_size(), packed is not weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_model_on_cpu_ops_matches_transformers_and_counts_packed_weights(tmp_path, kernel_set, dtype):
    from kunlun_infer.models import load_model
    from tests.models.hf_factory import build_hf_model
    from tests.models.paged import PagedKV, hf_logits, max_relative_error

    hf = build_hf_model(tmp_path, "qwen3", dtype=dtype, tie_word_embeddings=True)
    with build_runtime(["ops=torch"]) as rt:  # no packing: the logical shapes of the linears and the LM head
        shapes = {name: tuple(m.packed_weight.shape) for name, m in load_model(tmp_path, runtime=rt,
                  dtype=dtype).named_modules() if hasattr(m, "packed_weight")}
    size = torch.tensor([], dtype=dtype).element_size()
    packs = {name: _packed_nbytes(shape, dtype) for name, shape in shapes.items()}
    # the tied head's weight is the embedding's: it adds bytes only when packing copied it
    linear_bytes = sum(nbytes for name, (nbytes, copied) in packs.items() if name != "lm_head" or copied)
    with build_runtime(["ops=cpu"]) as rt:
        model = load_model(tmp_path, runtime=rt, dtype=dtype)
        packed = {name: m.packed_weight for name, m in model.named_modules() if hasattr(m, "packed_weight")}
        assert packed.keys() == shapes.keys()
        if cpu_gemm.available(dtype):  # packed for the native GEMM: tiles round out-features up to the tile
            assert kernel_set != "torch"
            assert all(cpu_gemm.is_packed(w) for w in packed.values())
            tile = cpu_gemm.tile_n()
            assert linear_bytes == sum(size * -(-out // tile) * tile * inp for out, inp in shapes.values())
            assert all(copied for _, copied in packs.values())
        elif dtype is torch.bfloat16 and cpu_kernels.onednn_linear_available():  # reordered for oneDNN
            assert kernel_set == "torch"
            assert all(w.layout != torch.strided for w in packed.values())
        else:  # nothing repacked: the weights as loaded, the LM head sharing the embedding's storage
            assert kernel_set == "torch" and not any(copied for _, copied in packs.values())
        # each weight counted once: the packed copies (never their originals too) and the tied embedding
        params = sum(p.numel() for p in hf.parameters())
        hf_linear = sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear)
                        and m.weight is not hf.get_input_embeddings().weight)
        assert model.weight_nbytes() == size * (params - hf_linear) + linear_bytes
        prompts = {0: [5, 9, 2, 7, 11], 1: list(range(3, 15))}
        out = PagedKV(model, block_size=4).step(prompts)
    for i, tokens in prompts.items():
        assert max_relative_error(out[i], hf_logits(hf, tokens)) < (3e-2 if dtype is torch.bfloat16 else 1e-4)


# ---------------------------------------------------------------------- int8 weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("out_features, in_features", [(24, 40), (33, 258), (64, 7), (5, 1)])
def test_int8_kernel_equals_the_reference_bit_for_bit(native_kernel_set, dtype, out_features, in_features):
    # ragged tiles, reductions not a multiple of four, every row-block remainder, and 300 rows in several passes
    # (two buffers used in turn while other threads may still multiply the pass before); the integer sums are
    # exact and the scaling rounds as the reference does, so nothing may differ
    g = torch.Generator().manual_seed(out_features + in_features)
    q, scale = reference.quantize_int8(torch.randn(out_features, in_features, generator=g))
    packed = cpu_kernels.pack_int8_linear_weight(q, scale)
    assert cpu_gemm.is_packed_int8(packed)
    bias = torch.randn(out_features, generator=g).to(dtype)
    for rows in (*_ROWS, 300):
        x = (torch.randn(rows, in_features, generator=g) * 3).to(dtype)
        for b in (bias, None):
            got = cpu_kernels.int8_linear(x, packed, b)
            assert got.dtype == dtype and torch.equal(got, reference.int8_linear(x, (q, scale), b)), rows
    zero_rows = torch.zeros(2, in_features, dtype=dtype)  # an all-zero row quantizes with scale 1
    assert torch.equal(cpu_kernels.int8_linear(zero_rows, packed, bias), bias.expand(2, -1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_kernel_rounds_activations_half_to_even(native_kernel_set, dtype):
    # max |x| = 127 makes the row's scale 1, so every x below is a tie: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, ...; a
    # kernel that rounded halves away from zero would multiply other integers than the reference
    halves = torch.arange(-20, 20, dtype=torch.float32) + 0.5
    x = torch.cat([torch.tensor([127.0]), halves, halves.flip(0)]).reshape(3, 27).to(dtype)
    x[1:, 0] = -127.0
    qx, x_scale = reference.quantize_int8(x.float())
    assert torch.equal(x_scale, torch.ones(3)) and qx.flatten()[1:5].tolist() == [-20, -18, -18, -16]
    g = torch.Generator().manual_seed(5)
    q, scale = reference.quantize_int8(torch.randn(40, 27, generator=g))
    packed = cpu_kernels.pack_int8_linear_weight(q, scale)
    assert torch.equal(cpu_kernels.int8_linear(x, packed), reference.int8_linear(x, (q, scale)))
    many = x.repeat(6, 1)  # 18 rows: more than one block of the vector path, a tile and more with AMX
    assert torch.equal(cpu_kernels.int8_linear(many, packed), reference.int8_linear(many, (q, scale)))


def test_int8_linear_without_native_kernels_is_the_reference(kernel_set):
    q, scale = reference.quantize_int8(torch.randn(16, 12))
    packed = cpu_kernels.pack_int8_linear_weight(q, scale)
    assert cpu_gemm.is_packed_int8(packed) == (kernel_set != "torch")
    x = torch.randn(3, 2, 12)
    out = cpu_kernels.int8_linear(x, packed)
    assert out.shape == (3, 2, 16) and torch.equal(out, reference.int8_linear(x, (q, scale)))
    with pytest.raises((ValueError, RuntimeError)):
        cpu_kernels.int8_linear(torch.randn(3, 11), packed)


def test_conformance_catches_an_int8_linear_that_skips_quantizing_the_activations():
    from kunlun_infer.capabilities import DictOpsProvider
    from kunlun_infer.testing import ConformanceError, check_op

    def weight_only(x, packed, bias=None):  # dequantized weights times float activations: not int8_linear
        q, scale = packed
        return torch.nn.functional.linear(x.float(), q.float() * scale[:, None], None if bias is None else
                                          bias.float()).to(x.dtype)

    kernels = {"pack_int8_linear_weight": reference.pack_int8_linear_weight, "int8_linear": weight_only}
    with pytest.raises(ConformanceError, match="int8_linear"):
        check_op(DictOpsProvider(kernels), "int8_linear", torch.float32, torch.device("cpu"))
    check_op(DictOpsProvider({**kernels, "int8_linear": reference.int8_linear}), "int8_linear", torch.float32,
             torch.device("cpu"))


def test_int8_reference_is_close_to_the_float_product():
    # what int8 costs: each of weights and activations carries at most half a step of its row's scale
    g = torch.Generator().manual_seed(3)
    weight, x = torch.randn(64, 256, generator=g), torch.randn(8, 256, generator=g)
    out = reference.int8_linear(x, reference.pack_int8_linear_weight(*reference.quantize_int8(weight)))
    exact = x @ weight.T
    assert (out - exact).abs().max() < 0.02 * exact.abs().max()
    assert not torch.equal(out, exact)


# ---------------------------------------------------------------------- norms, SwiGLU, rotary

#: float32 agrees to rounding; bf16 to one unit in the last place (the reference's own roundings are reproduced)
_CLOSE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2 ** -7, atol=1e-6)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, hidden", [(1, 64), (5, 72), (3, 7), (300, 256)])  # tails, and enough to thread
def test_fused_rms_norms_match_reference(native_kernel_set, dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows + hidden)
    x, residual = (torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(hidden, generator=g).to(dtype)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6),
                               **_CLOSE[dtype])
    out, summed = cpu_kernels.add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_summed = reference.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, **_CLOSE[dtype])


def test_bf16_roundings_keep_denormals_and_nans(native_kernel_set):
    """Every bf16 value the kernels write is rounded to nearest even as torch rounds it, denormals kept (AVX512-BF16's
    one-instruction rounding flushes them to zero; vectors holding one round in software), NaN kept NaN: the
    residual sum of add_rms_norm is that rounding alone."""
    tiny = torch.finfo(torch.float32).tiny  # the smallest normal; below it, the denormals
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 64, generator=g) * 1e-3
    x[0, :] = torch.linspace(-tiny, tiny, 64)  # a row of denormals (and a zero)
    x[1, 5], x[2, 17], x[3, 40] = tiny / 3, float("nan"), -tiny * 0.999  # one in a vector of normal values
    residual = torch.randn(4, 64, generator=g) * 1e-3
    residual[0, :] = torch.linspace(tiny / 7, -tiny / 5, 64)
    residual[1, 5], residual[3, 40] = -tiny / 5, tiny / 1024
    x, residual, weight = x.bfloat16(), residual.bfloat16(), torch.ones(64, dtype=torch.bfloat16)
    _, summed = cpu_kernels.add_rms_norm(x, residual, weight, 1e-5)
    _, ref_summed = reference.add_rms_norm(x, residual, weight, 1e-5)
    assert (ref_summed[0].float().abs() < tiny).all() and (ref_summed[0] != 0).sum() > 50
    assert torch.equal(summed.view(torch.int16), ref_summed.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2 * 48), (7, 2 * 13), (2, 3, 2 * 64), (100, 2 * 768)])
def test_fused_silu_and_mul_matches_reference(native_kernel_set, dtype, shape):
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    torch.testing.assert_close(cpu_kernels.silu_and_mul(x), reference.silu_and_mul(x), **_CLOSE[dtype])


def _rotary_inputs(dtype, tokens, hq, hk, d, max_pos=64):
    g = torch.Generator().manual_seed(tokens * d)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    emb = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv).repeat(1, 2)
    cache = torch.stack((emb.cos(), emb.sin()), dim=1)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=g).to(dtype)  # q and k as slices of one projection
    q = qkv[:, :hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    return positions, q, k, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hq, hk, d", [(9, 4, 2, 32), (1, 14, 2, 64), (5, 3, 1, 20), (400, 8, 2, 64)])
def test_fused_rotary_matches_reference_on_slices_of_a_fused_projection(native_kernel_set, dtype, tokens, hq, hk, d):
    args = _rotary_inputs(dtype, tokens, hq, hk, d)
    got, want = cpu_kernels.rotary_embedding(*args), reference.rotary_embedding(*args)
    for a, b in zip(got, want):
        assert a.is_contiguous()
        torch.testing.assert_close(a, b, **_CLOSE[dtype])


def test_fused_rotary_refuses_a_position_outside_the_table_as_the_reference_does(native_kernel_set):
    positions, q, k, cache = _rotary_inputs(torch.float32, 3, 2, 1, 16)
    positions[1] = cache.shape[0]
    with pytest.raises(IndexError):
        cpu_kernels.rotary_embedding(positions, q, k, cache)


def _store_inputs(dtype, tokens, hk=2, d=16, num_blocks=8, block_size=4):
    """Keys and values as slices of one projection (tokens strided), slots in random order with padding."""
    g = torch.Generator().manual_seed(tokens)
    kv = torch.randn(tokens, 3 * hk * d, generator=g).to(dtype)
    key, value = kv[:, hk * d:2 * hk * d].view(tokens, hk, d), kv[:, 2 * hk * d:].view(tokens, hk, d)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[::3] = -1  # padding tokens: not stored
    k_cache = torch.zeros(num_blocks, block_size, hk, d, dtype=dtype)
    return key, value, k_cache, torch.zeros_like(k_cache), slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 32])
def test_native_store_kv_writes_what_the_reference_writes(native_kernel_set, dtype, tokens, monkeypatch):
    key, value, k_cache, v_cache, slots = _store_inputs(dtype, tokens)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, want_k, want_v, slots)
    monkeypatch.setattr(reference, "store_kv", lambda *a: pytest.fail("the native store fell back"))
    cpu_kernels.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert int((k_cache.flatten(0, 1).abs().sum((1, 2)) > 0).sum()) == int((slots >= 0).sum())


def test_native_store_kv_refuses_a_slot_past_the_cache_and_writes_nothing(native_kernel_set):
    key, value, k_cache, v_cache, slots = _store_inputs(torch.float32, 6)
    slots[4] = k_cache.shape[0] * k_cache.shape[1]
    with pytest.raises((IndexError, RuntimeError)):
        cpu_kernels.store_kv(key, value, k_cache, v_cache, slots)
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("n", [1, 63, 64 * 1024 + 5])
def test_read_probe_reads_every_value(native_kernel_set, n):
    """The benchmarks' bandwidth probe sums all it is given (a probe that skipped bytes would overstate it)."""
    x = torch.rand(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64).float()
    got = cpu_native.library().kunlun_read_probe(x.data_ptr(), n)
    assert got == pytest.approx(float(x.double().sum()), rel=1e-5)


# ---------------------------------------------------------------------- building the native kernels

def test_without_a_compiler_or_when_the_build_fails_torch_serves_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setattr(cpu_native, "load", cpu_native.load.__wrapped__)  # no cached library
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-anywhere")
    chosen = cpu_native.selection.__wrapped__()
    assert (chosen.name, chosen.library) == ("torch", None)
    assert "no C compiler 'no-such-compiler-anywhere'" in chosen.reason
    assert cpu_native.describe_planned().startswith("torch (no C compiler")
    monkeypatch.setenv("CC", "false")  # found, but every build fails
    chosen = cpu_native.selection.__wrapped__()
    assert chosen.name == "torch" and "avx2 kernels did not build" in chosen.reason
    assert not list((tmp_path / "kunlun_infer" / "kernels").glob("*.so"))  # no half-written library left


def _plain_kernel_set() -> cpu_native.KernelSet:
    return cpu_native.KernelSet("plain", frozenset(), (), "no ISA flags")


def _cc() -> str:
    name, path = cpu_native.compiler()
    if path is None:
        pytest.skip(f"no C compiler '{name}' on this machine")
    return path


def test_a_build_of_many_sources_is_one_library_with_all_their_functions(tmp_path):
    """The sources compile each to an object (several at once) and link into one library; nothing else is left."""
    sources = []
    for i in range(5):
        path = tmp_path / f"part{i}.c"
        path.write_text(f"int part{i}(int x) {{ return x * {i + 2}; }}\n")
        sources.append(path)
    out = tmp_path / "lib"
    out.mkdir()
    target = out / "parts.so"
    cpu_native.compile_sources(_cc(), _plain_kernel_set(), tuple(sources), target)
    lib = ctypes.CDLL(str(target))
    assert [getattr(lib, f"part{i}")(10) for i in range(5)] == [20, 30, 40, 50, 60]
    assert [p.name for p in out.iterdir()] == ["parts.so"]


def test_a_source_that_does_not_compile_names_itself_and_leaves_no_library(tmp_path):
    good = tmp_path / "good.c"
    good.write_text("int good(void) { return 1; }\n")
    bad = tmp_path / "bad_kernel.c"
    bad.write_text("int bad(void) { return undeclared_name; }\n")
    out = tmp_path / "lib"
    out.mkdir()
    with pytest.raises(subprocess.CalledProcessError) as failed:
        cpu_native.compile_sources(_cc(), _plain_kernel_set(), (good, bad), out / "parts.so")
    assert "bad_kernel.c" in failed.value.stderr and "undeclared_name" in failed.value.stderr
    assert not list(out.iterdir())  # neither a library nor the objects' folder


_AVX512_BF16 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx2", "fma", "f16c"}


@pytest.mark.parametrize("flags, expected, why", [
    (_AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}, "amx", "bf16 and int8 GEMMs on the AMX tiles"),
    (_AVX512_BF16, "avx512-bf16",
     "bf16 dot products (VDPBF16PS) and int8 (VNNI); the CPU lacks amx_bf16, amx_int8, amx_tile for amx"),
    (_AVX512_BF16 - {"avx512_bf16"}, "avx512-vnni",  # a Cascade Lake or Ice Lake Xeon
     "bf16 widened to float32 in registers, int8 (VNNI); the CPU lacks amx_bf16, amx_int8, amx_tile, avx512_bf16"),
    ({"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"}, "avx512-core",  # a Skylake Xeon: no VNNI
     "int8 without VNNI; the CPU lacks amx_bf16, amx_int8, amx_tile, avx512_bf16, avx512_vnni for amx"),
    ({"avx512f", "avx2", "fma", "f16c"}, "avx2",  # AVX-512 F alone (Xeon Phi)
     "lacks amx_bf16, amx_int8, amx_tile, avx512_bf16, avx512_vnni, avx512bw, avx512vl for amx"),
    ({"avx2", "fma", "f16c"}, "avx2", "lacks amx_bf16, amx_int8, amx_tile, avx512_bf16"),
    ({"sse4_2", "avx"}, None, "lacks avx2, f16c, fma"),
])
def test_the_kernel_set_follows_the_cpu_flags(monkeypatch, flags, expected, why):
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: frozenset(flags))
    chosen, reason = cpu_native.planned()
    assert (chosen.name if chosen else None) == expected and why in reason
    if expected is None:
        assert cpu_native.selection.__wrapped__().name == "torch"


def test_the_isa_cap_makes_this_cpu_choose_an_avx2_machines_kernels(monkeypatch):
    from kunlun_infer.errors import ConfigError
    from kunlun_infer.plugins import cpu_device

    monkeypatch.delenv(cpu_device.ISA_ENV, raising=False)  # the CPU's own flags, whatever the shell capped
    native = cpu_device.cpu_flags()
    monkeypatch.setenv(cpu_device.ISA_ENV, "avx2")
    capped = cpu_device.cpu_flags()
    assert not any(f.startswith(("avx512", "amx", "avx_vnni")) for f in capped)
    assert capped == {f for f in native if not f.startswith(("avx512", "amx", "avx_vnni"))}
    if {"avx2", "fma", "f16c"} <= native:
        chosen = cpu_native.selection.__wrapped__()
        assert chosen.name == "avx2" and "KUNLUN_INFER_CPU_ISA=avx2" in chosen.reason
    monkeypatch.setenv(cpu_device.ISA_ENV, "avx512-vnni")  # a Cascade Lake or Ice Lake Xeon's flags
    assert cpu_device.cpu_flags() == {f for f in native if not f.startswith(("amx", "avx512_bf16"))}
    monkeypatch.setenv(cpu_device.ISA_ENV, "avx512-core")  # a Skylake Xeon's
    assert cpu_device.cpu_flags() == {f for f in native if not f.startswith(("amx", "avx512_bf16", "avx512_vnni"))}
    monkeypatch.setenv(cpu_device.ISA_ENV, "avx9000")
    with pytest.raises(ConfigError, match="KUNLUN_INFER_CPU_ISA.*avx2"):
        cpu_device.cpu_flags()


@pytest.mark.parametrize("vendor, asks_ahead", [("GenuineIntel", 1), ("AuthenticAMD", 0), ("", 0)])
def test_one_row_gemms_ask_ahead_on_the_cpus_measured_faster_so_with_the_same_results(native_kernel_set, monkeypatch,
                                                                                      vendor, asks_ahead):
    kernel_set = cpu_native.selection().kernel_set
    g = torch.Generator().manual_seed(5)
    weight, x = torch.randn(70, 96, generator=g), torch.randn(1, 96, generator=g).to(torch.bfloat16)
    bf16 = cpu_gemm.pack(weight.to(torch.bfloat16))
    int8 = cpu_gemm.pack_int8(torch.randint(-127, 128, (70, 96), generator=g, dtype=torch.int8), torch.rand(70) / 50)
    before = cpu_native.library().kunlun_gemm_one_row_prefetch()
    try:
        results = []
        for chosen in (vendor, "the other way"):
            monkeypatch.setattr(cpu_native, "cpu_vendor", lambda chosen=chosen: chosen)
            lib = cpu_native.load.__wrapped__(kernel_set)  # the same library, loaded again: set from the vendor
            assert lib.kunlun_gemm_one_row_prefetch() == (asks_ahead if chosen == vendor else 0)
            results.append((cpu_gemm.linear(x, bf16), cpu_gemm.linear_int8(x, int8)))
        assert all(torch.equal(a, b) for a, b in zip(*results))
    finally:
        cpu_native.library().kunlun_gemm_set_one_row_prefetch(before)


def test_native_kernels_are_built_once_into_the_cache(monkeypatch, tmp_path):
    # the set this run chooses (every other set is built and loaded by the tests that run on it): a build of the
    # whole library takes 13-16 s on 2 cores
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernel_set, why = cpu_native.planned()
    if kernel_set is None:
        pytest.skip(f"no native kernel set: {why}")
    if cpu_native.compiler()[1] is None:
        pytest.skip("no C compiler to build the native kernels")
    first = cpu_native.load.__wrapped__(kernel_set)
    built = list((tmp_path / "kunlun_infer" / "kernels").glob("*.so"))
    assert first is not None and len(built) == 1 and kernel_set.name in built[0].name
    stamp = built[0].stat().st_mtime_ns
    assert cpu_native.load.__wrapped__(kernel_set) is not None
    assert [p.stat().st_mtime_ns for p in built] == [stamp]


def test_plugins_listing_and_doctor_name_the_kernel_set_and_why(monkeypatch):
    import io

    from kunlun_infer.cli import main
    from kunlun_infer.plugins import torch_ops

    monkeypatch.setenv("KUNLUN_INFER_CPU_ISA", "avx2")
    stack = torch_ops.kunlun_infer_plugin_info().stack  # doctor prints the chosen plugins' stacks
    assert stack["cpu_kernels"] == cpu_native.describe_planned()
    out = io.StringIO()
    assert main(["plugins"], stdout=out, stderr=io.StringIO()) == 0
    assert f"cpu_kernels {stack['cpu_kernels']}" in out.getvalue()
    if {"avx2", "fma", "f16c"} <= cpu_native.cpu_flags():
        assert stack["cpu_kernels"].startswith("avx2 (AVX2 + FMA kernels")
        assert "the CPU lacks amx_bf16, amx_int8, amx_tile, avx512_bf16" in stack["cpu_kernels"]
        assert "KUNLUN_INFER_CPU_ISA=avx2" in stack["cpu_kernels"]


@pytest.mark.parametrize("vocab", [1, 31, 33, 4096, 32003])
def test_native_token_bitmask_forbids_exactly_what_the_reference_forbids(native_kernel_set, vocab):
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32 + 1  # one word more than needed: bits past the vocabulary are ignored
    bitmask = torch.randint(-2**31, 2**31 - 1, (20, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[3] = -1
    bitmask[4] = 0
    logits = torch.randn(40, vocab, generator=g)
    rows = torch.randperm(40, generator=g)[:20]
    mine, want = logits.clone(), logits.clone()
    cpu_kernels.apply_token_bitmask(mine, bitmask, rows)
    reference.apply_token_bitmask(want, bitmask, rows)
    assert torch.equal(mine, want)
    assert bool(mine[rows[4]].isinf().all()) and torch.equal(mine[rows[3]], logits[rows[3]])


@pytest.mark.parametrize("vocab", [1, 7, 16, 31, 32, 33, 47, 1000, 151936])
def test_native_greedy_tokens_pick_what_torch_picks(native_kernel_set, vocab):
    """The first index of the largest value, wherever it lies: in either set of lanes, in the tail past the
    last whole pair of vectors, tied, beside NaNs, infinities and signed zeros; rows read at a stride."""
    g = torch.Generator().manual_seed(vocab)
    rows = torch.randn(40, vocab + 5, generator=g)
    rows[:, vocab:] = 1e9  # past each row's end: read, they would win
    logits = rows[:, :vocab]
    for r in range(16):  # the largest at each place a vector's lanes may hold it
        logits[r, (r * 37 + vocab - 1) % vocab] = 9.0
    logits[16, [0, vocab - 1]] = 9.0  # tied at both ends: the first
    logits[17, vocab // 3:] = 9.0  # tied from a third on
    logits[18, [vocab - 1, vocab // 2]] = float("nan")  # the first NaN, even before a larger value
    logits[18, 0] = float("inf")
    logits[19] = float("-inf")  # nothing drawable: index 0
    logits[20, [vocab // 4, vocab - 1]] = float("inf")
    logits[21] = -0.0
    logits[21, vocab - 1] = 0.0  # +0 equals -0: the first
    logits[22] = -1e30
    logits[22, vocab - 1] = -1e29  # the largest, in the last lane of the tail
    want = reference.greedy_tokens(logits)
    mine = cpu_kernels.greedy_tokens(logits)
    assert mine.dtype == torch.int64 and torch.equal(mine, want)
    assert int(mine[19]) == 0 and (vocab < 3 or int(mine[18]) == min(vocab // 2, vocab - 1))


def test_native_greedy_tokens_take_what_they_can_and_leave_the_rest_to_the_reference(native_kernel_set):
    """float32 rows of a 2-D tensor go through the native pass; another dtype, one row alone (1-D) or a
    transposed view is the reference's, and every one of them answers as ``argmax`` does."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=g)
    for x in (logits, logits.bfloat16(), logits[2], logits.t().contiguous().t()):
        assert torch.equal(cpu_kernels.greedy_tokens(x), x.argmax(dim=-1))


def _sample_case(vocab: int, seed: int):
    """Rows of every kind a step draws (logits, then the op's per-row arguments): wide and peaked logits, each
    filter alone and together, top-k past the vocabulary, tiny and huge temperatures, a flat row whose top-p
    nucleus ends among ties, masked and infinite logits, greedy rows among them."""
    g = torch.Generator().manual_seed(seed)
    settings = [  # temperature, top_k, top_p, min_p
        (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (0.8, 50, 1.0, 0.0), (1.0, 1, 1.0, 0.0), (1.0, 0, 0.9, 0.0),
        (0.7, 20, 0.8, 0.0), (1.0, 100, 0.95, 0.05), (1.0, 0, 1.0, 0.1), (1.2, vocab, 0.5, 0.0),
        (1e-4, 0, 0.9, 0.0), (1e30, 7, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (0.9, 0, 0.3, 0.0), (1.0, 3, 0.99, 0.0),
    ]
    rows = []
    for i in range(48):
        t, k, p, m = settings[i % len(settings)]
        kind = (i // len(settings)) % 3
        row = torch.randn(vocab, generator=g) * (3.0 if kind == 0 else 1.0)
        if kind == 1:  # peaked: a few likely tokens over a heavy tail
            row[torch.randint(vocab, (5,), generator=g)] += 12.0
        if kind == 2:  # Zipf-like
            row = -1.2 * torch.arange(1, vocab + 1).float().log()[torch.randperm(vocab, generator=g)]
        rows.append((row, t, k, p, m))
    logits = torch.stack([r[0] for r in rows])
    logits[12] = 0.5  # flat: top-p 0.3 keeps the first 30% of the ties in column order
    logits[5, ::3] = float("-inf")  # a grammar's mask
    logits[6, [1, vocab // 2]] = float("inf")  # a huge penalty's result: both weigh what the top one does
    logits[7] = float("-inf")  # nothing drawable: token 0
    temperature = torch.tensor([r[1] for r in rows])
    top_k = torch.tensor([r[2] for r in rows])
    top_p = torch.tensor([r[3] for r in rows])
    min_p = torch.tensor([r[4] for r in rows])
    return logits, temperature, top_k, top_p, min_p, torch.rand(len(rows), 2, generator=g)


@pytest.mark.parametrize("vocab", [5, 40, 1024, 1030, 33000])
def test_native_sample_tokens_draw_what_the_reference_draws(native_kernel_set, vocab):
    """Every row's token is the reference's: the same nucleus (top-k ties kept, top-p's boundary among ties, min-p)
    and the same block and token for the same uniforms, at widths of one block, one block and a short one, and many;
    rows read at a stride."""
    logits, *rest = _sample_case(vocab, vocab)
    wide = torch.full((logits.shape[0], vocab + 3), 1e9)  # past each row's end: read, a token there would win
    wide[:, :vocab] = logits
    want = reference.sample_tokens(logits, *rest)
    mine = cpu_kernels.sample_tokens(wide[:, :vocab], *rest)
    assert mine.dtype == torch.int64 and torch.equal(mine, want)
    assert int(mine[7]) == 0 and int(mine[11]) == int(logits[11].argmax())
    if vocab >= 40:
        assert int(mine[12]) < math.ceil(0.3 * vocab)  # the flat row: among the first of its ties


def test_native_sample_tokens_take_the_floor_and_block_width_the_reference_holds(native_kernel_set, monkeypatch):
    """The exponent floor and the draw's block width live in ``ops/reference.py`` alone: set otherwise there, the
    native pass draws what the reference then draws (blocks of 100 tokens; a floor of -2 that zeroes most tokens)."""
    logits, *rest = _sample_case(3000, 7)
    monkeypatch.setattr(reference, "DRAW_BLOCK", 100)
    monkeypatch.setattr(reference, "EXP_FLOOR", -2.0)
    monkeypatch.setattr(reference, "_FLOOR_WEIGHT", float(torch.tensor(-2.0).exp()))
    want = reference.sample_tokens(logits, *rest)
    assert torch.equal(cpu_kernels.sample_tokens(logits, *rest), want)


def test_native_sample_tokens_follow_the_distribution(native_kernel_set):
    """Over many uniforms a row's tokens come as often as its kept probabilities say (top-k 3, then top-p 0.8 of
    0.5, 0.3, 0.15: the first two tokens, 5:3), the block chosen by the first uniform."""
    vocab, n = 3000, 4000
    probs = torch.full((vocab,), 0.05 / (vocab - 3))
    probs[[10, 2000, 2999]] = torch.tensor([0.5, 0.3, 0.15])
    logits = probs.log().expand(n, vocab).contiguous()
    u = torch.rand(n, 2, generator=torch.Generator().manual_seed(3))
    tokens = cpu_kernels.sample_tokens(logits, torch.ones(n), torch.full((n,), 3), torch.full((n,), 0.8),
                                       torch.zeros(n), u)
    counts = torch.bincount(tokens, minlength=vocab)
    assert set(tokens.unique().tolist()) == {10, 2000}
    assert abs(int(counts[10]) / n - 0.625) < 0.03
    assert torch.equal((tokens == 2000), u[:, 0] >= 0.625)  # one token a block here: the first uniform decides


def test_native_sample_tokens_take_what_they_can_and_leave_the_rest_to_the_reference(native_kernel_set):
    """float32 rows and per-row arguments as the engine passes them go through the native pass; a transposed
    view or bf16 logits, or a float64 temperature, is the reference's, and every one answers as it does."""
    logits, *rest = _sample_case(200, 1)
    want = reference.sample_tokens(logits, *rest)
    assert torch.equal(cpu_kernels.sample_tokens(logits.t().contiguous().t(), *rest), want)
    temperature, top_k, top_p, min_p, u = rest
    assert torch.equal(cpu_kernels.sample_tokens(logits, temperature.double(), top_k, top_p, min_p, u),
                       reference.sample_tokens(logits, temperature.double(), top_k, top_p, min_p, u))
    half = logits.bfloat16()
    assert torch.equal(cpu_kernels.sample_tokens(half, *rest), reference.sample_tokens(half, *rest))


@pytest.mark.parametrize("seqs, hq, hk, d", [
    ([(1500, 1)], 8, 1, 16),  # one long context, one KV head: split among the threads
    ([(700, 1)], 14, 2, 16),  # two KV heads, more threads: the context in uneven parts, both heads in each
    ([(2000, 1), (5, 1), (513, 1)], 4, 1, 16),  # a context too short for every part beside long ones
    ([(1500, 1)], 8, 1, 64),  # the same with a head size the AMX tiles take in bf16
    ([(2000, 1), (5, 1), (513, 1)], 6, 1, 64),
    ([(1500, 1)], 20, 1, 64),  # two tiles of lanes, each writing its heads' parts
    ([(300, 1)], 8, 4, 16),  # too short to split: the KV heads in runs of 2 (2 threads), or one a thread
    ([(300, 1), (9, 1), (250, 1)], 12, 6, 16),  # three sequences: runs of 3 heads, whole sequences, one head a run
    ([(900, 1), (40, 1), (600, 1)], 16, 8, 128),  # wide tokens: parts whose rows of every head fit half of L2
    # many items a thread: with AVX-512 each thread claims its next item as it starts one (asking for its rows), and
    # one at a time once fewer are left than threads
    ([(7 + 37 * i % 400, 1) for i in range(34)], 14, 2, 64),
    ([(3 + 53 * i % 700, 1) for i in range(34)], 8, 2, 128),  # the longer contexts in parts
    # passes over the values of every shape: 5 and 3 query heads a KV head over 6 chunks of 8 features (AVX2: 4 + 2)
    ([(300, 1), (70, 1)], 10, 2, 48),
    ([(7 + 37 * i % 400, 1) for i in range(20)], 3, 1, 48),
])
@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_native_decode_attention_splits_work_among_threads(seqs, hq, hk, d, threads, dtype, tol, native_kernel_set):
    """However a step's sequences, contexts and KV heads are split among the threads (whole sequences, contexts in
    parts merged after, KV heads in runs), the result is the reference's, in the cache's dtype, as with one
    thread."""
    args = _batch(seqs, hq=hq, hk=hk, d=d, dtype=dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        split = cpu_kernels.paged_attention(*args)
        torch.set_num_threads(1)
        whole = cpu_kernels.paged_attention(*args)
    finally:
        torch.set_num_threads(before)
    assert split.dtype == dtype
    torch.testing.assert_close(split, reference.paged_attention(*args), rtol=tol, atol=tol)
    torch.testing.assert_close(split.float(), whole.float(), rtol=tol, atol=tol)
