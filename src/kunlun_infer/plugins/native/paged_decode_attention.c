/*
 * Decode attention straight from the paged KV cache: one query token per sequence, no gathered copy.
 *
 * Built for every kernel set by cpu_native.py (vectors of simd.h; bf16 q.k through VDPBF16PS where the set
 * has AVX512-BF16). One work item is (sequence, KV head): the Hq / Hk query heads that
 * share the KV head are scaled and held in float32; each cached key is read once from its block (through
 * the block table) and scored against all of them, VLEN keys at a time (bf16 keys widened once per block where
 * there is no VDPBF16PS); a float32 softmax per query head (max, exp, sum) is followed by one pass over the
 * cached values. K/V may be bf16 or float32; arithmetic is float32. Where there are fewer items than threads (one
 * long sequence of a model with few KV heads, many cores), each context is split into parts, one item each, whose
 * unnormalised sums are merged after (Zen 4, 2 threads, one sequence of 4096 tokens with one KV head: 0.51-0.55x the
 * time of one thread doing it).
 */
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>

#include "simd.h"

/* query heads of one KV head, and VLEN-feature chunks of the values, whose accumulators are held at once
 * (16 of the 32 AVX-512 registers, 8 of the 16 AVX2 ones). With AVX2, 4 heads x 2 chunks against 8 x 1: each value
 * vector loaded and widened serves half as many FMAs, but each probability's broadcast twice as many, and a pass
 * takes whole lines of bf16 values (Zen 4, in turns, 0.82-0.90x the time at 8 x 1024 and 1 x 4096 tokens) */
#define MAX_GROUP (VLEN == 16 ? 8 : 4)
#define VALUE_CHUNKS 2
#define UNROLL _Pragma("GCC unroll 16")
/* How far ahead the scattered K/V rows are asked for: keys AHEAD tokens before they are scored, values VALUES_AHEAD
 * tokens before they are weighted (each in its own pass, where it is read). Into the second-level cache (T1): asked
 * into the first (T0), the requests of two blocks of keys at once had filled its few miss buffers and the loads
 * waited behind them. The 0.5B model's step (14 / 2 heads, head size 64, bf16, every layer its own cache), Zen 4,
 * in turns against keys and values both asked 2 * VLEN ahead into the first level: 8 sequences of 256 tokens
 * 0.52x the time with AVX-512 (0.65x with AVX2), 8 of 1024 0.48x (0.59x), 1 of 4096 0.48x (0.61x). */
#define AHEAD (4 * VLEN)
#define VALUES_AHEAD 64
/* tokens whose value rows the passes over the values take together: with AVX2 a 64-byte line of bf16 values serves
 * four passes, which had each read it from the second level again (Zen 4, in turns, 0.80-0.92x the time for 1 x 4096
 * tokens, 0.92-0.97x for 8 x 1024; within the host's noise with AVX-512, whose two passes read a line each) */
#define VALUES_TILE 64
/* the fewest tokens of a context split among threads, and the most parts it is split into */
#define PART_TOKENS 256
#define MAX_PARTS 256

/* With AVX2, bf16 rows are widened 16 values at a time by two unpacks (vf_load_bf16_pair), in the order those give
 * them: the query and the keys alike, so that their dot products sum the same products, and the values' weighted
 * sums are put back in order as they are written out. Zen 4 capped to AVX2: one thread over a cache-resident context
 * of 1024 tokens (14 / 2 heads of 64), 102 -> 91 cycles per (key, KV head), best of five runs each; the 0.5B model's
 * step in turns (three runs) 0.90-0.94x the time at 8 x 1024, 0.86-1.08x at 1 x 4096, 0.92-1.02x at 8 x 256. */
#define PAIRED (VLEN == 8)

INLINE vf load_vec(const void *base, int64_t index, const int bf16) {
    return bf16 ? vf_load_bf16((const uint16_t *)base + index) : vf_loadu((const float *)base + index);
}

/* The d values (bf16 or float32) at element `at` of `src` as float32 at dst: bf16 ones with AVX2 in
 * vf_load_bf16_pair's order (see PAIRED; d is a multiple of 16), so a query and a key widened here multiply alike. */
