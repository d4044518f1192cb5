/*
 * GEMM with float32 accumulation for every kernel set: Y[M, N] = X[M, K] @ W[N, K]^T (+ bias).
 *
 * Built by cpu_native.py, called by cpu_gemm.py. Weights are float32, or bf16 widened to float32 in
 * registers (where the kernel set has no AVX512-BF16 dot product; gemm_bf16.c serves bf16 there). Both
 * are packed once into tiles of NR = 2 * VLEN output features, [ceil(N / NR)][K][NR], so one tile of a
 * weight is one sequential stream. A bf16 tile keeps outputs j and j + VLEN in one 32-bit lane: shifts
 * turn one load into the two float32 vectors.
 *
 * The rows of X are taken MC at a time and packed to float32 in blocks of MR rows (fewer for the last), [K][rows],
 * so the micro-kernel broadcasts each row's value from one contiguous stream; it keeps an MR x NR block of Y
 * in registers over the whole of K (2 * MR accumulators), and writes it once. Tiles are shared among the
 * OpenMP threads. A decode step (M <= MR) reads each weight exactly once, at memory speed; a prefill
 * reuses each tile from cache for every block of rows, bounded by the FMA units.
 *
 * With AVX2 a prefill (from a number of rows measured per CPU, see chunked) takes each tile KC reductions at a time:
 * the chunk, widened to float32 once when the weight is bf16, stays in the first-level cache while every block of rows
 * multiplies it, and the blocks' sums wait in a small float32 buffer between chunks; the additions and their order are
 * those of one pass. Measured on a Zen 3 EPYC (AVX2 only, FMA peak ~175 GFLOP/s), in turns against one pass over K, at
 * 48 and 256 rows of the 0.5B model's layer shapes: bf16 1.36-1.64x (65-73 -> 94-111 GFLOP/s), float32 1.0-1.2x. While
 * the blocks multiply one chunk, the weight's next chunk is asked for, a share per block; with 96 rows per pass over
 * the weight (MC), rows packed in order and the chunk loop unrolled twice, the same GEMMs at 256 rows took 1.39x less
 * time again (bf16 104-127 -> 136-144 GFLOP/s, 77-80% of the probe beside them; float32 73-110 -> 107-128), the results
 * bit for bit the same.
 *
 * With AVX-512 a prefill of float32 weights keeps the blocks' pass over K whole, in registers, but takes K in chunks
 * where a pass's rows and two chunks of weight would not fit half of L2 (the down projection), and only the first block
 * of a tile waits on memory: the others ask for the weight's next chunk meanwhile (tile_chunk). On the Xeon with
 * AMX (2 threads, the 0.5B model's layer GEMMs in turns): 0.91-0.92x the time at 24-64 rows, 0.93-0.96x at 256,
 * 0.95-0.99x at 1024 (the down projection 0.91-0.95x, 217-243 -> 237-254 GFLOP/s), bit for bit the same; a float32
 * prefill in the engine 1.02-1.03x the tokens a second at 256 and 1024 tokens.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <omp.h>

#include "simd.h"

#define NR (2 * VLEN)
#if VLEN == 16
#define MR 12
#else
#define MR 6
#endif
/* rows of X packed at once (a multiple of MR for both kernel sets): each pass over the weight serves this many
 * rows. With AVX2, 96 rows against 48 (Zen 3, in turns, the 0.5B model's layer GEMMs at 256 rows): bf16 and
 * float32 1.05-1.25x, most where the weight does not fit the last-level cache (gate_up, down). */
#define MC 96

enum { WEIGHT_F32 = 0, WEIGHT_BF16 = 1 };

/* loops over rows and accumulator sets are unrolled so that the accumulators live in registers */
#define UNROLL _Pragma("GCC unroll 16")

int64_t kunlun_gemm_tile_n(void) { return NR; }

/* Pack W [N, K] float32 into P [ceil(N / NR)][K][NR]; rows past N are zero. */
void kunlun_pack_f32(const float *w, float *p, int64_t n, int64_t k) {
    const int64_t tiles = (n + NR - 1) / NR;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t q = 0; q < k; q++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t row = t * NR + j;
                p[(t * k + q) * NR + j] = row < n ? w[row * k + q] : 0.0f;
            }
}

