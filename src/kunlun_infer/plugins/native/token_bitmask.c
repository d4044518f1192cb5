/*
 * Structured output: forbid the tokens a grammar's bitmask leaves out with masked stores of -inf (16 logits
 * per store on AVX-512, 8 on AVX2) instead of unpacking the bitmask into a tensor 32 times its size.
 *
 * Built for every kernel set by cpu_native.py (simd.h). Masked stores never touch the lanes they leave
 * out, so a word reaching past the end of a row writes nothing there.
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"

#if defined(__AVX512F__)
INLINE void forbid_word(float *at, uint32_t forbid) {
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    const __mmask16 low = (__mmask16)(forbid & 0xFFFFu), high = (__mmask16)(forbid >> 16);
    if (low)
        _mm512_mask_storeu_ps(at, low, neg_inf);
    if (high)
        _mm512_mask_storeu_ps(at + 16, high, neg_inf);
}
#else
INLINE void forbid_word(float *at, uint32_t forbid) {
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int part = 0; part < 4; ++part) {
        const uint32_t bits = (forbid >> (8 * part)) & 0xFFu;
        if (!bits)
            continue;
        const __m256i set = _mm256_and_si256(_mm256_set1_epi32((int)bits), lane_bit);
        _mm256_maskstore_ps(at + 8 * part, _mm256_cmpeq_epi32(set, lane_bit), neg_inf);
    }
}
#endif

/* logits: float32 rows of `stride` elements, `vocab` of them used; bitmask: int32 [num_rows, words], bit j of
 * word w set = token 32w+j allowed; rows[r]: the logits row bitmask row r applies to. Forbidden logits become
 * -inf; bits past `vocab` are ignored. */
void kunlun_apply_token_bitmask(float *logits, int64_t stride, int64_t vocab, const int32_t *bitmask,
                                int64_t words, const int64_t *rows, int64_t num_rows) {
#pragma omp parallel for schedule(static) if (num_rows >= 16)
    for (int64_t r = 0; r < num_rows; ++r) {
        float *row = logits + rows[r] * stride;
        const uint32_t *bits = (const uint32_t *)(bitmask + r * words);
        for (int64_t w = 0; w < words && w * 32 < vocab; ++w) {
            uint32_t forbid = ~bits[w];
            const int64_t left = vocab - w * 32;
            if (left < 32)
                forbid &= (1u << left) - 1u;
            if (forbid)
                forbid_word(row + w * 32, forbid);
        }
    }
}
