/*
 * The small per-layer ops in one pass each (AVX-512): RMSNorm (with the residual add), SwiGLU, rotary.
 *
 * Built and loaded by cpu_native.py. Each kernel reproduces its plain-torch reference's roundings: in
 * bf16 every intermediate the reference materialises in bf16 is rounded to bf16 here too (round to
 * nearest even), so results match the reference up to the order of float32 sums. Rows are shared among
 * the OpenMP threads when there are enough of them to be worth it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd_math.h"

#define PARALLEL_MIN_ELEMENTS 65536


/* Load up to 16 elements (mask) as float32; store float32 as the tensor's dtype (bf16: round to nearest even). */
static inline __attribute__((always_inline)) __m512 load(const void *base, int64_t i, __mmask16 m, const int bf16) {
    if (bf16) {
        const __m256i half = _mm256_maskz_loadu_epi16(m, (const uint16_t *)base + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)base + i);
}

static inline __attribute__((always_inline)) void store(void *base, int64_t i, __m512 v, __mmask16 m, const int bf16) {
    if (bf16)
        _mm256_mask_storeu_epi16((uint16_t *)base + i, m, (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_mask_storeu_ps((float *)base + i, m, v);
}

/* What the tensor's dtype makes of a float32 value (bf16: rounded, float32: itself). */
static inline __attribute__((always_inline)) __m512 as_dtype(__m512 v, const int bf16) {
    if (!bf16) return v;
    const __m256i half = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

static inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1); }

static inline __attribute__((always_inline)) void rms_row(
        const void *x, const void *residual, const void *weight, void *out, void *residual_out, int64_t row,
        int64_t n, float eps, const int bf16) {
    const int64_t base = row * n;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        __m512 v = load(x, base + i, m, bf16);
        if (residual) {
            v = as_dtype(_mm512_add_ps(v, load(residual, base + i, m, bf16)), bf16);
            store(residual_out, base + i, v, m, bf16);
        }
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)n + eps));
    const void *src = residual ? residual_out : x;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 normed = as_dtype(_mm512_mul_ps(load(src, base + i, m, bf16), inv), bf16);
        store(out, base + i, _mm512_mul_ps(load(weight, i, m, bf16), normed), m, bf16);
    }
}

/*
 * out = weight * rms_norm(s) with s = x (+ residual, then also written to residual_out), per row of n.
 * residual/residual_out may be NULL. Same dtype everywhere (bf16 = 1, float32 = 0).
 */
void kunlun_rms_norm(const void *x, const void *residual, const void *weight, void *out, void *residual_out,
                     int64_t rows, int64_t n, float eps, int bf16) {
    #pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16)
            rms_row(x, residual, weight, out, residual_out, r, n, eps, 1);
        else
            rms_row(x, residual, weight, out, residual_out, r, n, eps, 0);
    }
}

static inline __attribute__((always_inline)) void swiglu_row(const void *x, void *out, int64_t row, int64_t n,
                                                              const int bf16) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 gate = load(x, row * 2 * n + i, m, bf16);
        const __m512 up = load(x, row * 2 * n + n + i, m, bf16);
        const __m512 one = _mm512_set1_ps(1.0f);
        const __m512 neg_gate = _mm512_sub_ps(_mm512_setzero_ps(), gate);
        const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(one, exp_ps(neg_gate)));
        store(out, row * n + i, _mm512_mul_ps(as_dtype(silu, bf16), up), m, bf16);
    }
}

/* out [rows, n] = silu(x[:, :n]) * x[:, n:] for x [rows, 2n]. */
void kunlun_silu_and_mul(const void *x, void *out, int64_t rows, int64_t n, int bf16) {
    #pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16)
            swiglu_row(x, out, r, n, 1);
        else
            swiglu_row(x, out, r, n, 0);
    }
}

static inline __attribute__((always_inline)) void rotate_heads(const void *src, int64_t src_stride, void *dst,
        int64_t token, int64_t heads, int64_t d, const float *cs, const int bf16) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        const int64_t base = (token * heads + h) * d, src_base = token * src_stride + h * d;
        for (int64_t i = 0; i < half; i += 16) {
            const __mmask16 m = tail_mask(half - i);
            const __m512 cos_lo = as_dtype(_mm512_maskz_loadu_ps(m, cs + i), bf16);
            const __m512 cos_hi = as_dtype(_mm512_maskz_loadu_ps(m, cs + half + i), bf16);
            const __m512 sin_lo = as_dtype(_mm512_maskz_loadu_ps(m, cs + d + i), bf16);
            const __m512 sin_hi = as_dtype(_mm512_maskz_loadu_ps(m, cs + d + half + i), bf16);
            const __m512 lo = load(src, src_base + i, m, bf16), hi = load(src, src_base + half + i, m, bf16);
            /* x * cos + rotate_half(x) * sin, rotate_half(x) = (-hi, lo); each product rounded as the reference */
            const __m512 out_lo = _mm512_sub_ps(as_dtype(_mm512_mul_ps(lo, cos_lo), bf16),
                                                as_dtype(_mm512_mul_ps(hi, sin_lo), bf16));
            const __m512 out_hi = _mm512_add_ps(as_dtype(_mm512_mul_ps(hi, cos_hi), bf16),
                                                as_dtype(_mm512_mul_ps(lo, sin_hi), bf16));
            store(dst, base + i, out_lo, m, bf16);
            store(dst, base + half + i, out_hi, m, bf16);
        }
    }
}

/*
 * Rotary embedding (rotate-half layout) of q [T, Hq, D] and k [T, Hk, D] into contiguous q_out, k_out.
 * Heads of a token are contiguous in q and k; tokens are q_stride / k_stride elements apart (so q and k
 * may be column slices of one fused projection). cos_sin [max_pos, 2, D] float32; positions [T] int64.
 * Returns -1, having written nothing, when a position is outside [0, max_pos); else 0.
 */
int kunlun_rotary(const int64_t *positions, const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                  const float *cos_sin, int64_t max_pos, void *q_out, void *k_out, int64_t tokens, int64_t hq,
                  int64_t hk, int64_t d, int bf16) {
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_pos) return -1;
    #pragma omp parallel for schedule(static) if (tokens * (hq + hk) * d >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *cs = cos_sin + positions[t] * 2 * d;
        if (bf16) {
            rotate_heads(q, q_stride, q_out, t, hq, d, cs, 1);
            rotate_heads(k, k_stride, k_out, t, hk, d, cs, 1);
        } else {
            rotate_heads(q, q_stride, q_out, t, hq, d, cs, 0);
            rotate_heads(k, k_stride, k_out, t, hk, d, cs, 0);
        }
    }
    return 0;
}
