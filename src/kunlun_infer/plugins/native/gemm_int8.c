/*
 * int8 GEMM for every kernel set: Y[M, N] = (X quantized per row) @ (W int8, one scale per output)^T (+ bias).
 *
 * Built by cpu_native.py, called by cpu_gemm.py; the meaning is ops.reference.int8_linear. Each row of X
 * is quantized at run time, symmetric, scale = max|x| / 127, q = round(x / scale) (half to even), the
 * integer products are summed exactly in int32, and the sum is scaled by both scales in float32.
 *
 * W is packed once into tiles of NR = 2 * VLEN outputs with the reduction in groups of four,
 * [ceil(N / NR)][ceil(K / 4)][NR][4] int8, followed by the scales (float32) and, for the unsigned x signed
 * dot products, 128 * sum_k W[n, k] (int32), both padded to the tiles. One 32-bit lane of a weight vector
 * is four reductions of one output, which is what the dot-product instructions take:
 *   - AVX512-VNNI / AVX-VNNI: VPDPBUSD, with x offset by 128 into unsigned bytes (the offset's
 *     contribution, 128 * sum_k W, is subtracted at the end);
 *   - AVX2: |x| times W with x's sign (VPSIGNB), pairs summed to int16 by VPMADDUBSW (at most
 *     2 * 127 * 127, no saturation), then to int32 by VPMADDWD (AVX-512 without VNNI the same, W negated
 *     under the mask of x's sign bits for want of VPSIGNB). |x| is stored beside x when the rows are
 *     quantized, so the kernel spends no instruction on it per tile; with the sums added in place (no
 *     accumulator copied or spilled) and the prefetch kind chosen outside its loop, the 0.5B model's layer
 *     GEMMs took 1.2-1.3x less time at 8 to 256 rows on a Zen 3 (in turns; 0.95-1.0x the float32 FMA probe,
 *     where the instruction mix itself allows ~1.1x).
 * Rows of X are quantized MC at a time (VLEN values a step) into blocks of MR rows (fewer for the last),
 * [K / 4][XW][rows] 32-bit groups; the micro-kernel holds an MR x NR block of sums in registers over all of
 * K, as in gemm.c.
 */
#include <stdint.h>
#include <stdlib.h>

#include "amx.h"
#include "simd.h"

#define NR (2 * VLEN)
#if VLEN == 16
#if defined(__AVX512VNNI__)
#define MR 12
#define VNNI 1
#else
#define MR 6
#define VNNI 0
#endif
typedef __m512i vi;
INLINE vi vi_zero(void) { return _mm512_setzero_si512(); }
INLINE vi vi_load(const int8_t *p) { return _mm512_loadu_si512(p); }
INLINE vi vi_set1(uint32_t x) { return _mm512_set1_epi32((int)x); }
INLINE vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
INLINE vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
INLINE vi vi_loadu32(const int32_t *p) { return _mm512_loadu_si512(p); }
INLINE vf vi_to_vf(vi a) { return _mm512_cvtepi32_ps(a); }
#if VNNI
/* VPDPBUSD through asm: GCC's builtin copies every accumulator through a spare register around it */
INLINE vi dot4(vi acc, vi x, vi ax, vi w) {
    (void)ax;
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
    return acc;
}
#else
/* the AVX2 sign trick below at 16 lanes; AVX-512 has no VPSIGNB, so W is negated under the mask of x's sign
 * bits (where x is 0 its magnitude zeroes the product) */
