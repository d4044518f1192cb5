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
 * rows: four accumulator tiles (2 row blocks x 2 output halves) over the whole of K, 32 reductions a step;
 * a ragged end of K goes through zero-padded copies. Sums are float32 as on the vector path; the order of
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

/* rows r0.. of Y for weight tile pt (up to 32 rows, `rows` of them), over the whole of K, asking for `lines` lines
 * from `ahead` (amx_share) */
static void amx_block(const uint16_t *pt, const uint16_t *x, int64_t k, const float *bias, uint16_t *y, int64_t ldy,
                      int rows, __mmask16 mask0, __mmask16 mask1, const char *ahead, int64_t lines) {
    const int two = rows > 16;
    const int64_t ldx = k * (int64_t)sizeof(uint16_t), full = k / AMX_K * AMX_K;
    const int64_t steps = full / AMX_K;
    int64_t credit = 0;
    for (int64_t q = 0; q < full; q += AMX_K) {
        ASK_SPREAD(ahead, lines, steps, credit);
        AMX_STEP(_tile_dpbf16ps, x + q, ldx, pt + q * TILE_N, two);
    }
    if (full < k) { /* the ragged end of K: zero-padded copies of its rows and of its pairs of the weight */
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
    float sums[32][32] __attribute__((aligned(64)));
    amx_store_sums(sums, rows);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(mask0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(mask1, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 lo = _mm512_add_ps(_mm512_load_ps(sums[r]), b0);
        const __m512 hi = _mm512_add_ps(_mm512_load_ps(sums[r] + 16), b1);
        _mm256_mask_storeu_epi16(y + r * ldy, mask0, (__m256i)_mm512_cvtneps_pbh(lo));
        _mm256_mask_storeu_epi16(y + r * ldy + 16, mask1, (__m256i)_mm512_cvtneps_pbh(hi));
    }
}

static void amx_gemm(const uint16_t *p, const uint16_t *x, const float *bias, uint16_t *y, int64_t m, int64_t n,
                     int64_t k) {
    const int64_t tiles = (n + TILE_N - 1) / TILE_N, pass = amx_pass_rows(m, k * (int64_t)sizeof(uint16_t));
    #pragma omp parallel
    {
        int configured = -1;
        for (int64_t p0 = 0; p0 < m; p0 += pass) {
            const int64_t p1 = m - p0 < pass ? m : p0 + pass;
            #pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < tiles; t++) {
                const __mmask16 mask0 = tail_mask(n - t * TILE_N), mask1 = tail_mask(n - t * TILE_N - 16);
                const uint16_t *pt = p + t * k * TILE_N, *next = t + 1 < tiles ? pt + k * TILE_N : NULL;
                const float *bt = bias ? bias + t * TILE_N : NULL;
                for (int64_t r0 = p0; r0 < p1; r0 += 32) {
                    const int rows = p1 - r0 < 32 ? (int)(p1 - r0) : 32;
                    const ahead_t ahead = amx_share(next, k * TILE_N * (int64_t)sizeof(uint16_t),
                                                    (p1 - p0) * k * (int64_t)sizeof(uint16_t), (p1 - p0 + 31) / 32,
                                                    (r0 - p0) / 32);
                    amx_start_block(rows, &configured);
                    amx_block(pt, x + r0 * k, k, bt, y + r0 * n + t * TILE_N, n, rows, mask0, mask1, ahead.from,
                              ahead.lines);
                }
            }
        }
        _tile_release();
    }
}
#endif

/* Y [M, N] bf16 = X [M, K] bf16 @ W^T + bias (float32 [N] or NULL), W packed by kunlun_pack_bf16. Returns 0. */
int kunlun_gemm_bf16(const uint16_t *p, const uint16_t *x, const float *bias, uint16_t *y,
                      int64_t m, int64_t n, int64_t k) {
#if defined(__AMX_BF16__)
    if (kunlun_amx_tiles()) {
        amx_gemm(p, x, bias, y, m, n, k);
        return 0;
    }
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