INLINE void widen_row(const void *src, int64_t at, int64_t d, float *dst, const int bf16) {
    if (PAIRED && bf16) {
        for (int64_t c = 0; c < d; c += 2 * VLEN) {
            vf lo, hi;
            vf_load_bf16_pair((const uint16_t *)src + at + c, &lo, &hi);
            vf_storeu(dst + c, lo);
            vf_storeu(dst + c + VLEN, hi);
        }
    } else {
        for (int64_t c = 0; c < d; c += VLEN) vf_storeu(dst + c, load_vec(src, at + c, bf16));
    }
}

/* every cache line of the K or V row that starts at element `row` of `cache`, asked for into the second level */
INLINE void ask_row(const void *cache, int64_t row, int64_t d, const int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t byte = 0; byte < d * size; byte += 64)
        _mm_prefetch((const char *)cache + row * size + byte, _MM_HINT_T1);
}

/* The accumulators of one pass below, held in registers: the head and chunk counts are constants here. Tokens
 * [t0, t1) of `len`; the sums start from `sums` (float32, laid out as out) unless t0 is 0, and go to `sums` unless
 * t1 is len, where they are written to out. */
INLINE void weighted_values_fixed(const void *v_cache, const int64_t *rows, const float *p, int64_t len,
                                  int64_t t0, int64_t t1, float *sums, int64_t feature, void *out, int64_t at,
                                  int64_t d, const int heads, const int nchunks, const int bf16, const int ask,
                                  const int obf16) {
    vf acc[MAX_GROUP][VALUE_CHUNKS];
    UNROLL for (int g = 0; g < heads; g++)
        UNROLL for (int c = 0; c < nchunks; c++)
            acc[g][c] = t0 == 0 ? vf_zero() : vf_loadu(sums + g * d + feature + VLEN * c);
    for (int64_t t = t0; t < t1; t++) {
        if (ask && t + VALUES_AHEAD < len) ask_row(v_cache, rows[t + VALUES_AHEAD], d, bf16);  /* the first pass */
        vf v[VALUE_CHUNKS];
        if (PAIRED && bf16 && nchunks == 2)
            vf_load_bf16_pair((const uint16_t *)v_cache + rows[t] + feature, &v[0], &v[1]);
        else
            UNROLL for (int c = 0; c < nchunks; c++) v[c] = load_vec(v_cache, rows[t] + feature + VLEN * c, bf16);
        UNROLL for (int g = 0; g < heads; g++) {
            const vf weight = vf_set1(p[g * len + t]);
            UNROLL for (int c = 0; c < nchunks; c++) acc[g][c] = vf_fma(weight, v[c], acc[g][c]);
        }
    }
    if (PAIRED && bf16 && nchunks == 2 && t1 == len)
        UNROLL for (int g = 0; g < heads; g++) vf_unpair(&acc[g][0], &acc[g][1]);
    UNROLL for (int g = 0; g < heads; g++)
        UNROLL for (int c = 0; c < nchunks; c++) {
            const int64_t i = at + g * d + VLEN * c;
            if (t1 < len)
                vf_storeu(sums + g * d + feature + VLEN * c, acc[g][c]);
            else if (obf16)
                vf_store_bf16((uint16_t *)out + i, acc[g][c]);
            else
                vf_storeu((float *)out + i, acc[g][c]);
        }
}

#define VALUES_CASE(H)                                                                                                \
    case H:                                                                                                           \
        weighted_values_fixed(v_cache, rows, p, len, t0, t1, sums, feature, out, at, d, H, nchunks, bf16, ask, obf16); \
        break;

/* out[at + g * d + f] = sum_t p[g * len + t] * V[t][feature + f] for g < heads, f < nchunks * VLEN, over tokens
 * [t0, t1) (see weighted_values_fixed) */
INLINE void weighted_values(const void *v_cache, const int64_t *rows, const float *p, int64_t len, int64_t t0,
                            int64_t t1, float *sums, int64_t feature, void *out, int64_t at, int64_t d, int64_t heads,
                            const int nchunks, const int bf16, const int ask, const int obf16) {
    switch (heads) {
        VALUES_CASE(1) VALUES_CASE(2) VALUES_CASE(3) VALUES_CASE(4)
#if MAX_GROUP > 4
        VALUES_CASE(5) VALUES_CASE(6) VALUES_CASE(7) VALUES_CASE(8)
#endif
    }
}