INLINE vi dot4(vi acc, vi x, vi ax, vi w) {
    const vi signed_w = _mm512_mask_sub_epi8(w, _mm512_movepi8_mask(x), _mm512_setzero_si512(), w);
    const vi sums = _mm512_madd_epi16(_mm512_maddubs_epi16(ax, signed_w), _mm512_set1_epi16(1));
    __asm__("vpaddd %1, %0, %0" : "+v"(acc) : "v"(sums));  /* in place: see dot4 above */
    return acc;
}
#endif
#else
#if defined(__AVXVNNI__)
#define MR 6
#define VNNI 1
#else
#define MR 4
#define VNNI 0
#endif
typedef __m256i vi;
INLINE vi vi_zero(void) { return _mm256_setzero_si256(); }
INLINE vi vi_load(const int8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE vi vi_set1(uint32_t x) { return _mm256_set1_epi32((int)x); }
INLINE vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
INLINE vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
INLINE vi vi_loadu32(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE vf vi_to_vf(vi a) { return _mm256_cvtepi32_ps(a); }
#if VNNI
INLINE vi dot4(vi acc, vi x, vi ax, vi w) {
    (void)ax;
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(x), "x"(w));
    return acc;
}
#else
/* x: four signed bytes per lane (|x| <= 127), ax: their magnitudes; w: signed bytes */
INLINE vi dot4(vi acc, vi x, vi ax, vi w) {
    const vi sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w, x)), _mm256_set1_epi16(1));
    __asm__("vpaddd %1, %0, %0" : "+x"(acc) : "x"(sums));  /* in place: see dot4 above */
    return acc;
}
#endif
#endif
#define MC (8 * MR)
/* 32-bit words a row's group of four takes in a block of X: the bytes, and for the sign trick their magnitudes
 * too ([K / 4][XW][rows]), worked out once per row rather than once per tile */
#define XW (VNNI ? 1 : 2)
/* how quantized x is stored: offset to unsigned for VPDPBUSD, signed for the AVX2 sign trick */
#define X_OFFSET (VNNI ? 128 : 0)

#define UNROLL _Pragma("GCC unroll 16")

int64_t kunlun_int8_tile_n(void) { return NR; }

/* Bytes of a packed [N, K] int8 weight: the tiles, then scales and offset sums padded to the tiles. */
int64_t kunlun_int8_packed_bytes(int64_t n, int64_t k) {
    const int64_t tiles = (n + NR - 1) / NR, groups = (k + 3) / 4;
    return tiles * NR * (groups * 4 + (int64_t)sizeof(float) + (int64_t)sizeof(int32_t));
}

/* Pack W [N, K] int8 (|w| <= 127) and its scales [N] float32 into P (kunlun_int8_packed_bytes(n, k) bytes). */
void kunlun_pack_int8(const int8_t *w, const float *scale, int8_t *p, int64_t n, int64_t k) {
    const int64_t tiles = (n + NR - 1) / NR, groups = (k + 3) / 4;
    float *scales = (float *)(p + tiles * NR * groups * 4);
    int32_t *offsets = (int32_t *)(scales + tiles * NR);
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t j = 0; j < NR; j++) {
            const int64_t row = t * NR + j;
            int32_t sum = 0;
            for (int64_t g = 0; g < groups; g++)
                for (int64_t b = 0; b < 4; b++) {
                    const int64_t col = g * 4 + b;
                    const int8_t v = row < n && col < k ? w[row * k + col] : 0;
                    p[((t * groups + g) * NR + j) * 4 + b] = v;
                    sum += v;
                }
            scales[row] = row < n ? scale[row] : 0.0f;
            offsets[row] = X_OFFSET * sum;
        }
    }
}

