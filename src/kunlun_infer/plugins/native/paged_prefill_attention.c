/*
 * Prompt attention straight from the paged KV cache: the new tokens of each sequence (a prompt, a prompt's chunk
 * after a cached prefix, a speculative step's drafts) against all the context each may see, causal.
 *
 * Built for every kernel set by cpu_native.py (vectors of simd.h), called by cpu_attention.py. One work item is
 * (sequence, KV head, block of query rows): the rows' query vectors of every query head sharing that KV head (up
 * to QUERIES of them, "lanes") are transposed and held in float32 (scaled), or in bf16 pairs, so each cached key
 * and value is read once per item, not once per query as the decode kernel reads it. The context is taken BK keys
 * at a time (flash attention's online softmax):
 * - the keys, widened to float32, multiply the queries as a GEMM whose rows are keys and whose vector lanes are
 *   queries, S = K Q^T (bf16 keys with AVX512-BF16: as they are, in pairs, by VDPBF16PS);
 * - the softmax runs down each lane: the block's max, the probabilities, the running max and sum per query, with
 *   no horizontal sums; keys a query may not see (past its own position) get probability zero;
 * - the values, widened to float32, are weighted by the probabilities as a second GEMM whose rows are queries and
 *   whose lanes are features, O += P^T V, into float32 sums that stay in the thread's scratch (rescaled to each
 *   new max) until the last block, then are divided by the sums and written as the queries' rows. With bf16 values
 *   and AVX512-BF16 the probabilities are rounded to bf16 and the reduction over keys runs in pairs of keys by
 *   VDPBF16PS, as torch's bf16 SDPA rounds them (the same errors against a float64 reference, 1.2e-4 mean at
 *   2048 tokens). Zen 4, both builds in one process, in turns: the bf16 kernel 1.3x faster at 256-2048 tokens.
 * Blocks past the item's last position are never read. The softmax is float32; K/V and q may be bf16 or float32.
 * Where the OS grants the AMX tiles, bf16 items take both products there instead (amx_item, below): on the Xeon with
 * AMX, both builds in one process in turns, 0.22-0.51x the time of the VDPBF16PS kernel at 64-2048 tokens.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define NR (2 * VLEN) /* query lanes per micro-kernel: two vectors */
#if VLEN == 16
#define MR 12 /* keys (first GEMM) or queries (second) per micro-kernel: 2 * MR accumulators */
#else
#define MR 6
#endif
#define BK (8 * MR)   /* keys per block of the context */
#define TILE_KEYS 64  /* keys per block of the context on the AMX tiles (amx_item; at most BK) */
#define LAZY_MAX 8.0f /* how far (base 2) a block's max may exceed a lane's before the tiles' sums move to it */
#define QUERIES 128   /* query vectors per work item, at most (more only when one row has more heads) */
/* The same on the AMX tiles (amx_item), where a lane tile skips the blocks past its queries: gathering a block's
 * keys and values once for more queries, 512 took 0.80-0.89x the time of 128 at 64-2048 tokens on the Xeon with AMX
 * (in turns); 1024 no less than 512 */
#define QUERIES_TILES 512
#define UNROLL _Pragma("GCC unroll 16")

typedef struct {
    int64_t seq, head, row0, rows, cost;
} work_item;

