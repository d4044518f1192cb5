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
        if (!(once && rows == 1)) prefetch_span(p + q * 2 * TILE_N, 4 * TILE_N, 0);
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

#define ROWS_CASE(R) case R: tile_rows(pt, xr, k, bt, yr, n, mask0, mask1, R, m <= MAX_ROWS); break;

/* Y [M, N] bf16 = X [M, K] bf16 @ W^T + bias (float32 [N] or NULL), W packed by kunlun_pack_bf16. Returns 0. */
int kunlun_gemm_bf16(const uint16_t *p, const uint16_t *x, const float *bias, uint16_t *y,
                      int64_t m, int64_t n, int64_t k) {
    const int64_t tiles = (n + TILE_N - 1) / TILE_N;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t left = n - t * TILE_N;
        const __mmask16 mask0 = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
        const __mmask16 mask1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
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