/* round(v / scale), half to even, clamped to [-127, 127]: VLEN int8 at q and their magnitudes at mag */
INLINE void quantize_vector(vf v, vf scale, int8_t *q, uint8_t *mag) {
#if VLEN == 16
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(v, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m128i b = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(vf_min(vf_max(r, vf_set1(-127.0f)), vf_set1(127.0f))));
    _mm_storeu_si128((__m128i *)q, b);
    _mm_storeu_si128((__m128i *)mag, _mm_abs_epi8(b));
#else
    const __m256 r = _mm256_round_ps(_mm256_div_ps(v, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i i = _mm256_cvtps_epi32(vf_min(vf_max(r, vf_set1(-127.0f)), vf_set1(127.0f)));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    const __m128i b = _mm_packs_epi16(w, w);
    _mm_storel_epi64((__m128i *)q, b);
    _mm_storel_epi64((__m128i *)mag, _mm_abs_epi8(b));
#endif
}

/* the quantization scale of row `row` of X: max |x| / 127 (1 for a row of zeros) */
INLINE float row_scale(const void *x, const int xbf16, int64_t row, int64_t k) {
    vf top = vf_zero();
    for (int64_t i = 0; i < k; i += VLEN) {
        const vf v = vf_load_n(x, row * k + i, k - i, xbf16);
        top = vf_max(top, vf_max(v, vf_sub(vf_zero(), v)));
    }
    const float amax = vf_hmax(top);
    return amax > 0.0f ? amax / 127.0f : 1.0f;
}

/* Quantize rows [0, rows) of X (bf16 or float32) into blocks of `per_block` rows, [K / 4][XW][R] groups of
 * four bytes for a block of R rows (MR apart, so a block's place does not depend on the rows before it); the rows'
 * scales into sx. A block as wide as its rows, not MR: one decode row's x of the down projection (K = 4864) takes
 * 4.8 KiB rather than 58, and stays in the first-level cache while every tile streams past it instead of being
 * read again from L2 for each. */
static void quantize_rows(const void *x, const int xbf16, int64_t rows, int64_t k, int64_t per_block,
                          uint32_t *dst, float *sx) {
    const int64_t groups = (k + 3) / 4;
    #pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; row++) {
        const int64_t b = row / per_block, r = row % per_block;
        const int64_t stride = rows - b * per_block < per_block ? rows - b * per_block : per_block;
        uint32_t *block = dst + b * groups * MR * XW;
        const float scale = row_scale(x, xbf16, row, k);
        sx[row] = scale;
        const vf vscale = vf_set1(scale);
        for (int64_t i = 0; i < k; i += VLEN) {  /* past K the loads give zeros: the last group's padding */
            uint32_t q[VLEN / 4], mag[VLEN / 4];
            quantize_vector(vf_load_n(x, row * k + i, k - i, xbf16), vscale, (int8_t *)q, (uint8_t *)mag);
            for (int64_t j = 0; j < VLEN / 4 && i / 4 + j < groups; j++) {
                const int64_t g = i / 4 + j;
                block[g * stride * XW + r] = X_OFFSET ? q[j] ^ 0x80808080u : q[j];  /* + 128 in every byte */
                if (XW > 1) block[g * stride * XW + stride + r] = mag[j];
            }
        }
    }
}

/* One row of Y from its exact int32 sums s0, s1 (outputs 0-15, 16-31 of a tile; VLEN each): (sum * (sx * sw)) +
 * bias, rounded step by step as the reference computes it, the first `cols` outputs stored. */
INLINE void store_row(vi s0, vi s1, float sx, vf sw0, vf sw1, const float *bias, void *y, int64_t cols,
                      const int ybf16) {
    const vf xs = vf_set1(sx);
    vf out0 = vf_mul(vi_to_vf(s0), vf_mul(xs, sw0));
    vf out1 = vf_mul(vi_to_vf(s1), vf_mul(xs, sw1));
    if (bias) {
        out0 = vf_add(out0, vf_load_n(bias, 0, cols, 0));
        out1 = vf_add(out1, vf_load_n(bias, VLEN, cols - VLEN, 0));
    }
    vf_store_n(y, 0, out0, cols, ybf16);
    if (cols > VLEN) vf_store_n(y, VLEN, out1, cols - VLEN, ybf16);
}

INLINE void micro_kernel(const uint32_t *a, const int8_t *w, int64_t groups, const float *sx, const float *sw,
                         const int32_t *offsets, const float *bias, void *y, int64_t ldy, int64_t cols,
                         const int ybf16, const int rows, const int phases) {
    vi acc0[4][MR], acc1[4][MR];  /* `a`: the block's groups, `rows` words apart (see quantize_rows) */
    UNROLL for (int p = 0; p < phases; p++)
        UNROLL for (int r = 0; r < rows; r++) acc0[p][r] = acc1[p][r] = vi_zero();
    int64_t g = 0;
    for (; g + phases <= groups; g += phases) {
        /* every block asks ahead, one row too. Without VNNI a line of weight costs four instructions a vector (AVX-512
         * on the Xeon with AMX capped to avx512-core, 24 layers' and the head's GEMMs: 24.5 ms against 27.4 without
         * the asks at one row). With VNNI one row had asked for nothing while its block of x was laid out MR rows
         * wide; packed one row wide (see quantize_rows), it waited on memory without the asks: Zen 5, the 0.5B
         * model's layer GEMMs at one row in turns, 1.08-1.13x the time of the old layout at the host's slower
         * memory level, against 0.97x asking (and 0.95x at its faster level, against 0.97x) */
        prefetch_span(w + g * NR * 4, phases * NR * 4);
        UNROLL for (int p = 0; p < phases; p++) {
            const vi w0 = vi_load(w + (g + p) * NR * 4), w1 = vi_load(w + (g + p) * NR * 4 + VLEN * 4);
            UNROLL for (int r = 0; r < rows; r++) {
                const vi xr = vi_set1(a[((g + p) * XW) * rows + r]);
                const vi ar = vi_set1(a[((g + p) * XW + XW - 1) * rows + r]);
                acc0[p][r] = dot4(acc0[p][r], xr, ar, w0);
                acc1[p][r] = dot4(acc1[p][r], xr, ar, w1);
            }
        }
    }
    if (phases > 1)  /* the reductions left over by the turns */
        for (; g < groups; g++) {
            const vi w0 = vi_load(w + g * NR * 4), w1 = vi_load(w + g * NR * 4 + VLEN * 4);
            UNROLL for (int r = 0; r < rows; r++) {
                const vi xr = vi_set1(a[g * XW * rows + r]), ar = vi_set1(a[(g * XW + XW - 1) * rows + r]);
                acc0[0][r] = dot4(acc0[0][r], xr, ar, w0);
                acc1[0][r] = dot4(acc1[0][r], xr, ar, w1);
            }
        }
    const vi off0 = vi_loadu32(offsets), off1 = vi_loadu32(offsets + VLEN);
    const vf sw0 = vf_loadu(sw), sw1 = vf_loadu(sw + VLEN);
    UNROLL for (int r = 0; r < rows; r++) {
        vi s0 = acc0[0][r], s1 = acc1[0][r];
        UNROLL for (int p = 1; p < phases; p++) {
            s0 = vi_add(s0, acc0[p][r]);
            s1 = vi_add(s1, acc1[p][r]);
        }
        store_row(vi_sub(s0, off0), vi_sub(s1, off1), sx[r], sw0, sw1, bias,
                  (char *)y + r * ldy * (ybf16 ? 2 : 4), cols, ybf16);
    }
}

/* accumulator sets for a block of R rows: enough dot products in flight to cover their latency */
#define PHASES(R) (!VNNI ? 1 : (R) == 1 ? 4 : (R) <= 3 ? 2 : 1)
#define ROWS_CASE(R) \
    case R: micro_kernel(a, w, groups, sx, sw, offsets, b, yt, n, cols, ybf16, R, PHASES(R)); break;

INLINE void block_of_rows(const uint32_t *a, const int8_t *w, int64_t groups, const float *sx, const float *sw,
                          const int32_t *offsets, const float *b, void *yt, int64_t n, int64_t cols,
                          const int ybf16, int64_t rows) {
    switch (rows) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
#if MR > 4
        ROWS_CASE(5) ROWS_CASE(6)
#endif
#if MR > 6
        ROWS_CASE(7) ROWS_CASE(8) ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12)
#endif
    }
}