#if !defined(__AVX512BF16__)
/* Pack W [N, K] bf16 into P [ceil(N / NR)][K][NR] bf16, lane j of a tile holding outputs j and j + VLEN. */
void kunlun_pack_bf16(const uint16_t *w, uint16_t *p, int64_t n, int64_t k) {
    const int64_t tiles = (n + NR - 1) / NR;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t q = 0; q < k; q++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t out = j % 2 == 0 ? j / 2 : VLEN + j / 2, row = t * NR + out;
                p[(t * k + q) * NR + j] = row < n ? w[row * k + q] : 0;
            }
}
#endif

/* `rows` rows of X from `x` (row stride k) as one float32 block [K][rows], written in order: a block of the
 * down projection (K = 4864, 117 KiB) filled one row at a time went MR times over more than the first-level
 * cache. As wide as its rows rather than MR: a decode step's block of one row (19 KiB there, not 117 with AVX2 or
 * 233 with AVX-512) or two stays in the first-level cache while every tile streams past it, where MR lanes, mostly
 * unused, had it read again from L2 for each tile. Zen 5, in turns, the 0.5B model's layer GEMMs at one row, bit
 * for bit the same: AVX2 bf16 0.83x the time at the host's faster memory level (~80 GB/s) and 0.94x at its slower
 * (~50), the down projection alone 0.79x and 0.90x; float32 0.90-0.93x at the faster level, the same at the
 * slower. */
INLINE void pack_block(const void *x, const int xbf16, const int64_t rows, int64_t k, float *block) {
    if (xbf16) {
        const uint16_t *src = (const uint16_t *)x;
        for (int64_t q = 0; q < k; q++)
            UNROLL for (int64_t r = 0; r < rows; r++) block[q * rows + r] = float_from_bf16(src[r * k + q]);
    } else {
        const float *src = (const float *)x;
        for (int64_t q = 0; q < k; q++)
            UNROLL for (int64_t r = 0; r < rows; r++) block[q * rows + r] = src[r * k + q];
    }
}

/* Rows [0, rows) of X (bf16 or float32, row stride k) as float32 blocks of `per_block` rows, each [K][its rows],
 * block b at b * K * MR. */
static void pack_rows(const void *x, const int xbf16, int64_t rows, int64_t k, int64_t per_block, float *dst) {
    const int64_t blocks = (rows + per_block - 1) / per_block;
    #pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const void *src = (const char *)x + b * per_block * k * (xbf16 ? 2 : 4);
        const int64_t n = rows - b * per_block < per_block ? rows - b * per_block : per_block;
        if (n == MR)
            pack_block(src, xbf16, MR, k, dst + b * k * MR);  /* a full block: the row loop unrolled */
        else
            pack_block(src, xbf16, n, k, dst + b * k * MR);
    }
}

/* The two float32 vectors of weight tile `w` at reduction index q. */
INLINE void weight_pair(const void *w, const int wkind, int64_t q, vf *w0, vf *w1) {
    if (wkind == WEIGHT_BF16) {
#if VLEN == 16
        const __m512i pair = _mm512_loadu_si512((const uint16_t *)w + q * NR);
        *w0 = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
        *w1 = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000u)));
#else
        const __m256i pair = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + q * NR));
        /* the high half kept by clearing the low one with itself, not with a mask: a block of 6 rows has 12 sums,
         * two weight vectors and a broadcast in the 16 registers, and a mask's register had made GCC spill a sum
         * (its every step then waited on a store and a load) */
        const __m256i low = _mm256_slli_epi32(pair, 16);
        *w0 = _mm256_castsi256_ps(low);
        *w1 = _mm256_castsi256_ps(_mm256_xor_si256(pair, _mm256_srli_epi32(low, 16)));
#endif
    } else {
        *w0 = vf_loadu((const float *)w + q * NR);
        *w1 = vf_loadu((const float *)w + q * NR + VLEN);
    }
}

