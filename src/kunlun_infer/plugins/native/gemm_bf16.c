/*
 * bf16 GEMM for the host CPU with AVX512-BF16: Y[M, N] = X[M, K] @ W[N, K]^T (+ bias), float32 accumulation.
 *
 * Built by cpu_native.py into the kernel sets with AVX512-BF16 (gemm.c serves bf16 elsewhere), called by
 * cpu_gemm.py. The weight is packed once into tiles of 32
 * output features with the reduction dimension in pairs, [ceil(N / 32)][K / 2][32][2], so one 64-byte
 * load feeds one VDPBF16PS for 16 outputs and the activations are broadcast two at a time: no horizontal
 * sums, and each tile of the weight is read as one sequential stream. Every tile of 32 outputs computes
 * up to 12 rows of X at once (24 accumulators); the tiles are shared among the OpenMP threads of the
 * process, so a decode step with a few rows streams each weight once at memory speed and a larger batch
 * reuses it from cache.
 */
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "simd.h"

#if defined(__AVX512BF16__)

#define TILE_N 32
#define MAX_ROWS 12

/* Pack W [N, K] (row-major bf16) into P [ceil(N / 32)][K / 2][32][2]; rows past N are zero. K is even. */
void kunlun_pack_bf16(const uint16_t *w, uint16_t *p, int64_t n, int64_t k) {
    const int64_t pairs = k / 2, tiles = (n + TILE_N - 1) / TILE_N;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        uint32_t *dst = (uint32_t *)(p + t * k * TILE_N);
        for (int64_t j = 0; j < TILE_N; j++) {
            const int64_t row = t * TILE_N + j;
            const uint32_t *src = (const uint32_t *)(w + row * k);
            for (int64_t q = 0; q < pairs; q++)
                dst[q * TILE_N + j] = row < n ? src[q] : 0;
        }
    }
}