INLINE int gemm_int8(const int8_t *p, const void *x, const int xbf16, const float *bias, void *y, int64_t m,
                     int64_t n, int64_t k) {
    const int64_t tiles = (n + NR - 1) / NR, groups = (k + 3) / 4;
    const float *scales = (const float *)(p + tiles * NR * groups * 4);
    const int32_t *offsets = (const int32_t *)(scales + tiles * NR);
    /* one pass's quantized rows and their scales, two where there is more than one pass: passes use them in
     * turn, so the team waits once a pass (as gemm.c's gemm_share explains) */
    const int64_t rows_max = m < MC ? (m + MR - 1) / MR * MR : MC, halves = m > MC ? 2 : 1;
    const int64_t pass_words = (rows_max * groups * XW + 15) / 16 * 16;
    uint32_t *quantized = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(pass_words * halves));
    float *scales_x = (float *)malloc(sizeof(float) * (size_t)(rows_max * halves));
    if (quantized == NULL || scales_x == NULL) {
        free(quantized);
        free(scales_x);
        return -1;
    }
    #pragma omp parallel if (m * n * k >= 32768)
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
        const int64_t mc = m - m0 < MC ? m - m0 : MC;
        const int64_t blocks = (mc + MR - 1) / MR, per_block = MR;  /* full blocks, then the rest (as gemm.c) */
        uint32_t *packed = quantized + m0 / MC % 2 * pass_words;
        float *sx = scales_x + m0 / MC % 2 * rows_max;
        quantize_rows((const char *)x + m0 * k * (xbf16 ? 2 : 4), xbf16, mc, k, per_block, packed, sx);  /* a wait */
        #pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < tiles; t++) {
            const int8_t *w = p + t * groups * NR * 4;
            const int64_t col = t * NR, cols = n - col < NR ? n - col : NR;
            const float *b = bias ? bias + col : NULL;
            for (int64_t blk = 0; blk < blocks; blk++) {
                const int64_t r0 = blk * per_block, rows = mc - r0 < per_block ? mc - r0 : per_block;
                void *yt = (char *)y + ((m0 + r0) * n + col) * (xbf16 ? 2 : 4);
                const uint32_t *a = packed + blk * groups * MR * XW;
                /* one call: a branch of two (asking ahead or not at one row) had held every block size's kernel
                 * twice, and the avx512-bf16 build ran blocks of 12 rows 1.2-1.3x slower so (Zen 5, in turns) */
                block_of_rows(a, w, groups, sx + r0, scales + col, offsets + col, b, yt, n, cols, xbf16, rows);
            }
        }
    }
    free(quantized);
    free(scales_x);
    return 0;
}