/*
 * One block of Y (the first `rows` <= MR rows, NR columns) from packed rows `a` [K][rows] and weight tile `w`
 * [K][NR]. With few rows the FMA latency, not their throughput, would bound the loop: `phases` independent
 * sets of accumulators take turns over K so that 8 or more FMAs are in flight, and are summed at the end.
 * The weight stream is prefetched (simd.h) except float32 weights at one or two rows, whose few instructions a
 * line the hardware prefetchers alone keep fed: Zen 4, in turns, the layer GEMMs with the second-level prefetch,
 * AVX2: 1.07-1.12x the time at 1 row, 1.03x at 2, 0.92x at 4, 0.82x at 6, 0.71-0.91x at 8; AVX-512 without any
 * (against non-temporal at 1 row, second-level at 2): 0.89-0.98x at 1 row, 0.87-0.96x at 2, and a float32 decode
 * step in the engine 0.94x (three processes each, in turns; its head's GEMV 0.89x). What is asked for goes into
 * the second-level cache (see UNPREFETCHED in simd.h; bf16 with AVX-512 is gemm_bf16.c's).
 * Each pass of the loop takes at least one cache line of weight (with AVX2 a bf16 block of 4-6 rows takes two
 * reductions a pass), so that it asks for whole lines without testing where one starts. Zen 3, in turns, a
 * whole 0.5B model's bf16 GEMMs in huge pages, medians of 10-12 turns: 1 row 62.5 -> 60.1 ms, 4 rows 77.3 ->
 * 76.6, 8 rows 135.5 -> 126.9.
 * With AVX-512 a pass takes two reductions or more: a block of 12 rows from L2 on the Xeon with AMX, one core, ran
 * at 186-189 GFLOP/s against 180-181 taking one (the FMA probe ~210).
 * A block whose tile an earlier block has already read asks instead for `ahead` (see tile_chunk), spread evenly
 * over its passes, as many lines by the end of each pass as its share of them: where it has fewer lines than passes,
 * one every few passes rather than one a pass until they run out. Each ask holds one of the core's few first-level
 * miss buffers until memory answers, and the block's own loads from L2 need them too: asked for one a pass, the
 * blocks that asked ran up to 20% slower than the first. The Xeon with AMX, the 0.5B model's layer GEMMs in
 * float32, in turns against one a pass (7 turns, an A/A control of 0.99-1.01, two runs): 0.93x the time at 64 rows,
 * 0.93-0.95x at 256, 0.98-0.99x at 1024, 1.01-1.02x at 24 (which waits on memory). Against that (one every
 * passes / lines passes, rounded down, so that the asks ended early), the exact spread with two reductions a pass:
 * 0.94x at 64-1024 rows, two runs, the A/A control 0.98-1.00.
 * `sums` (float32 at `y`'s stride, or NULL for zero) are where the sums start: the sums of the reductions before `a`
 * and `w`, where K is taken in chunks.
 */
INLINE void micro_kernel(const float *a, const void *w, const int wkind, int64_t k, const float *bias,
                         void *y, int64_t ldy, int64_t cols, const int ybf16, const int rows, const int phases,
                         const float *sums, ahead_t ahead) {
    vf acc0[4][MR], acc1[4][MR];
    UNROLL for (int p = 0; p < phases; p++)
        UNROLL for (int r = 0; r < rows; r++) acc0[p][r] = acc1[p][r] = vf_zero();
    if (sums)
        UNROLL for (int r = 0; r < rows; r++) {
            acc0[0][r] = vf_load_n(sums, r * ldy, cols, 0);
            acc1[0][r] = vf_load_n(sums, r * ldy + VLEN, cols - VLEN, 0);
        }
    int64_t q = 0;
    const int64_t step = NR * (wkind == WEIGHT_BF16 ? 2 : 4);  /* bytes of weight per reduction index */
    /* reductions per pass: whole turns, a line or more; with AVX-512 two or more (see above) */
    const int line_turn = step * phases < 64 ? 64 / step : phases, turn = VLEN == 16 && line_turn < 2 ? 2 : line_turn;
    const int64_t passes = k / turn;
    int64_t credit = 0;
    for (; q + turn <= k; q += turn) {
        if (ahead.from) {
            ASK_SPREAD(ahead.from, ahead.lines, passes, credit);
        } else if (wkind == WEIGHT_BF16 || rows > 2) {
            prefetch_span((const char *)w + q * step, turn * step);
        }
        UNROLL for (int i = 0; i < turn; i++) {
            const int p = i % phases;
            vf w0, w1;
            weight_pair(w, wkind, q + i, &w0, &w1);
            UNROLL for (int r = 0; r < rows; r++) {
                const vf xr = vf_set1(a[(q + i) * rows + r]);
                acc0[p][r] = vf_fma(xr, w0, acc0[p][r]);
                acc1[p][r] = vf_fma(xr, w1, acc1[p][r]);
            }
        }
    }
    if (turn > 1)  /* the reductions left over by the turns */
        for (; q < k; q++) {
            vf w0, w1;
            weight_pair(w, wkind, q, &w0, &w1);
            UNROLL for (int r = 0; r < rows; r++) {
                const vf xr = vf_set1(a[q * rows + r]);
                acc0[0][r] = vf_fma(xr, w0, acc0[0][r]);
                acc1[0][r] = vf_fma(xr, w1, acc1[0][r]);
            }
        }
    const vf b0 = bias ? vf_load_n(bias, 0, cols, 0) : vf_zero();
    const vf b1 = bias ? vf_load_n(bias, VLEN, cols - VLEN, 0) : vf_zero();
    UNROLL for (int r = 0; r < rows; r++) {
        vf s0 = vf_add(acc0[0][r], b0), s1 = vf_add(acc1[0][r], b1);
        UNROLL for (int p = 1; p < phases; p++) {
            s0 = vf_add(s0, acc0[p][r]);
            s1 = vf_add(s1, acc1[p][r]);
        }
        vf_store_n(y, r * ldy, s0, cols, ybf16);
        if (cols > VLEN) vf_store_n(y, r * ldy + VLEN, s1, cols - VLEN, ybf16);
    }
}