static int costlier_first(const void *a, const void *b) {
    const int64_t x = ((const work_item *)a)->cost, y = ((const work_item *)b)->cost;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* S[r][lanes] = sum_c kf[r][c] * qt[c][lanes] for `keys` keys (rows of kf, d features each) and one tile of NR
 * query lanes (qt [d][NR]) */
INLINE void scores_tile(const float *kf, const float *qt, int64_t d, float *s, int64_t lds, const int keys) {
    fma_tile(kf, 1, d, qt, NR, d, s, lds, keys, 2, 0);
}

#if defined(__AVX512BF16__)
/* scores_tile for bf16 keys and queries, the reduction in pairs (kb [keys][d], qt2 [d / 2][NR] pairs of a query's
 * features): VDPBF16PS, float32 sums, twice the FMAs' products per instruction; scaled as they are stored */
INLINE void scores_tile_bf16(const uint16_t *kb, const uint32_t *qt2, int64_t d, float scale, float *s, int64_t lds,
                             const int keys) {
    __m512 a0[MR], a1[MR];
    UNROLL for (int r = 0; r < keys; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d / 2; c++) {
        const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qt2 + c * NR);
        const __m512bh q1 = (__m512bh)_mm512_loadu_si512(qt2 + c * NR + VLEN);
        UNROLL for (int r = 0; r < keys; r++) {
            int32_t pair;
            memcpy(&pair, kb + r * d + 2 * c, sizeof pair);
            const __m512bh kr = (__m512bh)_mm512_set1_epi32(pair);
            a0[r] = _mm512_dpbf16_ps(a0[r], q0, kr);
            a1[r] = _mm512_dpbf16_ps(a1[r], q1, kr);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    UNROLL for (int r = 0; r < keys; r++) {
        _mm512_storeu_ps(s + r * lds, _mm512_mul_ps(a0[r], sc));
        _mm512_storeu_ps(s + r * lds + VLEN, _mm512_mul_ps(a1[r], sc));
    }
}
#define DOT_BF16 1
#else
#define DOT_BF16 0
#endif

/* o[r][0 .. vecs * VLEN) += sum_t p[t][r] * vfl[t][0 .. vecs * VLEN) for `queries` queries (p's columns, o's rows,
 * ldo apart) and one or two vectors of features (vfl rows d apart) */
INLINE void values_tile(const float *p, int64_t ldp, const float *vfl, int64_t d, int64_t keys, float *o, int64_t ldo,
                        const int queries, const int vecs) {
    fma_tile(p, ldp, 1, vfl, d, keys, o, ldo, queries, vecs, 1);
}

#if DOT_BF16
/* values_tile for bf16 pairs of keys, the reduction over keys in pairs by VDPBF16PS: pp [pairs][ldp] holds each
 * query's probabilities of keys 2t and 2t + 1 as one bf16 pair, vp [pairs][d] each feature's values of the same
 * two keys */
INLINE void values_tile_bf16(const uint32_t *pp, int64_t ldp, const uint32_t *vp, int64_t d, int64_t pairs, float *o,
                             int64_t ldo, const int queries, const int vecs) {
    __m512 a0[MR], a1[MR];
    UNROLL for (int r = 0; r < queries; r++) {
        a0[r] = _mm512_loadu_ps(o + r * ldo);
        a1[r] = vecs > 1 ? _mm512_loadu_ps(o + r * ldo + VLEN) : _mm512_setzero_ps();
    }
    for (int64_t t = 0; t < pairs; t++) {
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vp + t * d);
        const __m512bh v1 = vecs > 1 ? (__m512bh)_mm512_loadu_si512(vp + t * d + VLEN) : v0;
        UNROLL for (int r = 0; r < queries; r++) {
            const __m512bh pr = (__m512bh)_mm512_set1_epi32((int)pp[t * ldp + r]);
            a0[r] = _mm512_dpbf16_ps(a0[r], v0, pr);
            if (vecs > 1) a1[r] = _mm512_dpbf16_ps(a1[r], v1, pr);
        }
    }
    UNROLL for (int r = 0; r < queries; r++) {
        _mm512_storeu_ps(o + r * ldo, a0[r]);
        if (vecs > 1) _mm512_storeu_ps(o + r * ldo + VLEN, a1[r]);
    }
}

#endif

/* the thread's scratch for items of up to `lanes` query lanes (a multiple of NR) and head size d */
typedef struct {
    float *qt, *o, *s, *kf, *vfl, *top, *sum, *qpos, *alpha;
    uint32_t *pp; /* a block's probabilities as bf16 pairs of keys (values_tile_bf16; the B tiles of O^T) */
    uint32_t *vt; /* a block's values transposed, [d][keys] bf16 (the A tiles of O^T) */
} scratch;

static int scratch_alloc(scratch *w, int64_t lanes, int64_t d) {
    const size_t f = sizeof(float);
    const int64_t blocks = lanes * BK > 2 * TILE_KEYS * NR ? lanes * BK : 2 * TILE_KEYS * NR; /* amx_item: two */
    w->qt = (float *)malloc(f * (size_t)(lanes * d));
    w->o = (float *)malloc(f * (size_t)(lanes * d));
    w->s = (float *)malloc(f * (size_t)blocks);
    w->kf = (float *)malloc(f * (size_t)(BK * d + VLEN));
    w->vfl = (float *)malloc(f * (size_t)(BK * d + VLEN));
    w->top = (float *)malloc(f * (size_t)lanes);
    w->sum = (float *)malloc(f * (size_t)lanes);
    w->qpos = (float *)malloc(f * (size_t)lanes);
    w->alpha = (float *)malloc(f * (size_t)lanes);
    w->pp = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(blocks / 2));
    w->vt = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)(d * (BK / 2)));
    return w->vt && w->pp && w->alpha && w->qt && w->o && w->s && w->kf && w->vfl && w->top && w->sum &&
           w->qpos;
}

static void scratch_free(scratch *w) {
    free(w->vt), free(w->pp), free(w->alpha), free(w->qt), free(w->o), free(w->s), free(w->kf), free(w->vfl);
    free(w->top), free(w->sum), free(w->qpos);
}

/* queries i .. i + queries of the lanes times the block's values, features c .. c + vecs * VLEN (see one_item) */
INLINE void block_values(const scratch *w, int64_t i, int64_t c, int64_t d, int64_t nk, int64_t lds,
                         const int queries, const int vecs, const int dot) {
#if DOT_BF16
    if (dot) {
        values_tile_bf16(w->pp + i, lds, (const uint32_t *)w->vfl + c, d, (nk + 1) / 2, w->o + i * d + c, d,
                         queries, vecs);
        return;
    }
#endif
    (void)dot;
    values_tile(w->s + i, lds, w->vfl + c, d, nk, w->o + i * d + c, d, queries, vecs);
}

#define VALUES_CASE(R) \
    case R: \
        if (d - c >= NR) block_values(w, i, c, d, nk, lds, R, 2, dot); /* vecs a constant in each */ \
        else block_values(w, i, c, d, nk, lds, R, 1, dot); \
        break;

/* the scores of keys t .. t + keys of the block against tile `tile` of the query lanes (see one_item) */
INLINE void block_scores(const scratch *w, int64_t tile, int64_t t, int64_t d, float scale, int64_t lds,
                         const int keys, const int dot) {
    float *s = w->s + tile * NR + t * lds;
#if DOT_BF16
    if (dot) {
        scores_tile_bf16((const uint16_t *)w->kf + t * d, (const uint32_t *)w->qt + tile * (d / 2) * NR, d, scale, s,
                         lds, keys);
        return;
    }
#endif
    (void)dot, (void)scale;
    scores_tile(w->kf + t * d, w->qt + tile * d * NR, d, s, lds, keys);
}