/* One work item: the query heads of KV head h of sequence b over its cached tokens [lo, hi). With `part` NULL the
 * normalised outputs go to out (in the cache's dtype); else (a part of a context split among threads) the sums of
 * e^(score - top) * value go to part as float32 [group][d], followed by each head's top score and sum of
 * e^(score - top) (see merge_parts). */
INLINE void one_head(const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int64_t lo,
                     int64_t hi, void *out, float *part, int64_t b, int64_t h, int64_t hq, int64_t hk, int64_t d,
                     int64_t block_size, float scale, float *work, int64_t *rows, const int bf16) {
    const int64_t group = hq / hk, chunks = d / VLEN, len = hi - lo;
    float *qf = work, *kf = work + group * d, *vsum = kf + VLEN * d, *scores = vsum + group * d;
    /* where each cached token's K/V row of this head starts, looked up once (no division per token and pass) */
    for (int64_t t = lo; t < hi;) {
        const int64_t i = t / block_size, j0 = t - i * block_size;
        const int64_t first = ((int64_t)table[i] * block_size * hk + h) * d;
        for (int64_t j = j0; j < block_size && t < hi; j++, t++) rows[t - lo] = first + j * hk * d;
    }
    for (int64_t g = 0; g < group; g++) widen_row(q, (b * hq + h * group + g) * d, d, qf + g * d, bf16);
    /* scores: q . k for every cached key, VLEN keys at a time per query head (one transposing sum for VLEN dots) */
    for (int64_t t0 = 0; t0 < len; t0 += VLEN) {
        const int64_t tn = len - t0 < VLEN ? len - t0 : VLEN;
        /* the keys' rows AHEAD tokens on, scattered over the cache's blocks, are asked for now: the hardware
         * prefetchers do not follow them, and a step's cache is in no cache level by the next step */
        for (int64_t t = t0 == 0 ? 0 : t0 + AHEAD; t < t0 + VLEN + AHEAD && t < len; t++)
            ask_row(k_cache, rows[t], d, bf16);
        /* the block's keys, past the context's end the last one again (those scores are not stored): a whole block
         * of sums in registers, where a loop to the block's length had kept them in memory (1.16-1.25x the time) */
        int64_t key[VLEN];
        UNROLL for (int i = 0; i < VLEN; i++) key[i] = rows[t0 + (i < tn ? i : tn - 1)];
#if defined(__AVX512BF16__)
        if (bf16 && d % 32 == 0) {  /* bf16 pairs straight into VDPBF16PS, float32 sums */
            const uint16_t *keys_bf16 = (const uint16_t *)k_cache;
            for (int64_t g = 0; g < group; g++) {
                const uint16_t *qg = (const uint16_t *)q + (b * hq + h * group + g) * d;
                vf dots[VLEN];
                UNROLL for (int i = 0; i < VLEN; i++) dots[i] = vf_zero();
                for (int64_t c = 0; c < d; c += 32) {
                    const __m512bh qc = (__m512bh)_mm512_loadu_si512(qg + c);
                    UNROLL for (int i = 0; i < VLEN; i++)
                        dots[i] = _mm512_dpbf16_ps(dots[i], qc, (__m512bh)_mm512_loadu_si512(keys_bf16 + key[i] + c));
                }
                vf_store_n(scores + g * len, t0, vf_mul(vf_transpose_sum(dots), vf_set1(scale)), tn, 0);
            }
            continue;
        }
#endif
        /* float32 keys are read in place; bf16 ones widened once into kf for every query head */
        const float *kr[VLEN];
        if (bf16) {
            UNROLL for (int i = 0; i < VLEN; i++) {
                widen_row(k_cache, key[i], d, kf + i * d, 1);
                kr[i] = kf + i * d;
            }
        } else {
            UNROLL for (int i = 0; i < VLEN; i++) kr[i] = (const float *)k_cache + key[i];
        }
        for (int64_t g = 0; g < group; g++) {
            vf dots[VLEN];
            UNROLL for (int i = 0; i < VLEN; i++) dots[i] = vf_zero();
            for (int64_t c = 0; c < chunks; c++) {
                const vf qc = vf_loadu(qf + g * d + VLEN * c);
                UNROLL for (int i = 0; i < VLEN; i++) dots[i] = vf_fma(qc, vf_loadu(kr[i] + VLEN * c), dots[i]);
            }
            vf_store_n(scores + g * len, t0, vf_mul(vf_transpose_sum(dots), vf_set1(scale)), tn, 0);
        }
    }
    /* softmax per query head, float32 */
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * len;
        vf vmax = vf_set1(-3.0e38f);
        int64_t t = 0;
        for (; t + VLEN <= len; t += VLEN) vmax = vf_max(vmax, vf_loadu(s + t));
        float top = vf_hmax(vmax);
        for (; t < len; t++) top = s[t] > top ? s[t] : top;
        vf vsum = vf_zero();
        const vf vtop = vf_set1(top);
        float tail = 0.0f;
        for (t = 0; t + VLEN <= len; t += VLEN) {
            const vf e = vf_exp(vf_sub(vf_loadu(s + t), vtop));
            vf_storeu(s + t, e);
            vsum = vf_add(vsum, e);
        }
        if (t < len) {  /* the last keys: exp of the padded lanes is never stored nor summed */
            float e[VLEN];
            vf_storeu(e, vf_exp(vf_sub(vf_load_n(s, t, len - t, 0), vtop)));
            for (int64_t i = 0; i < len - t; i++) {
                s[t + i] = e[i];
                tail += e[i];
            }
        }
        if (part != NULL) {  /* the parts are normalised together when merged */
            part[group * d + g] = top;
            part[group * d + group + g] = vf_sum(vsum) + tail;
            continue;
        }
        const vf inv = vf_set1(1.0f / (vf_sum(vsum) + tail));
        for (t = 0; t < len; t += VLEN)
            vf_store_n(s, t, vf_mul(vf_load_n(s, t, len - t, 0), inv), len - t, 0);
    }
    /* out = probabilities @ values, VALUE_CHUNKS * VLEN features of up to MAX_GROUP query heads per pass, the tokens
     * VALUES_TILE at a time so that their value rows stay in the first-level cache over every pass */
    for (int64_t t0 = 0; t0 < len; t0 += VALUES_TILE) {
        const int64_t t1 = len - t0 < VALUES_TILE ? len : t0 + VALUES_TILE;
        for (int64_t c = 0; c < chunks; c += VALUE_CHUNKS)
            for (int64_t g0 = 0; g0 < group; g0 += MAX_GROUP) {
                const int64_t gn = group - g0 < MAX_GROUP ? group - g0 : MAX_GROUP;
                const int64_t at = (part != NULL ? g0 * d : (b * hq + h * group + g0) * d) + VLEN * c;
                const float *p = scores + g0 * len;
                float *sums = vsum + g0 * d;
                void *dst = part != NULL ? (void *)part : out;
                const int ask = c == 0 && g0 == 0, obf16 = part == NULL && bf16;
                if (chunks - c < VALUE_CHUNKS)
                    weighted_values(v_cache, rows, p, len, t0, t1, sums, VLEN * c, dst, at, d, gn, 1, bf16, ask,
                                    obf16);
                else
                    weighted_values(v_cache, rows, p, len, t0, t1, sums, VLEN * c, dst, at, d, gn, VALUE_CHUNKS, bf16,
                                    ask, obf16);
            }
    }
}

