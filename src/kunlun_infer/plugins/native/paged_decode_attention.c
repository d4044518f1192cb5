/*
 * Decode attention straight from the paged KV cache (AVX-512): one query token per sequence, no gathered copy.
 *
 * Built and loaded by cpu_native.py. One work item is (sequence, KV head): the Hq / Hk query heads that
 * share the KV head are scaled and held in float32; each cached key is read once from its block (through
 * the block table) and scored against all of them; a float32 softmax per query head (max, exp, sum) is
 * followed by one pass over the cached values. K/V may be bf16 or float32; arithmetic is float32.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd_math.h"


/* The 16 horizontal sums of v[0..15] as one vector (lane i = sum of v[i]), by interleaving adds. */
static inline __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    const __m512 f = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e, f, 0x88), _mm512_shuffle_f32x4(e, f, 0xDD));
}

static inline __attribute__((always_inline)) __m512 load16(const void *base, int64_t index, const int bf16) {
    if (bf16) {
        const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    return _mm512_loadu_ps((const float *)base + index);
}

static inline __attribute__((always_inline)) void store16(void *base, int64_t index, __m512 value, const int bf16) {
    if (bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)base + index), (__m256i)_mm512_cvtneps_pbh(value));
    else
        _mm512_storeu_ps((float *)base + index, value);
}

#define MAX_GROUP 16

static inline __attribute__((always_inline)) void one_head(
        const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int64_t len, void *out,
        int64_t b, int64_t h, int64_t hq, int64_t hk, int64_t d, int64_t block_size, float scale,
        float *work, const int bf16) {
    const int64_t group = hq / hk, chunks = d / 16;
    float *qf = work, *scores = work + group * d;
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++)
            _mm512_storeu_ps(qf + g * d + 16 * c, load16(q, (b * hq + h * group + g) * d + 16 * c, bf16));
    /* scores: q . k for every cached key, 16 keys at a time per query head (one transposing sum for 16 dots) */
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t tn = len - t0 < 16 ? len - t0 : 16;
        int64_t keys[16];
        for (int64_t i = 0; i < tn; i++) {
            const int64_t t = t0 + i;
            keys[i] = (((int64_t)table[t / block_size] * block_size + t % block_size) * hk + h) * d;
        }
        for (int64_t g = 0; g < group; g++) {
            __m512 dots[16];
            for (int64_t i = 0; i < 16; i++) dots[i] = _mm512_setzero_ps();
            if (bf16 && d % 32 == 0) {  /* bf16 pairs straight into VDPBF16PS, float32 sums */
                const uint16_t *qg = (const uint16_t *)q + (b * hq + h * group + g) * d;
                const uint16_t *keys_bf16 = (const uint16_t *)k_cache;
                for (int64_t i = 0; i < tn; i++)
                    for (int64_t c = 0; c < d; c += 32)
                        dots[i] = _mm512_dpbf16_ps(dots[i], (__m512bh)_mm512_loadu_si512(qg + c),
                                                   (__m512bh)_mm512_loadu_si512(keys_bf16 + keys[i] + c));
            } else {
                for (int64_t i = 0; i < tn; i++)
                    for (int64_t c = 0; c < chunks; c++)
                        dots[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * d + 16 * c),
                                                  load16(k_cache, keys[i] + 16 * c, bf16), dots[i]);
            }
            const __mmask16 m = tn == 16 ? 0xFFFF : (__mmask16)((1u << tn) - 1);
            _mm512_mask_storeu_ps(scores + g * len + t0, m, _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale)));
        }
    }
    /* softmax per query head, float32 */
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * len;
        __m512 vmax = _mm512_set1_ps(-3.0e38f);
        int64_t t = 0;
        for (; t + 16 <= len; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
        float top = _mm512_reduce_max_ps(vmax);
        for (; t < len; t++) top = s[t] > top ? s[t] : top;
        __m512 vsum = _mm512_setzero_ps();
        const __m512 vtop = _mm512_set1_ps(top);
        for (t = 0; t < len; t += 16) {
            const __mmask16 m = len - t >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t)) - 1);
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), vtop));
            _mm512_mask_storeu_ps(s + t, m, e);
            vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
        }
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
        for (t = 0; t < len; t += 16) {
            const __mmask16 m = len - t >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t)) - 1);
            _mm512_mask_storeu_ps(s + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + t), inv));
        }
    }
    /* out = probabilities @ values: 16 features at a time, the group's accumulators in registers */
    for (int64_t c = 0; c < chunks; c++) {
        for (int64_t g0 = 0; g0 < group; g0 += MAX_GROUP) {
            const int64_t gn = group - g0 < MAX_GROUP ? group - g0 : MAX_GROUP;
            __m512 acc[MAX_GROUP];
            for (int64_t g = 0; g < gn; g++) acc[g] = _mm512_setzero_ps();
            for (int64_t t = 0; t < len; t++) {
                const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                const __m512 v = load16(v_cache, (slot * hk + h) * d + 16 * c, bf16);
                for (int64_t g = 0; g < gn; g++)
                    acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(scores[(g0 + g) * len + t]), v, acc[g]);
            }
            for (int64_t g = 0; g < gn; g++)
                store16(out, (b * hq + h * group + g0 + g) * d + 16 * c, acc[g], bf16);
        }
    }
}

/*
 * q, out: [B, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hk, D]; block_tables: [B, table_stride]
 * int32; seq_lens: [B] int32 (context length including the query token). D % 16 == 0; all in the dtype
 * given by bf16 (1: bfloat16, 0: float32). Returns 0; -1 if scratch memory could not be allocated; -2,
 * having read nothing, if a context reaches past its table or uses a block id outside [0, num_blocks).
 */
int kunlun_paged_decode_attention(const void *q, const void *k_cache, const void *v_cache, int64_t num_blocks,
                                  const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                                  void *out, int64_t batch, int64_t hq, int64_t hk, int64_t d, int64_t block_size,
                                  float scale, int bf16) {
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = seq_lens[b], used = (len + block_size - 1) / block_size;
        if (len < 1 || used > table_stride) return -2;
        for (int64_t i = 0; i < used; i++) {
            const int32_t block = block_tables[b * table_stride + i];
            if (block < 0 || block >= num_blocks) return -2;
        }
        longest = len > longest ? len : longest;
    }
    const int64_t group = hq / hk, per_item = group * d + group * longest;
    int failed = 0;
    #pragma omp parallel reduction(|| : failed)
    {
        float *work = (float *)malloc(sizeof(float) * per_item);
        if (work == NULL) failed = 1;
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t h = 0; h < hk; h++) {
                if (work == NULL) continue;
                const int32_t *table = block_tables + b * table_stride;
                if (bf16)
                    one_head(q, k_cache, v_cache, table, seq_lens[b], out, b, h, hq, hk, d, block_size, scale,
                             work, 1);
                else
                    one_head(q, k_cache, v_cache, table, seq_lens[b], out, b, h, hq, hk, d, block_size, scale,
                             work, 0);
            }
        free(work);
    }
    return failed ? -1 : 0;
}