#define SCORES_CASE(R) case R: block_scores(w, tile, t, d, scale, lds, R, dot); break;

/* where the row of position `pos`, head h, starts in a cache [blocks][block_size][hk][d] (elements) */
INLINE int64_t cache_row(const int32_t *table, int64_t pos, int64_t h, int64_t hk, int64_t d, int64_t block_size) {
    return (((int64_t)table[pos / block_size] * block_size + pos % block_size) * hk + h) * d;
}

/* rows [t0, t0 + n) of one head of the cache into dst [n][d]: widened to float32, or (`copy`, a bf16 cache) as they
 * are */
INLINE void gather_rows(const void *cache, const int32_t *table, int64_t t0, int64_t n, int64_t h, int64_t hk,
                        int64_t d, int64_t block_size, void *dst, const int bf16, const int copy) {
    for (int64_t t = 0; t < n; t++) {
        const int64_t row = cache_row(table, t0 + t, h, hk, d, block_size);
        if (copy) {
            memcpy((uint16_t *)dst + t * d, (const uint16_t *)cache + row, sizeof(uint16_t) * (size_t)d);
            continue;
        }
        for (int64_t c = 0; c < d; c += VLEN)
            vf_store_n((float *)dst + t * d, c, vf_load_n(cache, row + c, d - c, bf16), d - c, 0);
    }
}

/* the values of rows [t0, t0 + n) of one head (see gather_rows): widened to float32, or (`dot`) as bf16 pairs of
 * consecutive rows, dst [(n + 1) / 2][d] uint32 (a last odd row paired with zeros) for values_tile_bf16 */
INLINE void gather_values(const void *cache, const int32_t *table, int64_t t0, int64_t n, int64_t h, int64_t hk,
                          int64_t d, int64_t block_size, float *dst, const int bf16, const int dot) {
#if DOT_BF16
    if (dot) {
        const uint16_t *v = (const uint16_t *)cache;
        for (int64_t t = 0; t < n; t += 2) {
            const uint16_t *lo = v + cache_row(table, t0 + t, h, hk, d, block_size);
            const uint16_t *hi = t + 1 < n ? v + cache_row(table, t0 + t + 1, h, hk, d, block_size) : NULL;
            for (int64_t c = 0; c < d; c += VLEN) {
                const __m256i l = _mm256_loadu_si256((const __m256i *)(lo + c));
                const __m256i u = hi ? _mm256_loadu_si256((const __m256i *)(hi + c)) : _mm256_setzero_si256();
                _mm512_storeu_si512((uint32_t *)dst + t / 2 * d + c, bf16_pairs(l, u));
            }
        }
        return;
    }
#endif
    (void)dot;
    gather_rows(cache, table, t0, n, h, hk, d, block_size, dst, bf16, 0);
}

/* An item's queries into the scratch, as tiles [tile][d][NR], scaled (or, `dot`, as bf16 pairs [tile][d / 2][NR],
 * scaled with the scores); lane i is row i / group, head h * group + i % group; lanes past the item's queries are
 * zero and stand at its last position (finite scores, never written out). Each lane's position, running max and
 * sum set for its first block. */
INLINE void start_item(const void *q, int64_t q_start, const work_item *it, int64_t hq, int64_t group, int64_t d,
                       int64_t first_pos, int64_t lanes, float scale, scratch *w, const int bf16, const int dot) {
    const int64_t h = it->head, m = it->rows * group, last_pos = first_pos + it->rows - 1;
    for (int64_t i = 0; i < lanes; i++) {
        const int64_t tile = i / NR, lane = i % NR;
        const int64_t at = ((q_start + it->row0 + i / group) * hq + h * group + i % group) * d;
        if (dot) {
            uint32_t *qt2 = (uint32_t *)w->qt + tile * (d / 2) * NR + lane;
            for (int64_t c = 0; c < d / 2; c++) {
                uint32_t pair = 0;
                if (i < m) memcpy(&pair, (const uint16_t *)q + at + 2 * c, sizeof pair);
                qt2[c * NR] = pair;
            }
        } else {
            for (int64_t c = 0; c < d; c++) {
                float x = 0.0f;
                if (i < m)
                    x = scale * (bf16 ? float_from_bf16(((const uint16_t *)q)[at + c]) : ((const float *)q)[at + c]);
                w->qt[(tile * d + c) * NR + lane] = x;
            }
        }
        w->qpos[i] = (float)(i < m ? first_pos + i / group : last_pos);
        w->top[i] = -3.0e38f;
        w->sum[i] = 0.0f;
    }
    memset(w->o, 0, sizeof(float) * (size_t)(lanes * d));
}