/* accumulator sets for a block of R rows: at least 8 independent FMAs per reduction step, 12 for two rows
 * (measured at two rows: float32 12% faster than with 8, bf16 4%; an 8-row step's last two rows alike) */
#define PHASES(R) ((R) == 1 ? 4 : (R) == 2 ? 3 : (R) <= 3 ? 2 : 1)
#define ROWS_CASE(R) case R: micro_kernel(a, w, wkind, k, b, yt, n, cols, ybf16, R, PHASES(R), sums, ahead); break;

INLINE void block_of_rows(const float *a, const void *w, const int wkind, int64_t k, const float *b, void *yt,
                          int64_t n, int64_t cols, const int ybf16, int64_t rows, const float *sums, ahead_t ahead) {
    switch (rows) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6)
#if MR > 6
        ROWS_CASE(7) ROWS_CASE(8) ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12)
#endif
    }
}

#if VLEN == 8
/* reductions per chunk of a prefill's tile: KC x NR float32 weights (16 KiB) and a block's KC x MR rows
 * (6 KiB) fit the first-level cache together */
#define KC 256
/* Rows from which a GEMM takes its tiles in chunks, per weight kind (kunlun_gemm_set_chunk_rows; more than MR).
 * Below, the blocks read each tile whole (a bf16 decode step of 7 or 8 rows: 6, then 1 or 2 rows whose sets of
 * sums take turns over K, which the chunks' one set cannot). Which is faster differs between CPUs, so the engine
 * measures it on each at first use (cpu_tuning.py) and sets it here; these defaults are what Zen 3 measured, in
 * turns, on a whole 0.5B model's GEMMs (every weight its own copy, 1 GB of bf16 streamed as a decode step does):
 * bf16 at 7 and 8 rows took 12-19% less time whole than in chunks, even at 9 rows, the chunks faster from 10;
 * float32 at 8 rows 2-5% slower. Zen 4 measured chunks 1.4-1.5x slower at 8-32 float32 rows and 1.25-1.5x at
 * 10-24 bf16 rows, faster only from ~48 bf16 rows. */
static int64_t chunk_rows[2] = {MR + 1, MR + 3};
INLINE int chunked(int64_t m, const int wkind) { return m >= chunk_rows[wkind]; }

/* C [rows][NR] (float32 sums so far) += A [kc][rows] @ Wf [kc][NR] (float32) */
INLINE void chunk_kernel(const float *a, const float *wf, int64_t kc, float *c, const int rows) {
    fma_tile(a, rows, 1, wf, NR, kc, c, NR, rows, 2, 1);
}

#define CHUNK_CASE(R) case R: chunk_kernel(ab, wf, kc, cb, R); break;

