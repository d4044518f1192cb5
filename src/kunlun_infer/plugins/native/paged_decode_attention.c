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

/* e^x for x <= 0 (softmax arguments): 2^n * p(r), |r| <= ln2 / 2, degree-7 Taylor polynomial (rel. err < 1e-7). */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
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

static inline __attribute__((always_inline)) void one_head(
        const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int64_t len, void *out,
        int64_t b, int64_t h, int64_t hq, int64_t hk, int64_t d, int64_t block_size, float scale,
        float *work, const int bf16) {
    const int64_t group = hq / hk, chunks = d / 16;
    float *qf = work, *acc = work + group * d, *scores = work + 2 * group * d;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t row = (b * hq + h * group + g) * d;
            _mm512_storeu_ps(qf + g * d + 16 * c, _mm512_mul_ps(load16(q, row + 16 * c, bf16), vscale));
        }
    for (int64_t t = 0; t < len; t++) {
        const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
        const int64_t key = (slot * hk + h) * d;
        for (int64_t g = 0; g < group; g++) {
            __m512 dot = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; c++)
                dot = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * d + 16 * c), load16(k_cache, key + 16 * c, bf16), dot);
            scores[g * len + t] = _mm512_reduce_add_ps(dot);
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * len;
        __m512 vmax = _mm512_set1_ps(-3.0e38f);
        int64_t t = 0;
        for (; t + 16 <= len; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
        float top = _mm512_reduce_max_ps(vmax);
        for (; t < len; t++) top = s[t] > top ? s[t] : top;
        __m512 vsum = _mm512_setzero_ps();
        const __m512 vtop = _mm512_set1_ps(top);
        for (t = 0; t + 16 <= len; t += 16) {
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), vtop));
            _mm512_storeu_ps(s + t, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        if (t < len) {
            const __mmask16 tail = (__mmask16)((1u << (len - t)) - 1);
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), vtop));
            _mm512_mask_storeu_ps(s + t, tail, e);
            vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(tail, e));
        }
        const float inv = 1.0f / _mm512_reduce_add_ps(vsum);
        for (t = 0; t < len; t++) s[t] *= inv;
        for (int64_t c = 0; c < chunks; c++) _mm512_storeu_ps(acc + g * d + 16 * c, _mm512_setzero_ps());
    }
    for (int64_t t = 0; t < len; t++) {
        const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
        const int64_t value = (slot * hk + h) * d;
        for (int64_t c = 0; c < chunks; c++) {
            const __m512 v = load16(v_cache, value + 16 * c, bf16);
            for (int64_t g = 0; g < group; g++) {
                float *a = acc + g * d + 16 * c;
                _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * len + t]), v, _mm512_loadu_ps(a)));
            }
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++)
            store16(out, (b * hq + h * group + g) * d + 16 * c, _mm512_loadu_ps(acc + g * d + 16 * c), bf16);
}

/*
 * q, out: [B, Hq, D]; k_cache, v_cache: [blocks, block_size, Hk, D]; block_tables: [B, table_stride] int32;
 * seq_lens: [B] int32 (context length including the query token). D % 16 == 0; all in the dtype given
 * by bf16 (1: bfloat16, 0: float32). Returns 0, or -1 if scratch memory could not be allocated.
 */
int kunlun_paged_decode_attention(const void *q, const void *k_cache, const void *v_cache,
                                  const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                                  void *out, int64_t batch, int64_t hq, int64_t hk, int64_t d, int64_t block_size,
                                  float scale, int bf16) {
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++) longest = seq_lens[b] > longest ? seq_lens[b] : longest;
    const int64_t group = hq / hk, per_item = 2 * group * d + group * longest;
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