INLINE void one_item(const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int64_t ctx,
                     int64_t q_len, int64_t q_start, const work_item *it, void *out, int64_t hq, int64_t hk,
                     int64_t d, int64_t block_size, float scale, scratch *w, const int bf16) {
    const int64_t group = hq / hk, h = it->head, m = it->rows * group, lanes = (m + NR - 1) / NR * NR;
    const int64_t tiles = lanes / NR, lds = lanes, first_pos = ctx - q_len + it->row0;
    const int64_t last_pos = first_pos + it->rows - 1;
    const int dot = bf16 && DOT_BF16;  /* bf16 keys and queries multiplied in pairs (scores_tile_bf16) */
    start_item(q, q_start, it, hq, group, d, first_pos, lanes, scale, w, bf16, dot);
    for (int64_t k0 = 0; k0 <= last_pos; k0 += BK) {
        const int64_t nk = last_pos + 1 - k0 < BK ? last_pos + 1 - k0 : BK;
        const int diagonal = k0 + nk - 1 > first_pos;  /* some query of the item may not see some key here */
        gather_rows(k_cache, table, k0, nk, h, hk, d, block_size, w->kf, bf16, dot);
        gather_values(v_cache, table, k0, nk, h, hk, d, block_size, w->vfl, bf16, dot);
        for (int64_t tile = 0; tile < tiles; tile++) {
            int64_t t = 0;
            for (; t + MR <= nk; t += MR) block_scores(w, tile, t, d, scale, lds, MR, dot);
            switch (nk - t) {
#if MR > 6
                SCORES_CASE(6) SCORES_CASE(7) SCORES_CASE(8) SCORES_CASE(9) SCORES_CASE(10) SCORES_CASE(11)
#endif
                SCORES_CASE(1) SCORES_CASE(2) SCORES_CASE(3) SCORES_CASE(4) SCORES_CASE(5)
                default: break;
            }
        }
        float *s = w->s;
        /* online softmax down each lane: the block's max, the probabilities, the running sums rescaled */
        for (int64_t i = 0; i < lanes; i += VLEN) {
            const vf qp = vf_loadu(w->qpos + i), hidden = vf_set1(-3.0e38f);
            vf top = vf_loadu(w->top + i);
            const vf before = top;
            for (int64_t t = 0; t < nk; t++) {
                const vf x = vf_loadu(s + t * lds + i);
                top = vf_max(top, diagonal ? vf_select_gt(vf_set1((float)(k0 + t)), qp, hidden, x) : x);
            }
            vf total = vf_zero();
            for (int64_t t = 0; t < nk; t++) {
                vf p = vf_exp(vf_sub(vf_loadu(s + t * lds + i), top));
                if (diagonal) p = vf_select_gt(vf_set1((float)(k0 + t)), qp, vf_zero(), p);
                vf_storeu(s + t * lds + i, p);
                total = vf_add(total, p);
            }
            const vf alpha = vf_exp(vf_sub(before, top));
            vf_storeu(w->sum + i, vf_fma(vf_loadu(w->sum + i), alpha, total));
            vf_storeu(w->top + i, top);
            vf_storeu(w->alpha + i, alpha);
        }
#if DOT_BF16
        if (dot)  /* the probabilities as bf16 pairs of consecutive keys (a last odd key paired with zero) */
            for (int64_t t = 0; t < nk; t += 2)
                for (int64_t i = 0; i < lanes; i += VLEN) {
                    const __m512 lo = _mm512_loadu_ps(s + t * lds + i);
                    const __m512 hi = t + 1 < nk ? _mm512_loadu_ps(s + (t + 1) * lds + i) : _mm512_setzero_ps();
                    _mm512_storeu_si512(w->pp + t / 2 * lds + i, bf16_pairs((__m256i)_mm512_cvtneps_pbh(lo),
                                                                             (__m256i)_mm512_cvtneps_pbh(hi)));
                }
#endif
        /* the sums so far rescaled to the new maxima, then the values weighted by this block's probabilities,
         * MR queries at a time */
        for (int64_t i = 0; i < lanes; i++) {
            const vf a = vf_set1(w->alpha[i]);
            for (int64_t c = 0; c < d; c += VLEN) vf_storeu(w->o + i * d + c, vf_mul(vf_loadu(w->o + i * d + c), a));
        }
        for (int64_t i = 0; i < lanes; i += MR) {
            const int64_t queries = lanes - i < MR ? lanes - i : MR;
            for (int64_t c = 0; c < d; c += NR) {
                switch (queries) {
#if MR > 6
                    VALUES_CASE(7) VALUES_CASE(8) VALUES_CASE(9) VALUES_CASE(10) VALUES_CASE(11) VALUES_CASE(12)
#endif
                    VALUES_CASE(1) VALUES_CASE(2) VALUES_CASE(3) VALUES_CASE(4) VALUES_CASE(5) VALUES_CASE(6)
                    default: break;
                }
            }
        }
    }
    for (int64_t i = 0; i < m; i++) {
        const int64_t row = q_start + it->row0 + i / group, head = h * group + i % group;
        const vf inv = vf_set1(1.0f / w->sum[i]);
        for (int64_t c = 0; c < d; c += VLEN)
            vf_store_n(out, (row * hq + head) * d + c, vf_mul(vf_loadu(w->o + i * d + c), inv), d - c, bf16);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && DOT_BF16
#include "amx.h"
#define AMX_PROMPTS 1
_Static_assert(TILE_KEYS <= BK && TILE_KEYS % 32 == 0, "the tiles' block of keys fits the scratch, in steps of 32");
_Static_assert(NR * sizeof(float) == 128, "a lane tile's row of floats is a row of amx.h's sum tiles");

/*
 * Prompt attention on the AMX tiles (bf16, head size a multiple of 32: kunlun_prompt_attention_on_tiles), over the
 * work items of one_item. Both products are taken transposed, so that neither the queries nor the probabilities
 * move: S^T = K Q^T takes the keys' rows as A tiles and the queries' bf16 pairs [d / 2][NR] (as built for
 * VDPBF16PS) as B tiles; O^T = V^T P takes the values transposed, [d][keys] (one feature's values of two
 * consecutive keys are one pair of an A-tile row), and the probabilities' bf16 pairs of keys [keys / 2][NR] as B
 * tiles, accumulating into the item's O^T in memory. The unit of work is one block of TILE_KEYS keys for one lane
 * tile (NR queries), whose scores and probabilities are rows of 128 bytes, in L1. The vector units' share is the
 * softmax, its exponentials in 9 instructions (pow2_probability); the sums so far are rescaled only when a block's
 * max passes a lane's by a factor over 2^LAZY_MAX (its probabilities are taken against the lane's max until then),
 * which after the first blocks is rare: against rescaling every block, 0.83-0.86x the time at 1024-2048 tokens,
 * 0.85-1.00x at 256-512 (three runs in turns on the Xeon with AMX).
 */

/* the bf16 values of rows [t0, t0 + n) of one head as V^T, vt [d][TILE_KEYS / 2] 32-bit: keys side by side, so each
 * element is one feature's values of keys 2j and 2j + 1; keys n .. padded (a multiple of 32) zero */
static void gather_values_t(const uint16_t *cache, const int32_t *table, int64_t t0, int64_t n, int64_t padded,
                            int64_t h, int64_t hk, int64_t d, int64_t block_size, uint32_t *vt) {
    for (int64_t j0 = 0; j0 < padded; j0 += 32) {
        const uint16_t *row[32];
        for (int t = 0; t < 32; t++)
            row[t] = j0 + t < n ? cache + cache_row(table, t0 + j0 + t, h, hk, d, block_size) : NULL;
        for (int64_t c = 0; c < d; c += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) {
                const __m256i lo = row[2 * j] ? _mm256_loadu_si256((const __m256i *)(row[2 * j] + c))
                                              : _mm256_setzero_si256();
                const __m256i hi = row[2 * j + 1] ? _mm256_loadu_si256((const __m256i *)(row[2 * j + 1] + c))
                                                  : _mm256_setzero_si256();
                r[j] = bf16_pairs(lo, hi);
            }
            transpose16_epi32(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(vt + (c + i) * (TILE_KEYS / 2) + j0 / 2, r[i]);
        }
    }
}

/* S^T for keys t .. t + 32 of kb (bf16 rows, d apart) against a lane tile's bf16 query pairs qt2 [d / 2][NR],
 * unscaled, into s [32][NR] (NR floats are the 128 bytes of amx.h's sum rows) */
INLINE void amx_scores(const uint16_t *kb, const uint32_t *qt2, int64_t d, float *s) {
    amx_zero_sums();
    for (int64_t c = 0; c < d; c += 32)
        AMX_STEP(_tile_dpbf16ps, kb + c, d * (int64_t)sizeof(uint16_t), qt2 + c / 2 * NR, 1);
    amx_store_sums(s, 32);
}

/* O^T [features c .. c + 32][NR] += V^T P over `pairs` pairs of keys (a multiple of 16): vt at feature c, rows
 * TILE_KEYS / 2 apart; pp [pairs][NR]; ot at feature c, rows NR apart */
INLINE void amx_values(const uint32_t *vt, const uint32_t *pp, int64_t pairs, float *ot) {
    const int64_t ldt = TILE_KEYS / 2 * 4;
    amx_load_sums(ot, 32);
    for (int64_t j = 0; j < pairs; j += 16)
        AMX_STEP(_tile_dpbf16ps, vt + j, ldt, pp + j * NR, 1);
    amx_store_sums(ot, 32);
}

/* 2^(x * scale - top) where the key (position k) is seen by the lane (position qpos: k <= qpos), else 0 */
INLINE __m512 seen_exp(__m512 x, __m512 scale, __m512 top, __m512 k, __m512 qpos, const int diagonal) {
    const __m512 p = pow2_probability(_mm512_fmsub_ps(x, scale, top));
    return diagonal ? _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(k, qpos, _CMP_LE_OQ), p) : p;
}

/* One block's online softmax for a lane tile: s [nk][NR] the unscaled scores; the lanes' running max (top, in base-2
 * units: scaled by scale * log2(e); lazily, see LAZY_MAX) and sum updated, alpha the factor their sums so far take;
 * the probabilities as bf16 pairs of keys into pp [padded / 2][NR], zero past nk. Two lanes' vectors and two keys a
 * turn: four chains of max and of sum. Returns 1 if the sums so far must take alpha (some lane's max moved). */
INLINE int amx_softmax(const float *s, int64_t nk, int64_t padded, int64_t k0, float scale, const float *qpos,
                       float *top, float *sum, float *alpha, uint32_t *pp, const int diagonal) {
    const __m512 sc = _mm512_set1_ps(scale * LOG2E), hidden = _mm512_set1_ps(-3.0e38f);
    const __m512 zero = _mm512_setzero_ps(), q0 = _mm512_loadu_ps(qpos), q1 = _mm512_loadu_ps(qpos + 16);
    __m512 m00 = hidden, m01 = hidden, m10 = hidden, m11 = hidden; /* the raw scores' max: scale > 0 */
    for (int64_t t = 0; t < nk; t += 2) {
        const __m512 k = _mm512_set1_ps((float)(k0 + t)), k1 = _mm512_set1_ps((float)(k0 + t + 1));
        const __m512 x00 = _mm512_loadu_ps(s + t * NR), x01 = _mm512_loadu_ps(s + t * NR + 16);
        m00 = _mm512_max_ps(m00, diagonal ? vf_select_gt(k, q0, hidden, x00) : x00);
        m01 = _mm512_max_ps(m01, diagonal ? vf_select_gt(k, q1, hidden, x01) : x01);
        if (t + 1 < nk) {
            const __m512 x10 = _mm512_loadu_ps(s + (t + 1) * NR), x11 = _mm512_loadu_ps(s + (t + 1) * NR + 16);
            m10 = _mm512_max_ps(m10, diagonal ? vf_select_gt(k1, q0, hidden, x10) : x10);
            m11 = _mm512_max_ps(m11, diagonal ? vf_select_gt(k1, q1, hidden, x11) : x11);
        }
    }
    /* a lane keeps its max unless the block's exceeds it by more than LAZY_MAX (probabilities up to 2^LAZY_MAX) */
    const __m512 before0 = _mm512_loadu_ps(top), before1 = _mm512_loadu_ps(top + 16), lazy = _mm512_set1_ps(LAZY_MAX);
    const __m512 new0 = _mm512_mul_ps(_mm512_max_ps(m00, m10), sc), new1 = _mm512_mul_ps(_mm512_max_ps(m01, m11), sc);
    const __mmask16 moved0 = _mm512_cmp_ps_mask(new0, _mm512_add_ps(before0, lazy), _CMP_GT_OQ);
    const __mmask16 moved1 = _mm512_cmp_ps_mask(new1, _mm512_add_ps(before1, lazy), _CMP_GT_OQ);
    const __m512 top0 = _mm512_mask_mov_ps(before0, moved0, new0), top1 = _mm512_mask_mov_ps(before1, moved1, new1);
    /* the sums so far are rescaled only where a lane had some (its first block had none) */
    const __m512 none = _mm512_set1_ps(-1.0e38f);
    const int rescale = (_mm512_mask_cmp_ps_mask(moved0, before0, none, _CMP_GT_OQ) |
                         _mm512_mask_cmp_ps_mask(moved1, before1, none, _CMP_GT_OQ)) != 0;
    __m512 s00 = zero, s01 = zero, s10 = zero, s11 = zero;
    for (int64_t t = 0; t < padded; t += 2) {
        __m512 p00 = zero, p01 = zero, p10 = zero, p11 = zero;
        if (t < nk) {
            const __m512 k = _mm512_set1_ps((float)(k0 + t));
            p00 = seen_exp(_mm512_loadu_ps(s + t * NR), sc, top0, k, q0, diagonal);
            p01 = seen_exp(_mm512_loadu_ps(s + t * NR + 16), sc, top1, k, q1, diagonal);
            s00 = _mm512_add_ps(s00, p00);
            s01 = _mm512_add_ps(s01, p01);
        }
        if (t + 1 < nk) {
            const __m512 k = _mm512_set1_ps((float)(k0 + t + 1));
            p10 = seen_exp(_mm512_loadu_ps(s + (t + 1) * NR), sc, top0, k, q0, diagonal);
            p11 = seen_exp(_mm512_loadu_ps(s + (t + 1) * NR + 16), sc, top1, k, q1, diagonal);
            s10 = _mm512_add_ps(s10, p10);
            s11 = _mm512_add_ps(s11, p11);
        }
        _mm512_storeu_si512(pp + t / 2 * NR, probability_pairs(p00, p10));
        _mm512_storeu_si512(pp + t / 2 * NR + 16, probability_pairs(p01, p11));
    }
    const __m512 a0 = pow2_probability(_mm512_sub_ps(before0, top0));
    const __m512 a1 = pow2_probability(_mm512_sub_ps(before1, top1));
    _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_loadu_ps(sum), a0, _mm512_add_ps(s00, s10)));
    _mm512_storeu_ps(sum + 16, _mm512_fmadd_ps(_mm512_loadu_ps(sum + 16), a1, _mm512_add_ps(s01, s11)));
    _mm512_storeu_ps(top, top0);
    _mm512_storeu_ps(top + 16, top1);
    _mm512_storeu_ps(alpha, a0);
    _mm512_storeu_ps(alpha + 16, a1);
    return rescale;
}