/* One tile of Y for the `mc` rows packed in `blocks` blocks at `a`, K taken KC at a time (see the top). */
INLINE void tile_in_chunks(const float *a, int64_t blocks, int64_t mc, const void *w, const int wkind, int64_t k,
                           const float *bias, void *yt, int64_t n, int64_t cols, const int ybf16) {
    float c[MC * NR] __attribute__((aligned(64)));
    float widened[KC * NR] __attribute__((aligned(64)));
    const int64_t welem = wkind == WEIGHT_BF16 ? 2 : 4;
    memset(c, 0, sizeof(float) * (size_t)(mc * NR));
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
        const int64_t kc = k - k0 < KC ? k - k0 : KC;
        const float *wf = (const float *)w + k0 * NR;
        if (wkind == WEIGHT_BF16) {
            for (int64_t q = 0; q < kc; q++) {
                vf w0, w1;
                weight_pair(w, wkind, k0 + q, &w0, &w1);
                vf_storeu(widened + q * NR, w0);
                vf_storeu(widened + q * NR + VLEN, w1);
            }
            wf = widened;
        }
        /* the weight's next chunk (of this tile, else the next tile's first), asked for a share per block of
         * rows so that it is in cache when this one is done: the widening above no longer waits on memory */
        const char *next = (const char *)w + (k0 + kc) * NR * welem;
        const int64_t share = (KC * NR * welem / blocks + 63) / 64 * 64;
        for (int64_t blk = 0; blk < blocks; blk++) {
            const int64_t r0 = blk * MR, rows = mc - r0 < MR ? mc - r0 : MR;
            const float *ab = a + blk * k * MR + k0 * rows;
            float *cb = c + r0 * NR;
            for (int64_t b = blk * share; b < (blk + 1) * share; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
            switch (rows) {
                CHUNK_CASE(1) CHUNK_CASE(2) CHUNK_CASE(3) CHUNK_CASE(4) CHUNK_CASE(5) CHUNK_CASE(6)
            }
        }
    }
    const vf b0 = bias ? vf_load_n(bias, 0, cols, 0) : vf_zero();
    const vf b1 = bias ? vf_load_n(bias, VLEN, cols - VLEN, 0) : vf_zero();
    for (int64_t r = 0; r < mc; r++) {
        vf_store_n(yt, r * n, vf_add(vf_loadu(c + r * NR), b0), cols, ybf16);
        if (cols > VLEN) vf_store_n(yt, r * n + VLEN, vf_add(vf_loadu(c + r * NR + VLEN), b1), cols - VLEN, ybf16);
    }
}
#endif

int kunlun_one_row_prefetch = 0;

/* Whether one-row GEMMs with AVX-512 ask for their weight ahead as every other block does (1) or, reading it
 * once, for nothing (0: UNPREFETCHED in simd.h); returns 0. Not to be called while a GEMM runs. */
int kunlun_gemm_set_one_row_prefetch(int on) {
    kunlun_one_row_prefetch = on != 0;
    return 0;
}

int kunlun_gemm_one_row_prefetch(void) { return kunlun_one_row_prefetch; }

/* Rows from which float32 and bf16 GEMMs take their tiles in chunks (see chunked; raised to MR + 1 at least,
 * and INT64_MAX for never). Returns 0, or -1 where the kernel set has no chunked tiles (AVX-512). Not to be
 * called while a GEMM runs. */
int kunlun_gemm_set_chunk_rows(int64_t f32_rows, int64_t bf16_rows) {
#if VLEN == 8
    chunk_rows[WEIGHT_F32] = f32_rows > MR ? f32_rows : MR + 1;
    chunk_rows[WEIGHT_BF16] = bf16_rows > MR ? bf16_rows : MR + 1;
    return 0;
#else
    (void)f32_rows, (void)bf16_rows;
    return -1;
#endif
}

/* The rows from which GEMMs of weight kind `bf16` (0: float32) take their tiles in chunks; -1 without chunks. */
int64_t kunlun_gemm_chunk_rows(int bf16) {
#if VLEN == 8
    return chunk_rows[bf16 ? WEIGHT_BF16 : WEIGHT_F32];
#else
    (void)bf16;
    return -1;
#endif
}

/* Floats of one pass's packed rows: MC rows at a time, in whole blocks (a multiple of 16: the next pass's start
 * on a 64-byte line of its own). */
static int64_t pass_floats(int64_t m, int64_t k) {
    return ((m < MC ? (m + MR - 1) / MR * MR : MC) * k + 15) / 16 * 16;
}

/* The row buffer of a GEMM of M rows: one pass's rows, two where there is more than one pass (see gemm_share;
 * NULL without memory). */
static float *row_buffer(int64_t m, int64_t k) {
    return (float *)malloc(sizeof(float) * (size_t)pass_floats(m, k) * (m > MC ? 2 : 1));
}