static inline __attribute__((always_inline)) void tile_rows(
        const uint16_t *p, const uint16_t *x, int64_t k, const float *bias, uint16_t *y, int64_t ldy,
        __mmask16 mask0, __mmask16 mask1, const int rows, const int once) {
    __m512 acc0[MAX_ROWS], acc1[MAX_ROWS];
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(mask0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(mask1, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        acc0[r] = b0;
        acc1[r] = b1;
    }
    const int32_t *x_pairs = (const int32_t *)x;
    const int64_t pairs = k / 2;
    for (int64_t q = 0; q < pairs; q++) {
        /* a decode step of one row asks for nothing: one VDPBF16PS per 64 bytes, which the hardware prefetchers keep
         * fed (Zen 4, a bf16 batch-1 step in the engine, six processes each in turns against the non-temporal
         * prefetch: faster in every pair, medians 34.0 -> 31.6 ms) */
        if (!UNPREFETCHED(once, rows)) prefetch_span(p + q * 2 * TILE_N, 4 * TILE_N);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(p + q * 2 * TILE_N);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(p + q * 2 * TILE_N + 32);
        for (int r = 0; r < rows; r++) {
            const __m512bh xr = (__m512bh)_mm512_set1_epi32(x_pairs[r * pairs + q]);
            acc0[r] = _mm512_dpbf16_ps(acc0[r], w0, xr);
            acc1[r] = _mm512_dpbf16_ps(acc1[r], w1, xr);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_mask_storeu_epi16(y + r * ldy, mask0, (__m256i)_mm512_cvtneps_pbh(acc0[r]));
        _mm256_mask_storeu_epi16(y + r * ldy + 16, mask1, (__m256i)_mm512_cvtneps_pbh(acc1[r]));
    }
}

#define ROWS_CASE(R) case R: tile_rows(pt, xr, k, bt, yr, n, mask0, mask1, R, once); break;

#if defined(__AMX_BF16__)
/*
 * With AMX every GEMM multiplies the same packed weight on the tile unit. A pair row of a weight tile,
 * [32][2] bf16, is two rows of an AMX B tile side by side (outputs 0-15, then 16-31), so B tiles load
 * straight from the packing with a 128-byte stride, and A tiles from X with its row stride. Each thread
 * takes its share of the weight tiles, as the vector path does, and for each tile every block of up to 32
 * rows: four accumulator tiles (2 row blocks x 2 output halves) over the whole of K, or over chunks of it
 * with the sums kept between them (amx.h's amx_walk), 32 reductions a step; a ragged end of K goes
 * through zero-padded copies. Sums are float32 as on the vector path; the order of
 * the additions within a step is the hardware's, so results may differ from it in the last bit (a row's
 * result does not depend on the other rows of the call). Measured on a Xeon with AMX (2 threads, the 0.5B
 * model's layer GEMMs in bf16, against the VDPBF16PS path of this file and oneDNN's tile kernels): 1 row
 * 0.80-0.85x the vector path's time (the weights stream at the read probe's ~23 GB/s, the vector path at
 * ~19), 8 rows 0.78x, 16 rows 0.39x and 0.85x oneDNN's, 256 rows 0.14x (1.6-1.9 TFLOP/s) and 1.1x oneDNN's.
 */
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_K 32 /* reductions a tile step takes: 32 bf16, 64 bytes */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands a process the tile registers' state only when asked: 1 once granted, -1 if refused */
static int amx_permission;

int kunlun_amx_tiles(void) {
    int state = __atomic_load_n(&amx_permission, __ATOMIC_ACQUIRE);
    if (state == 0) {
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&amx_permission, state, __ATOMIC_RELEASE);
    }
    return state > 0;
}

/* the operands of a tile GEMM, for amx_walk's blocks */
typedef struct {
    const uint16_t *p, *x;
    const float *bias;
    uint16_t *y;
    int64_t n, k;
} amx_gemm_t;

/* amx_walk's block: reductions [b0 / 2, (b0 + bytes) / 2) of rows r0.. of Y for weight tile t */
static inline __attribute__((always_inline)) void amx_block(const void *gemm, int64_t t, int64_t r0, int rows,
                                                            int64_t b0, int64_t bytes, void *carry,
                                                            const char *ahead, int64_t lines, int near) {
    const amx_gemm_t *g = (const amx_gemm_t *)gemm;
    const int64_t k = g->k, k0 = b0 / 2, end = (b0 + bytes) / 2, ldx = k * (int64_t)sizeof(uint16_t);
    const int64_t full = end == k ? k / AMX_K * AMX_K : end, steps = (full - k0) / AMX_K;
    const uint16_t *pt = g->p + t * k * TILE_N, *x = g->x + r0 * k;
    const int two = rows > 16;
    if (k0 > 0) amx_load_sums(carry, rows);
    int64_t credit = 0;
    for (int64_t q = k0; q < full; q += AMX_K) {
        ASK_SPREAD(ahead, lines, steps, credit);
        AMX_KICK(ahead, rows, q / AMX_K, pt + q * TILE_N, near);
        AMX_STEP(_tile_dpbf16ps, x + q, ldx, pt + q * TILE_N, two);
    }
    if (full < end) { /* the ragged end of K: zero-padded copies of its rows and of its pairs of the weight */
        const int64_t left = k - full;
        uint16_t xs[32][AMX_K] __attribute__((aligned(64)));
        uint16_t ws[AMX_K / 2][2 * TILE_N] __attribute__((aligned(64)));
        memset(xs, 0, sizeof xs);
        memset(ws, 0, sizeof ws);
        for (int r = 0; r < rows; r++)
            memcpy(xs[r], x + r * k + full, left * sizeof(uint16_t));
        memcpy(ws, pt + full * TILE_N, left * TILE_N * sizeof(uint16_t));
        AMX_MEMORY_BARRIER();
        AMX_STEP(_tile_dpbf16ps, xs, AMX_K * (int64_t)sizeof(uint16_t), ws, two);
    }
    if (end < k) {
        amx_store_sums(carry, rows);
        return;
    }
    float sums[32][32] __attribute__((aligned(64)));
    amx_store_sums(sums, rows);
    const int64_t col = t * TILE_N;
    const __mmask16 mask0 = tail_mask(g->n - col), mask1 = tail_mask(g->n - col - 16);
    const float *bias = g->bias ? g->bias + col : NULL;
    const __m512 b0s = bias ? _mm512_maskz_loadu_ps(mask0, bias) : _mm512_setzero_ps();
    const __m512 b1s = bias ? _mm512_maskz_loadu_ps(mask1, bias + 16) : _mm512_setzero_ps();
    uint16_t *y = g->y + r0 * g->n + col;
    for (int r = 0; r < rows; r++) {
        const __m512 lo = _mm512_add_ps(_mm512_load_ps(sums[r]), b0s);
        const __m512 hi = _mm512_add_ps(_mm512_load_ps(sums[r] + 16), b1s);
        _mm256_mask_storeu_epi16(y + r * g->n, mask0, (__m256i)_mm512_cvtneps_pbh(lo));
        _mm256_mask_storeu_epi16(y + r * g->n + 16, mask1, (__m256i)_mm512_cvtneps_pbh(hi));
    }
}

/* How `team` threads walk a tile GEMM of M rows and N outputs whose reduction takes `reduction` bytes a row, the
 * rows of X `xrow` bytes (bf16: 2 K both; int8: K in groups of 4, and K padded to 64): plan[0..3] = amx_plan's
 * chunk, pass, group and room. For tests and benchmarks. */
void kunlun_amx_gemm_plan(int64_t m, int64_t n, int64_t reduction, int64_t xrow, int64_t team, int64_t *plan) {
    const amx_plan_t p = amx_plan(m, (n + TILE_N - 1) / TILE_N, team, reduction, xrow);
    plan[0] = p.chunk, plan[1] = p.pass, plan[2] = p.group, plan[3] = p.room;
}

/* Returns 0, or -1 (nothing written) without memory for the sums between chunks of K */
static int amx_gemm(const uint16_t *p, const uint16_t *x, const float *bias, uint16_t *y, int64_t m, int64_t n,
                    int64_t k) {
    const amx_gemm_t gemm = {p, x, bias, y, n, k};
    const int64_t tiles = (n + TILE_N - 1) / TILE_N, reduction = k * (int64_t)sizeof(uint16_t);
    int failed = 0, status = 0;
    #pragma omp parallel
    {
        if (amx_walk(m, tiles, reduction, reduction, (const char *)p, amx_block, &gemm, &failed) != 0) {
            #pragma omp atomic write
            status = -1;
        }
        _tile_release();
    }
    return status;
}
#endif

/* Y [M, N] bf16 = X [M, K] bf16 @ W^T + bias (float32 [N] or NULL), W packed by kunlun_pack_bf16. Returns 0, or -1
 * (nothing written) without memory. */
int kunlun_gemm_bf16(const uint16_t *p, const uint16_t *x, const float *bias, uint16_t *y,
                      int64_t m, int64_t n, int64_t k) {
#if defined(__AMX_BF16__)
    if (kunlun_amx_tiles()) return amx_gemm(p, x, bias, y, m, n, k);
#endif
    const int64_t tiles = (n + TILE_N - 1) / TILE_N;
    const int once = reads_once(m, MAX_ROWS);
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const __mmask16 mask0 = tail_mask(n - t * TILE_N), mask1 = tail_mask(n - t * TILE_N - 16);
        const uint16_t *pt = p + t * k * TILE_N;
        const float *bt = bias ? bias + t * TILE_N : NULL;
        for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
            const uint16_t *xr = x + r0 * k;
            uint16_t *yr = y + r0 * n + t * TILE_N;
            switch (m - r0 < MAX_ROWS ? m - r0 : MAX_ROWS) {
                ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6)
                ROWS_CASE(7) ROWS_CASE(8) ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12)
            }
        }
    }
    return 0;
}

#endif