/* One unit of an item's work on the tiles: a block of TILE_KEYS keys for one lane tile */
typedef struct {
    int64_t tile, k0, nk, padded; /* the lane tile; the block's first key; the keys from k0 some query of the tile
                                   * sees, at most TILE_KEYS; those as the tiles take them (whole steps of 32) */
    int64_t block_nk, block_padded; /* the same for the item's last tile: what the block gathers */
    int first, diagonal; /* the block's first unit (it gathers); some query of the tile may not see some key */
} unit;

/* the position of lane tile t's last query (hi) or first (lo), from the lanes' positions qpos */
INLINE int64_t tile_hi(const float *qpos, int64_t t) { return (int64_t)qpos[t * NR + NR - 1]; }
INLINE int64_t tile_lo(const float *qpos, int64_t t) { return (int64_t)qpos[t * NR]; }

/* The first lane tile whose last query reaches key k0 (the tiles' positions rise with the lanes; the last tile's
 * last query reaches every block of the item) */
INLINE int64_t first_tile(const float *qpos, int64_t k0) {
    int64_t t = 0;
    while (tile_hi(qpos, t) < k0) t++;
    return t;
}

/* The blocks every lane tile reaches come first, each for every tile in turn; then the blocks of the diagonal, each
 * for the tiles whose queries reach it: a tile never takes a block all of whose keys lie past its queries. */