int64_t kunlun_l2_bytes = 2 << 20;

/* kunlun_l2_bytes from the size of the core's L2, as the library loads (see simd.h) */
__attribute__((constructor)) static void read_l2_bytes(void) {
    const long bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (bytes > 0) kunlun_l2_bytes = bytes;
}

/* Whether a prefill's blocks take K in chunks that fit L2 and stream the weight ahead (tile_chunk): float32
 * weights with AVX-512, where it was measured faster. bf16 weights widened in registers (avx512-vnni and avx512-core
 * on the Xeon with AMX) took 0.99-1.00x the time at 256 rows and 1.01-1.04x at 24; float32 with AVX2 there,
 * 1.01-1.04x. Where K goes in chunks, the sums wait in Y between them: float32, as only float32 weights take chunks. */
#define STREAMS_AHEAD(wkind) (VLEN == 16 && (wkind) == WEIGHT_F32)

/* Reductions a pass of `mc` rows takes at a time (K where it fits): the pass's packed rows of a chunk (float32)
 * and two chunks of weight tile (this one and the next, asked for ahead) within half of L2. A pass of 96 rows of the
 * down projection (K = 4864, 1.9 MB of packed rows) had every block read its rows from L3. Half rather than amx.h's
 * pass_bytes() (3/4), which the tile GEMMs' passes measured best: the Xeon with AMX, the down projection at 256 and
 * 1024 rows, 3 chunks rather than 2, 0.96x the time (287 -> 299 GFLOP/s, bit for bit the same). A single block
 * (a decode step's rows) takes K whole: it reads its weight once, and chunks only cost it (1.05x at 12 rows). */
static int64_t reductions_per_chunk(int64_t mc, int64_t k, const int wkind) {
    if (!STREAMS_AHEAD(wkind) || mc <= MR) return k;
    const int64_t per_reduction = (mc + 2 * NR) * (int64_t)sizeof(float);  /* float32 rows and weight */
    const int64_t budget = kunlun_l2_bytes / 2, chunks = (k * per_reduction + budget - 1) / budget;
    return chunks <= 1 ? k : ((k + chunks - 1) / chunks + 15) / 16 * 16;
}

/* The reductions per chunk of a float32-weight GEMM's passes of up to MC of its `m` rows, K `k` (K: one chunk). */
int64_t kunlun_gemm_f32_chunk(int64_t m, int64_t k) { return reductions_per_chunk(m < MC ? m : MC, k, WEIGHT_F32); }

/* Reductions [k0, k0 + kc) of one tile of Y (row stride n) for the `mc` rows packed in `blocks` blocks at `a`, from
 * the chunk `wc` of the weight tile; the sums of the reductions before k0 are read back from Y (see STREAMS_AHEAD).
 * The first block reads the chunk from memory, asking for it ahead as it goes; every other block reads it from
 * cache and asks instead for a share of the `next_lines` lines at `next` (what this thread multiplies next, or
 * NULL), spread over its reductions, so the weight streams in while the blocks multiply rather than while the first
 * waits on it. */
INLINE void tile_chunk(const float *a, int64_t blocks, int64_t mc, const char *wc, const int wkind, int64_t k,
                       int64_t k0, int64_t kc, const char *next, int64_t next_lines, const float *bias, void *yt,
                       int64_t n, int64_t cols, const int ybf16) {
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t r0 = blk * MR, rows = mc - r0 < MR ? mc - r0 : MR;
        /* a block's own weight stream where `from` is NULL (see micro_kernel) */
        const ahead_t ahead = next && rows > 2 ? block_share(next, next_lines, blocks, blk) : (ahead_t){NULL, 0};
        void *yb = (char *)yt + r0 * n * (ybf16 ? 2 : 4);
        block_of_rows(a + blk * k * MR + k0 * rows, wc, wkind, kc, k0 + kc == k ? bias : NULL, yb, n, cols, ybf16,
                      rows, k0 > 0 ? (const float *)yb : NULL, ahead);
    }
}