/* The outputs of one (sequence, KV head) from its parts (one_head's layout, `parts` of them): each part's sums weigh
 * e^(top_i - top) against the highest top of all, and the whole is divided by the parts' sums weighed alike. A part
 * with nothing in it has a sum of 0. */
INLINE void merge_parts(const float *parts_data, int64_t parts, int64_t group, int64_t d, void *out, int64_t at,
                        const int bf16) {
    const int64_t part_floats = group * (d + 2);
    for (int64_t g = 0; g < group; g++) {
        float top = -3.0e38f, total = 0.0f;
        for (int64_t i = 0; i < parts; i++) {
            const float *part = parts_data + i * part_floats;
            if (part[group * d + group + g] > 0.0f && part[group * d + g] > top) top = part[group * d + g];
        }
        float weight[MAX_PARTS];
        for (int64_t i = 0; i < parts; i++) {
            const float *part = parts_data + i * part_floats;
            float e[VLEN];
            vf_storeu(e, vf_exp(vf_set1(part[group * d + g] - top)));
            weight[i] = part[group * d + group + g] > 0.0f ? e[0] : 0.0f;
            total += weight[i] * part[group * d + group + g];
        }
        for (int64_t i = 0; i < parts; i++) weight[i] /= total;
        for (int64_t f = 0; f < d; f += VLEN) {
            vf acc = vf_zero();
            for (int64_t i = 0; i < parts; i++)
                if (weight[i] > 0.0f)
                    acc = vf_fma(vf_set1(weight[i]), vf_loadu(parts_data + i * part_floats + g * d + f), acc);
            if (bf16)
                vf_store_bf16((uint16_t *)out + at + g * d + f, acc);
            else
                vf_storeu((float *)out + at + g * d + f, acc);
        }
    }
}