#if defined(__AMX_INT8__)
/*
 * With AMX every int8 GEMM multiplies on the tile unit (amx.h): a weight tile's groups of four are B tiles of 16
 * groups (64 reductions) a step, as they lie, and the rows of X are quantized as above but kept row-major and
 * signed (K padded with zeros to the step), so TDPBSSD sums signed x signed exactly in int32 and no offset is
 * subtracted; the sums are scaled and stored by the vector path's store_row, so the results are its own bit
 * for bit. Measured on a Xeon with AMX (2 threads, the 0.5B model's layer GEMMs, 358 MB, against the VNNI
 * path): 1 row 0.43x the time (the vector path's non-temporal prefetch at one row reads ~8 GB/s there, the
 * tiles ~18), 4 rows 1.02x, 8 rows 0.89x, 16 rows 0.80x, 256 rows 0.37x (2.6 TOP/s).
 */
#define AMX_K8 64 /* reductions a tile step takes */

/* rows [0, m) of X quantized row-major into q [M][kp] (signed, zeros past K), their scales into sx */
static void amx_quantize_rows(const void *x, const int xbf16, int64_t m, int64_t k, int64_t kp, int8_t *q,
                              float *sx) {
    #pragma omp for schedule(static)
    for (int64_t row = 0; row < m; row++) {
        const float scale = row_scale(x, xbf16, row, k);
        sx[row] = scale;
        const vf vscale = vf_set1(scale);
        int64_t i = 0;
        for (; i < k; i += VLEN) {
            uint8_t mag[VLEN];
            quantize_vector(vf_load_n(x, row * k + i, k - i, xbf16), vscale, q + row * kp + i, mag);
        }
        memset(q + row * kp + i, 0, (size_t)(kp - i));
    }
}

/* the operands of a tile GEMM, for amx_walk's blocks: the rows quantized (q, stride kp; scales sx) */
typedef struct {
    const int8_t *p, *q;
    const float *sx, *scales, *bias;
    void *y;
    int64_t n, kp, groups;
    int ybf16;
} amx_gemm_int8_t;