/* Y [M, N] = X [M, K] @ W^T + bias; X and Y bf16 (xbf16) or float32; W packed by kunlun_pack_*; `rows_buffer`
 * from row_buffer. Every thread of the team calls it, and takes its own run of tiles, the same in every pass and
 * chunk. Passes of MC rows pack into the buffer's two halves in turn, so a thread done with its tiles of one pass
 * packs its share of the next while the others finish theirs: the team waits once a pass (for the packed rows), not
 * twice. No thread packs over rows still in use: it could pack pass i + 1 only past the wait of pass i, which every
 * thread reaches after its tiles of pass i - 1, the last to use that half. Zen 4, both builds in turns in one
 * process (medians of 15 turns, the 0.5B model's layer GEMMs at 256 rows, 2 threads), the results bit for bit the
 * same: AVX2 in chunks 0.91-0.99 of the time in bf16 (four runs), 0.96-1.0 in float32; AVX-512 float32 0.98.
 * Where K goes in chunks a thread takes every tile's first chunk, then every tile's second, and so on, so that the
 * pass's rows of a chunk stay in L2 while the weight streams past them; taking each tile's chunks in turn, every
 * chunk had read its rows again from L3. The Xeon with AMX, the down projection at 256 rows, in turns: 259 -> 282
 * GFLOP/s, bit for bit the same. A thread's last tile of a chunk asks for its first tile's next chunk, or (with a
 * pass to come) its first chunk, rather than for the next thread's tile. */
INLINE void gemm_share(const void *p, const int wkind, const void *x, const int xbf16, const float *bias, void *y,
                       int64_t m, int64_t n, int64_t k, float *rows_buffer) {
    const int64_t tiles = (n + NR - 1) / NR, welem = wkind == WEIGHT_BF16 ? 2 : 4, tile_bytes = k * NR * welem;
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t first = tiles * me / team, last = tiles * (me + 1) / team;  /* this thread's tiles */
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
        const int64_t mc = m - m0 < MC ? m - m0 : MC;
        /* full blocks of MR rows, then the rest (8 rows: 6 + 2, whose 2 rows take turns over K): measured
         * faster than equal blocks (4 + 4), whose 8 accumulators only just cover the FMA latency */
        const int64_t blocks = (mc + MR - 1) / MR, per_block = MR;
        float *packed = rows_buffer + m0 / MC % 2 * pass_floats(m, k);
        const int64_t chunk = reductions_per_chunk(mc, k, wkind);
        pack_rows((const char *)x + m0 * k * (xbf16 ? 2 : 4), xbf16, mc, k, per_block, packed);  /* then a wait */
        void *yp = (char *)y + m0 * n * (xbf16 ? 2 : 4);
#if VLEN == 8
        if (chunked(m, wkind)) {
            for (int64_t t = first; t < last; t++) {
                const int64_t col = t * NR, cols = n - col < NR ? n - col : NR;
                tile_in_chunks(packed, blocks, mc, (const char *)p + t * tile_bytes, wkind, k, bias ? bias + col : NULL,
                               (char *)yp + col * (xbf16 ? 2 : 4), n, cols, xbf16);
            }
            continue;
        }
#endif
        for (int64_t k0 = 0; k0 < k; k0 += chunk) {
            const int64_t kc = k - k0 < chunk ? k - k0 : chunk;
            for (int64_t t = first; t < last; t++) {
                const int64_t col = t * NR, cols = n - col < NR ? n - col : NR;
                int64_t next_kc;  /* all the thread's tiles take a chunk in turn: one group */
                const char *next = next_chunk((const char *)p, tile_bytes, NR * welem, t, first, last, first, last,
                                              k0, kc, k, chunk, m0 + MC < m, &next_kc);
                tile_chunk(packed, blocks, mc, (const char *)p + t * tile_bytes + k0 * NR * welem, wkind, k, k0, kc,
                           STREAMS_AHEAD(wkind) ? next : NULL, next_kc * NR * welem / 64, bias ? bias + col : NULL,
                           (char *)yp + col * (xbf16 ? 2 : 4), n, cols, xbf16);
            }
        }
    }
}

/* The exported GEMMs each open their own parallel region: OpenMP outlines a region before anything is inlined,
 * so one region in a function both weight kinds share had become one outlined body taking the weight kind (and
 * with it the widening and the reductions per pass) as a variable inside the micro-kernel's loop. Zen 3, in turns
 * against that build, bit for bit the same: a block of 6 rows from cache bf16 85-91 -> 102-111 GFLOP/s (with the
 * widening in weight_pair), float32 92 -> 129; a whole 0.5B model's bf16 GEMMs streamed at 8 rows 98.6 -> 87.7 ms
 * (medians of 6 turns), 1 row 60.5 -> 58.2. Each returns -1 (having written nothing) if the row buffer cannot be
 * allocated, else 0. */