/* One work item with head size D. With AVX2 and bf16 caches the common head sizes (64, 128) are each compiled with D a
 * constant, so that the loops over a row's vectors unroll whole: Zen 4 capped to AVX2, in turns, bit for bit the same,
 * the 0.5B model's step (14 / 2 heads of 64) 0.87-0.94x the time at 8 x 256 and 8 x 1024 tokens and 0.92-0.93x at
 * 1 x 4096 (one KV head of 8: 0.95-1.02x). Float32 caches (0.97-1.08x) and AVX-512 (0.96-1.07x) gained nothing from
 * it and keep one body. */
#define ONE_HEAD_OF_SIZE(D, BF16) \
    one_head(q, k_cache, v_cache, table, lo, hi, out, part, b, h, hq, hk, D, block_size, scale, work, rows, BF16)

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
    /* Fewer (sequence, KV head) items than threads (one long sequence, few KV heads, many cores): each context is
     * split into parts of PART_TOKENS or more, one item each, merged after */
    const int64_t group = hq / hk, items = batch * hk, threads = omp_get_max_threads();
    int64_t parts = 1;
    if (items < threads && longest >= 2 * PART_TOKENS) {
        parts = (threads + items - 1) / items;
        parts = parts < longest / PART_TOKENS ? parts : longest / PART_TOKENS;
        parts = parts < MAX_PARTS ? parts : MAX_PARTS;
    }
    const int64_t span = (longest + parts - 1) / parts, part_floats = group * (d + 2);
    float *partial = parts > 1 ? (float *)malloc(sizeof(float) * items * parts * part_floats) : NULL;
    if (parts > 1 && partial == NULL) return -1;
    const int64_t per_item = group * d + VLEN * d + group * d + group * span;
    int failed = 0;
    #pragma omp parallel reduction(|| : failed)
    {
        float *work = (float *)malloc(sizeof(float) * per_item);
        int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * span);
        if (work == NULL || rows == NULL) failed = 1;
        #pragma omp for collapse(3) schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t h = 0; h < hk; h++)
                for (int64_t i = 0; i < parts; i++) {
                    if (work == NULL || rows == NULL) continue;
                    const int32_t *table = block_tables + b * table_stride;
                    const int64_t len = seq_lens[b], each = (len + parts - 1) / parts;
                    const int64_t lo = i * each < len ? i * each : len, hi = lo + each < len ? lo + each : len;
                    float *part = parts > 1 ? partial + ((b * hk + h) * parts + i) * part_floats : NULL;
                    if (lo == hi) {  /* a short context: nothing in this part */
                        for (int64_t g = 0; g < group; g++) part[group * d + group + g] = 0.0f;
                        continue;
                    }
                    if (VLEN == 8 && bf16 && d == 64)  /* see ONE_HEAD_OF_SIZE */
                        ONE_HEAD_OF_SIZE(64, 1);
                    else if (VLEN == 8 && bf16 && d == 128)
                        ONE_HEAD_OF_SIZE(128, 1);
                    else if (bf16)
                        ONE_HEAD_OF_SIZE(d, 1);
                    else
                        ONE_HEAD_OF_SIZE(d, 0);
                }
        if (parts > 1) {
            #pragma omp for collapse(2) schedule(static)
            for (int64_t b = 0; b < batch; b++)
                for (int64_t h = 0; h < hk; h++)
                    merge_parts(partial + (b * hk + h) * parts * part_floats, parts, group, d, out,
                                (b * hq + h * group) * d, bf16);
        }
        free(work);
        free(rows);
    }
    free(partial);
    return failed ? -1 : 0;
}