INLINE int64_t full_blocks(const float *qpos) { return tile_hi(qpos, 0) / TILE_KEYS + 1; }

INLINE int64_t units_of(const float *qpos, int64_t tiles) {
    const int64_t full = full_blocks(qpos), blocks = tile_hi(qpos, tiles - 1) / TILE_KEYS + 1;
    int64_t n = full * tiles;
    for (int64_t b = full; b < blocks; b++) n += tiles - first_tile(qpos, b * TILE_KEYS);
    return n;
}

INLINE unit unit_at(int64_t u, const float *qpos, int64_t tiles) {
    const int64_t full = full_blocks(qpos);
    int64_t b = u / tiles, t0 = 0, tile = u % tiles;
    if (u >= full * tiles)
        for (u -= full * tiles, b = full;; u -= tiles - t0, b++) {
            t0 = first_tile(qpos, b * TILE_KEYS);
            if (u < tiles - t0) {
                tile = t0 + u;
                break;
            }
        }
    unit x;
    x.tile = tile;
    x.k0 = b * TILE_KEYS;
    x.nk = tile_hi(qpos, tile) + 1 - x.k0 < TILE_KEYS ? tile_hi(qpos, tile) + 1 - x.k0 : TILE_KEYS;
    x.padded = (x.nk + 31) / 32 * 32;
    x.block_nk = tile_hi(qpos, tiles - 1) + 1 - x.k0 < TILE_KEYS ? tile_hi(qpos, tiles - 1) + 1 - x.k0 : TILE_KEYS;
    x.block_padded = (x.block_nk + 31) / 32 * 32;
    x.first = tile == t0;
    x.diagonal = x.k0 + x.nk - 1 > tile_lo(qpos, tile);
    return x;
}

