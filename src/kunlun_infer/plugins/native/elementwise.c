/*
 * The small per-layer ops in one pass each: RMSNorm (with the residual add), SwiGLU, rotary, the KV store.
 *
 * Built for every kernel set by cpu_native.py (vectors of simd.h). Each kernel reproduces its plain-torch
 * reference's roundings: in bf16 every intermediate the reference materialises in bf16 is rounded to bf16
 * here too (round to nearest even), so results match the reference up to the order of float32 sums. Rows
 * are shared among the OpenMP threads when there are enough of them to be worth it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* elements from which a call shares its rows among the threads: SwiGLU of a decode step's 8 rows (39K
 * elements) measured 21 -> 13 us in bf16 split in two, a waste below ~16K (the threads' start costs more) */
#define PARALLEL_MIN_ELEMENTS 16384

/* What the tensor's dtype makes of a float32 value (bf16: rounded, float32: itself). */
INLINE vf as_dtype(vf v, const int bf16) { return bf16 ? vf_round_bf16(v) : v; }

INLINE void rms_row(const void *x, const void *residual, const void *weight, void *out, void *residual_out,
                    int64_t row, int64_t n, float eps, const int bf16) {
    const int64_t base = row * n;
    vf squares = vf_zero();
    for (int64_t i = 0; i < n; i += VLEN) {
        vf v = vf_load_n(x, base + i, n - i, bf16);
        if (residual) {
            v = as_dtype(vf_add(v, vf_load_n(residual, base + i, n - i, bf16)), bf16);
            vf_store_n(residual_out, base + i, v, n - i, bf16);
        }
        squares = vf_fma(v, v, squares);
    }
    const vf inv = vf_set1(1.0f / sqrtf(vf_sum(squares) / (float)n + eps));
    const void *src = residual ? residual_out : x;
    for (int64_t i = 0; i < n; i += VLEN) {
        const vf normed = as_dtype(vf_mul(vf_load_n(src, base + i, n - i, bf16), inv), bf16);
        vf_store_n(out, base + i, vf_mul(vf_load_n(weight, i, n - i, bf16), normed), n - i, bf16);
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

/* `count` (<= VLEN) values of a SwiGLU row from element i */
INLINE void swiglu_step(const void *x, void *out, int64_t row, int64_t n, int64_t i, int64_t count, const int bf16) {
    const vf gate = vf_load_n(x, row * 2 * n + i, count, bf16);
    const vf up = vf_load_n(x, row * 2 * n + n + i, count, bf16);
    const vf silu = vf_div(gate, vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), gate))));
    vf_store_n(out, row * n + i, vf_mul(as_dtype(silu, bf16), up), count, bf16);
}

/* whole vectors, then the tail: a count the compiler knows is VLEN leaves no mask to work out a step (the Xeon with
 * AMX, [32, 2 x 4864] bf16: 0.94x the time) */
INLINE void swiglu_row(const void *x, void *out, int64_t row, int64_t n, const int bf16) {
    int64_t i = 0;
    for (; i + VLEN <= n; i += VLEN) swiglu_step(x, out, row, n, i, VLEN, bf16);
    if (i < n) swiglu_step(x, out, row, n, i, n - i, bf16);
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

INLINE void rotate_heads(const void *src, int64_t src_stride, void *dst, int64_t token, int64_t heads, int64_t d,
                         const float *cs, const int bf16) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        const int64_t base = (token * heads + h) * d, src_base = token * src_stride + h * d;
        for (int64_t i = 0; i < half; i += VLEN) {
            const int64_t left = half - i;
            const vf cos_lo = as_dtype(vf_load_n(cs, i, left, 0), bf16);
            const vf cos_hi = as_dtype(vf_load_n(cs, half + i, left, 0), bf16);
            const vf sin_lo = as_dtype(vf_load_n(cs, d + i, left, 0), bf16);
            const vf sin_hi = as_dtype(vf_load_n(cs, d + half + i, left, 0), bf16);
            const vf lo = vf_load_n(src, src_base + i, left, bf16), hi = vf_load_n(src, src_base + half + i, left, bf16);
            /* x * cos + rotate_half(x) * sin, rotate_half(x) = (-hi, lo); each product rounded as the reference */
            const vf out_lo = vf_sub(as_dtype(vf_mul(lo, cos_lo), bf16), as_dtype(vf_mul(hi, sin_lo), bf16));
            const vf out_hi = vf_add(as_dtype(vf_mul(hi, cos_hi), bf16), as_dtype(vf_mul(lo, sin_hi), bf16));
            vf_store_n(dst, base + i, out_lo, left, bf16);
            vf_store_n(dst, base + half + i, out_hi, left, bf16);
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

/*
 * store_kv: token t's key row (`row_bytes` bytes at key + t * key_stride bytes) and value row go to row
 * slots[t] of the caches (`cache_rows` rows of `row_bytes`), negative slots skipped. Every slot is checked
 * first: -1 (nothing written) if one is past the caches, else 0.
 */
int kunlun_store_kv(const char *key, int64_t key_stride, const char *value, int64_t value_stride, char *k_cache,
                    char *v_cache, int64_t cache_rows, const int64_t *slots, int64_t tokens, int64_t row_bytes) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= cache_rows) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(v_cache + slot * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}