#define GEMM_PARALLEL(wkind, xbf16)                                        \
    float *packed = row_buffer(m, k);                                      \
    if (packed == NULL) return -1;                                         \
    _Pragma("omp parallel if (m * n * k >= 32768)")                        \
    gemm_share(p, wkind, x, xbf16, bias, y, m, n, k, packed);              \
    free(packed);                                                          \
    return 0;

/* Y [M, N] float32 = X [M, K] float32 @ W^T + bias, W packed by kunlun_pack_f32. */
int kunlun_gemm_f32(const float *p, const float *x, const float *bias, float *y, int64_t m, int64_t n, int64_t k) {
    GEMM_PARALLEL(WEIGHT_F32, 0)
}

#if !defined(__AVX512BF16__)
/* Y [M, N] bf16 = X [M, K] bf16 @ W^T + bias (float32 or NULL), W packed by kunlun_pack_bf16. */
int kunlun_gemm_bf16(const uint16_t *p, const uint16_t *x, const float *bias, uint16_t *y, int64_t m, int64_t n,
                     int64_t k) {
    GEMM_PARALLEL(WEIGHT_BF16, 1)
}
#endif

/*
 * Memory read bandwidth: the threads sum n float32 values from p in shares of one stream each (four vector
 * accumulators). Returns the sum (so nothing is optimised away) - time it to get bytes per second, as
 * benchmarks/perf_cpu.py does beside every batch-1 measurement.
 */
double kunlun_read_probe(const float *p, int64_t n) {
    double total = 0.0;
    #pragma omp parallel reduction(+ : total)
    {
        vf a0 = vf_zero(), a1 = vf_zero(), a2 = vf_zero(), a3 = vf_zero();
        const int64_t vectors = n / (4 * VLEN);
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < vectors; i++) {
            const float *q = p + i * 4 * VLEN;
            a0 = vf_add(a0, vf_loadu(q));
            a1 = vf_add(a1, vf_loadu(q + VLEN));
            a2 = vf_add(a2, vf_loadu(q + 2 * VLEN));
            a3 = vf_add(a3, vf_loadu(q + 3 * VLEN));
        }
        total = vf_sum(vf_add(vf_add(a0, a1), vf_add(a2, a3)));
    }
    for (int64_t i = n / (4 * VLEN) * 4 * VLEN; i < n; i++) total += p[i];
    return total;
}

/*
 * The FMA units at full speed: every thread runs `iterations` rounds of 12 independent vector FMAs.
 * Returns the floating-point operations done (2 per lane per FMA) — time it to get the peak FLOP/s.
 */
double kunlun_fma_probe(int64_t iterations) {
    double flops = 0.0;
    #pragma omp parallel reduction(+ : flops)
    {
        vf a0 = vf_set1(0.f), a1 = vf_set1(1.f), a2 = vf_set1(2.f), a3 = vf_set1(3.f), a4 = vf_set1(4.f);
        vf a5 = vf_set1(5.f), a6 = vf_set1(6.f), a7 = vf_set1(7.f), a8 = vf_set1(8.f), a9 = vf_set1(9.f);
        vf a10 = vf_set1(10.f), a11 = vf_set1(11.f);
        const vf m = vf_set1(0.999999f), c = vf_set1(1e-7f);
        for (int64_t it = 0; it < iterations; it++) {
            a0 = vf_fma(a0, m, c); a1 = vf_fma(a1, m, c); a2 = vf_fma(a2, m, c); a3 = vf_fma(a3, m, c);
            a4 = vf_fma(a4, m, c); a5 = vf_fma(a5, m, c); a6 = vf_fma(a6, m, c); a7 = vf_fma(a7, m, c);
            a8 = vf_fma(a8, m, c); a9 = vf_fma(a9, m, c); a10 = vf_fma(a10, m, c); a11 = vf_fma(a11, m, c);
            __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7),
                             "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
        }
        const vf total = vf_add(vf_add(vf_add(a0, a1), vf_add(a2, a3)), vf_add(vf_add(a4, a5), vf_add(a6, a7)));
        const float sink = vf_sum(vf_add(total, vf_add(vf_add(a8, a9), vf_add(a10, a11))));
        flops = (double)iterations * 12 * VLEN * 2 + (sink == 12345.0f);
    }
    return flops;
}