/*
 * One work item on the tiles. Its units run as a pipeline, each stage a unit behind the last, so that no tile load
 * reads what vector stores have just written (it would wait for them), nor vector loads what tile stores just have:
 * in turn i, the scores of unit i + 1 and the values of unit i - 1 on the tiles, then the softmax of unit i (and,
 * if its max moved, the rescaling of its tile's sums). The scores and probabilities alternate between two buffers.
 * (Splitting each turn's work into pieces taken in turns, so that the tiles and the vector units overlap more, was
 * no faster: 1.02-1.08x the time.)
 */
static void amx_item(const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int64_t ctx,
                     int64_t q_len, int64_t q_start, const work_item *it, void *out, int64_t hq, int64_t hk,
                     int64_t d, int64_t block_size, float scale, scratch *w) {
    const int64_t group = hq / hk, h = it->head, m = it->rows * group, lanes = (m + NR - 1) / NR * NR;
    const int64_t tiles = lanes / NR, first = ctx - q_len + it->row0;
    start_item(q, q_start, it, hq, group, d, first, lanes, scale, w, 1, 1);
    const int64_t units = units_of(w->qpos, tiles);
    uint16_t *kb = (uint16_t *)w->kf;
    float *s[2] = {w->s, w->s + TILE_KEYS * NR};
    uint32_t *pp[2] = {w->pp, w->pp + TILE_KEYS / 2 * NR};
    for (int64_t i = -1; i <= units; i++) {
        if (i + 1 < units) { /* scores of unit i + 1 */
            const int64_t u = i + 1;
            const unit x = unit_at(u, w->qpos, tiles);
            if (x.first) {
                gather_rows(k_cache, table, x.k0, x.block_nk, h, hk, d, block_size, kb, 1, 1);
                memset(kb + x.block_nk * d, 0, sizeof(uint16_t) * (size_t)((x.block_padded - x.block_nk) * d));
            }
            for (int64_t t = 0; t < x.padded; t += 32)
                amx_scores(kb + t * d, (const uint32_t *)w->qt + x.tile * (d / 2) * NR, d, s[u % 2] + t * NR);
        }
        if (i >= 1 && i - 1 < units) { /* values of unit i - 1 */
            const int64_t u = i - 1;
            const unit x = unit_at(u, w->qpos, tiles);
            if (x.first)
                gather_values_t((const uint16_t *)v_cache, table, x.k0, x.block_nk, x.block_padded, h, hk, d,
                                block_size, w->vt);
            for (int64_t c = 0; c < d; c += 32)
                amx_values(w->vt + c * (TILE_KEYS / 2), pp[u % 2], x.padded / 2, w->o + x.tile * d * NR + c * NR);
        }
        if (i >= 0 && i < units) { /* softmax of unit i */
            const unit x = unit_at(i, w->qpos, tiles);
            const int64_t i0 = x.tile * NR;
            const int rescale =
                x.diagonal ? amx_softmax(s[i % 2], x.nk, x.padded, x.k0, scale, w->qpos + i0, w->top + i0,
                                         w->sum + i0, w->alpha + i0, pp[i % 2], 1)
                           : amx_softmax(s[i % 2], x.nk, x.padded, x.k0, scale, w->qpos + i0, w->top + i0,
                                         w->sum + i0, w->alpha + i0, pp[i % 2], 0);
            if (rescale) { /* the tile's sums so far, to the new maxima, before the tiles add this block's */
                float *ot = w->o + x.tile * d * NR;
                const __m512 a0 = _mm512_loadu_ps(w->alpha + i0), a1 = _mm512_loadu_ps(w->alpha + i0 + 16);
                for (int64_t c = 0; c < d * NR; c += NR) {
                    _mm512_storeu_ps(ot + c, _mm512_mul_ps(_mm512_loadu_ps(ot + c), a0));
                    _mm512_storeu_ps(ot + c + 16, _mm512_mul_ps(_mm512_loadu_ps(ot + c + 16), a1));
                }
            }
        }
    }
    /* O^T back to the queries' rows, 16 lanes x 16 features a transpose, divided by the sums */
    for (int64_t i0 = 0; i0 < m; i0 += 16) {
        const float *ot = w->o + i0 / NR * d * NR + i0 % NR;
        for (int64_t c = 0; c < d; c += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512(ot + (c + j) * NR);
            transpose16_epi32(r);
            for (int i = 0; i < 16 && i0 + i < m; i++) {
                const int64_t lane = i0 + i;
                const int64_t at = ((q_start + it->row0 + lane / group) * hq + h * group + lane % group) * d + c;
                const __m512 o = _mm512_mul_ps(_mm512_castsi512_ps(r[i]), _mm512_set1_ps(1.0f / w->sum[lane]));
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), (__m256i)_mm512_cvtneps_pbh(o));
            }
        }
    }
}
#else
#define AMX_PROMPTS 0
#endif

