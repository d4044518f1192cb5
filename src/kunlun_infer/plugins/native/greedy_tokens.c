/*
 * Greedy decoding: each row's argmax, as torch's max(dim=-1).indices gives it (the first index of the largest
 * value; a NaN counts as largest, the first NaN winning), in one pass over the row.
 *
 * Built for every kernel set by cpu_native.py (simd.h). Each lane keeps the largest value it has seen and where,
 * taking a later one only when it is strictly larger, so a lane holds the first index of its own largest; the row's
 * answer is the smallest index among the lanes holding the largest value, then the logits past the last whole vector
 * one by one. NaNs compare false and are counted apart (a row holding one is looked through again for the first). Two
 * sets of lanes take turns, so a compare need not wait on the blend before it. A decode step of 32 rows of a
 * 151936-token vocabulary read them at ~10 GB/s through torch's reduction.
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"

/* a vector's 32-bit indices, beside simd.h's float32 vf */
#if VLEN == 16
typedef __m512i vidx;
INLINE vidx vidx_iota(void) { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
INLINE vidx vidx_add(vidx v, int64_t at) { return _mm512_add_epi32(v, _mm512_set1_epi32((int)at)); }
INLINE void vidx_storeu(int32_t *p, vidx v) { _mm512_storeu_si512(p, v); }
/* lanes where v beats best take v and its index; NaNs in v are or-ed into *nan */
INLINE void take(vf v, vidx index, vf *best, vidx *where, int *nan) {
    const __mmask16 more = _mm512_cmp_ps_mask(v, *best, _CMP_GT_OQ);
    *best = _mm512_mask_mov_ps(*best, more, v);
    *where = _mm512_mask_mov_epi32(*where, more, index);
    *nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
}
#else
typedef __m256i vidx;
INLINE vidx vidx_iota(void) { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
INLINE vidx vidx_add(vidx v, int64_t at) { return _mm256_add_epi32(v, _mm256_set1_epi32((int)at)); }
INLINE void vidx_storeu(int32_t *p, vidx v) { _mm256_storeu_si256((__m256i *)p, v); }
INLINE void take(vf v, vidx index, vf *best, vidx *where, int *nan) {
    const __m256 more = _mm256_cmp_ps(v, *best, _CMP_GT_OQ);
    *best = _mm256_blendv_ps(*best, v, more);
    *where = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(*where), _mm256_castsi256_ps(index), more));
    *nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0;
}
#endif

/* the first NaN of row[0, n), or -1 */
static int64_t first_nan(const float *row, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (isnan(row[i])) return i;
    return -1;
}

/* the argmax of row[0, n) (n >= 1); sample_tokens.c takes it for its greedy rows */
int64_t kunlun_row_argmax(const float *row, int64_t n) {
    const vidx iota = vidx_iota();
    /* every lane starts at -inf with an index among the first lanes, so a row of -inf answers 0 as torch does */
    vf best[2] = {vf_set1(-INFINITY), vf_set1(-INFINITY)};
    vidx where[2] = {iota, iota};
    int nan = 0;
    int64_t i = 0;
    for (; i + 2 * VLEN <= n; i += 2 * VLEN) {
        take(vf_loadu(row + i), vidx_add(iota, i), &best[0], &where[0], &nan);
        take(vf_loadu(row + i + VLEN), vidx_add(iota, i + VLEN), &best[1], &where[1], &nan);
    }
    if (i + VLEN <= n) {
        take(vf_loadu(row + i), vidx_add(iota, i), &best[0], &where[0], &nan);
        i += VLEN;
    }
    float values[2 * VLEN];
    int32_t indices[2 * VLEN];
    for (int s = 0; s < 2; s++) {
        vf_storeu(values + s * VLEN, best[s]);
        vidx_storeu(indices + s * VLEN, where[s]);
    }
    float top = values[0];
    int64_t at = indices[0];
    for (int l = 1; l < 2 * VLEN; l++)
        if (values[l] > top || (values[l] == top && indices[l] < at)) {
            top = values[l];
            at = indices[l];
        }
    for (; i < n; i++) { /* past the last whole vector: later than every lane's index, so only a larger value wins */
        nan |= isnan(row[i]) != 0;
        if (row[i] > top) {
            top = row[i];
            at = i;
        }
    }
    return nan ? first_nan(row, n) : at;
}

/* out[r] = argmax of logits[r * stride, r * stride + vocab), r < rows; vocab in [1, 2^31 - 2 * VLEN] */
void kunlun_greedy_tokens(const float *logits, int64_t stride, int64_t rows, int64_t vocab, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows >= 2)
    for (int64_t r = 0; r < rows; r++) out[r] = kunlun_row_argmax(logits + r * stride, vocab);
}