/* amx_walk's block: groups [b0 / 4, (b0 + bytes) / 4) of rows r0.. of Y for weight tile t */
static inline __attribute__((always_inline)) void amx_block_int8(const void *gemm, int64_t t, int64_t r0, int rows,
                                                                 int64_t b0, int64_t bytes, void *carry,
                                                                 const char *ahead, int64_t lines, int near) {
    (void)near;
    const amx_gemm_int8_t *g = (const amx_gemm_int8_t *)gemm;
    const int64_t groups = g->groups, kp = g->kp, g0 = b0 / 4, end = (b0 + bytes) / 4;
    const int64_t full = end == groups ? groups / 16 * 16 : end, steps = (full - g0) / 16;
    const int8_t *w = g->p + t * groups * NR * 4, *q = g->q + r0 * kp;
    const int two = rows > 16;
    if (g0 > 0) amx_load_sums(carry, rows);
    int64_t credit = 0;
    for (int64_t i = g0; i < full; i += 16) {
        ASK_SPREAD(ahead, lines, steps, credit);
        AMX_KICK(ahead, rows, i / 16, w + i * NR * 4, 0);  /* near: bf16 only (see AMX_NEAR_BLOCKS) */
        AMX_STEP(_tile_dpbssd, q + i * 4, kp, w + i * NR * 4, two);
    }
    if (full < end) { /* the ragged end of the weight tile: a zero-padded copy (q is padded already) */
        int8_t ws[16][NR * 4] __attribute__((aligned(64)));
        memset(ws, 0, sizeof ws);
        memcpy(ws, w + full * NR * 4, (size_t)((groups - full) * NR * 4));
        AMX_MEMORY_BARRIER();
        AMX_STEP(_tile_dpbssd, q + full * 4, kp, ws, two);
    }
    if (end < groups) {
        amx_store_sums(carry, rows);
        return;
    }
    int32_t sums[32][32] __attribute__((aligned(64)));
    amx_store_sums(sums, rows);
    const int64_t col = t * NR, cols = g->n - col < NR ? g->n - col : NR;
    const vf sw0 = vf_loadu(g->scales + col), sw1 = vf_loadu(g->scales + col + VLEN);
    for (int r = 0; r < rows; r++)
        store_row(vi_loadu32(sums[r]), vi_loadu32(sums[r] + VLEN), g->sx[r0 + r], sw0, sw1,
                  g->bias ? g->bias + col : NULL, (char *)g->y + ((r0 + r) * g->n + col) * (g->ybf16 ? 2 : 4), cols,
                  g->ybf16);
}

static int amx_gemm_int8(const int8_t *p, const void *x, const int xbf16, const float *bias, void *y, int64_t m,
                         int64_t n, int64_t k) {
    const int64_t tiles = (n + NR - 1) / NR, groups = (k + 3) / 4;
    const int64_t kp = (groups * 4 + AMX_K8 - 1) / AMX_K8 * AMX_K8;
    const float *scales = (const float *)(p + tiles * NR * groups * 4);
    int8_t *q = (int8_t *)malloc((size_t)(m * kp));
    float *sx = (float *)malloc(sizeof(float) * (size_t)m);
    if (q == NULL || sx == NULL) {
        free(q);
        free(sx);
        return -1;
    }
    const amx_gemm_int8_t gemm = {p, q, sx, scales, bias, y, n, kp, groups, xbf16};
    int failed = 0, status = 0;
    #pragma omp parallel
    {
        amx_quantize_rows(x, xbf16, m, k, kp, q, sx); /* a wait */
        if (amx_walk(m, tiles, groups * 4, kp, (const char *)p, amx_block_int8, &gemm, &failed) != 0) {
            #pragma omp atomic write
            status = -1;
        }
        _tile_release();
    }
    free(q);
    free(sx);
    return status;
}
#endif

/* Y [M, N] = int8 product of X [M, K] (bf16 if xbf16, else float32; Y the same) and W packed by
 * kunlun_pack_int8, plus bias (float32 [N] or NULL). Returns -1 (nothing written) without memory, else 0. */
int kunlun_gemm_int8(const int8_t *p, const void *x, const float *bias, void *y, int64_t m, int64_t n, int64_t k,
                     int xbf16) {
#if defined(__AMX_INT8__)
    if (kunlun_amx_tiles())
        return amx_gemm_int8(p, x, xbf16, bias, y, m, n, k);
#endif
    return xbf16 ? gemm_int8(p, x, 1, bias, y, m, n, k) : gemm_int8(p, x, 0, bias, y, m, n, k);
}