/* 1 when prompts of this dtype (bf16: 1) and head size are attended on the AMX tiles here (amx_item): bf16, the
 * head size a multiple of 32, the tiles built in and granted by the OS; else 0 (one_item) */
int kunlun_prompt_attention_on_tiles(int bf16, int64_t d) {
#if AMX_PROMPTS
    return bf16 && d % 32 == 0 && kunlun_amx_tiles();
#else
    (void)bf16, (void)d;
    return 0;
#endif
}

/*
 * q, out: [T, Hq, D] (rows of every sequence of the batch); sequence i of the `num_seqs` given owns rows
 * q_starts[i] .. q_starts[i] + q_lens[i] (rows of sequences not given are neither read nor written) and has
 * seq_lens[i] tokens of context including them, its K/V stored; block_tables: [num_seqs, table_stride] int32;
 * k_cache, v_cache: [num_blocks, block_size, Hk, D]; all in the dtype given by bf16 (1: bfloat16, 0: float32).
 * Query row j of sequence i sits at position seq_lens[i] - q_lens[i] + j and sees keys 0 .. that position.
 * Returns 0; -1 if scratch memory could not be allocated; -2, having read nothing, if a sequence has no new
 * token or more than its context, its context reaches past its table, or it uses a block id outside the cache.
 */
int kunlun_paged_prefill_attention(const void *q, const void *k_cache, const void *v_cache, int64_t num_blocks,
                                   const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                                   const int32_t *q_starts, const int32_t *q_lens, void *out, int64_t num_seqs,
                                   int64_t hq, int64_t hk, int64_t d, int64_t block_size, float scale, int bf16) {
    const int amx = kunlun_prompt_attention_on_tiles(bf16, d);
    const int64_t queries = amx ? QUERIES_TILES : QUERIES;
    const int64_t group = hq / hk, rows_per_item = queries / group > 0 ? queries / group : 1;
    int64_t count = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t len = seq_lens[s], used = (len + block_size - 1) / block_size;
        if (q_lens[s] < 1 || q_lens[s] > len || used > table_stride) return -2;
        for (int64_t i = 0; i < used; i++) {
            const int32_t block = block_tables[s * table_stride + i];
            if (block < 0 || block >= num_blocks) return -2;
        }
        count += (q_lens[s] + rows_per_item - 1) / rows_per_item * hk;
    }
    work_item *items = (work_item *)malloc(sizeof(work_item) * (size_t)(count > 0 ? count : 1));
    if (items == NULL) return -1;
    int64_t n = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t row0 = 0; row0 < q_lens[s]; row0 += rows_per_item)
            for (int64_t h = 0; h < hk; h++) {
                const int64_t rows = q_lens[s] - row0 < rows_per_item ? q_lens[s] - row0 : rows_per_item;
                items[n++] = (work_item){s, h, row0, rows, rows * (seq_lens[s] - q_lens[s] + row0 + rows)};
            }
    qsort(items, (size_t)n, sizeof(work_item), costlier_first);  /* the longest first: the threads end together */
    const int64_t lanes = ((rows_per_item * group > queries ? rows_per_item * group : queries) + NR - 1) / NR * NR;
    int failed = 0;
    #pragma omp parallel reduction(|| : failed)
    {
        scratch w;
        const int ok = scratch_alloc(&w, lanes, d);
        if (!ok) failed = 1;
#if AMX_PROMPTS
        if (amx) amx_configure(16, 16);
#endif
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; i++) {
            if (!ok) continue;
            const work_item *it = &items[i];
            const int32_t *table = block_tables + it->seq * table_stride;
            if (amx) {
#if AMX_PROMPTS
                amx_item(q, k_cache, v_cache, table, seq_lens[it->seq], q_lens[it->seq], q_starts[it->seq], it, out,
                         hq, hk, d, block_size, scale, &w);
#endif
            } else if (bf16)
                one_item(q, k_cache, v_cache, table, seq_lens[it->seq], q_lens[it->seq], q_starts[it->seq], it, out,
                         hq, hk, d, block_size, scale, &w, 1);
            else
                one_item(q, k_cache, v_cache, table, seq_lens[it->seq], q_lens[it->seq], q_starts[it->seq], it, out,
                         hq, hk, d, block_size, scale, &w, 0);
        }
#if AMX_PROMPTS
        if (amx) _tile_release();
#endif
        scratch_free(&w);
    }
    free(items);
    return failed ? -1 : 0;
}
