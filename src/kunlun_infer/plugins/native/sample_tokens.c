/*
 * Sampled decoding: each row's next token drawn from its logits, as the reference sample_tokens defines it
 * (ops/reference.py): weights exp((logit - top) / temperature), 0 at or below the exponent floor (a NaN logit weighs
 * 0 here); top-k keeps the weights from the k-th heaviest up, ties kept; top-p the heaviest while the mass before
 * them is short of top_p of what top-k left, of the tokens tied at its threshold as many as that mass asks for, the
 * first in column order; min_p drops the weights below min_p times the heaviest (1); then inverse transform with two
 * uniforms, the first picking a block of tokens (the reference's DRAW_BLOCK) by their sums, the second a token in it
 * (the floor and the block width come from the caller, ops/reference.py holding them). A row of
 * temperature 0 takes its argmax (greedy_tokens.c).
 *
 * One thread a row, and a row in a few passes over its weights (kept in the thread's scratch, 0.6 MB for a 152k
 * vocabulary, within a core's L2): its largest logit; the weights; where top-k or top-p asks, a histogram of their
 * count and mass by the top 12 bits of their float32 bits (bins 12.5% wide; bits order non-negative floats); then
 * the tokens of the one bin where the count or mass crosses are gathered, and their threshold found among them by
 * two more digits of 10 bits; last the sums of the kept weights per block and the block drawn. The logits come from
 * memory once (the weights' pass finds them in L2), the weights are read two to four times from L2. The torch passes
 * it replaces (a topk of candidates, radix selections by scatter_add, block sums and a draw, each over the whole
 * [rows, vocab] tensor) took 45-78 ms for 128 Zipf-like rows of 151936 logits on the Xeon with AMX, 2 threads, where
 * this takes 8.7 (temperature) to 16.6 ms (top-k and top-p); 220 against 14.2 ms with top-p over wide rows.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

int64_t kunlun_row_argmax(const float *row, int64_t n); /* greedy_tokens.c */

#define FIRST_SHIFT 20     /* the first digit: a weight's bits >> 20 (weights lie in [0, 1], bits <= 0x3F800000) */
#define BINS 1024
#define DIGIT 10 /* the two later digits: bits 10-19, then 0-9 */
#define COPIES 4 /* histograms filled in turn, so tokens of one bin in a row do not wait on each other's update */

typedef struct {
    uint32_t bits;
    int32_t index;
} cand_t;

static inline uint32_t bits_of(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static inline float float_of(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* the largest of x[0, n), NaNs passed over (max keeps its second operand where the first is NaN), clamped to the
 * finite floats (a logit of +inf weighs 1, as the largest finite one would) */
static float row_max(const float *x, int64_t n) {
    vf m0 = vf_set1(-INFINITY), m1 = m0;
    int64_t i = 0;
    for (; i + 2 * VLEN <= n; i += 2 * VLEN) {
        m0 = vf_max(vf_loadu(x + i), m0);
        m1 = vf_max(vf_loadu(x + i + VLEN), m1);
    }
    float top = vf_hmax(vf_max(m0, m1));
    for (; i < n; i++)
        if (x[i] > top) top = x[i];
    return fminf(fmaxf(top, -FLT_MAX), FLT_MAX);
}

/* w[i] = exp(e), e = (x[i] - top) / t clamped to [lowest, 0]; 0 where e is at that floor or NaN */
static void weigh(const float *x, int64_t n, float top, float t, float lowest, float *w) {
    const vf vtop = vf_set1(top), vt = vf_set1(t), floor = vf_set1(lowest), zero = vf_zero();
    int64_t i = 0;
    for (; i + VLEN <= n; i += VLEN) {
        const vf e = vf_min(vf_max(vf_div(vf_sub(vf_loadu(x + i), vtop), vt), floor), zero);
        vf_storeu(w + i, vf_select_gt(e, floor, vf_exp(e), zero));
    }
    for (; i < n; i++) {
        const float e = fminf(fmaxf((x[i] - top) / t, lowest), 0.0f); /* fmaxf drops a NaN */
        w[i] = e > lowest ? expf(e) : 0.0f;
    }
}

/* the lanes of v (as bits, lane l at bit l) at least lo and below hi */
INLINE unsigned lanes_within(vf v, vf lo, vf hi) {
#if VLEN == 16
    return _mm512_cmp_ps_mask(v, lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(v, hi, _CMP_LT_OQ);
#else
    return (unsigned)_mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(v, lo, _CMP_GE_OQ), _mm256_cmp_ps(v, hi, _CMP_LT_OQ)));
#endif
}

/* a thread's scratch: a row's weights, the tokens gathered from a bin (and a copy), a row's block sums and one
 * block's weights for the draw, the histograms' copies; and the call's floor and block width */
typedef struct {
    float *w;
    cand_t *cands;
    double *sums, *within;
    float lowest;  /* the call's: the exponent floor */
    int64_t width; /* and the draw's block width */
    int32_t counts[COPIES][BINS];
    double masses[COPIES][BINS];
} scratch_t;

/* out[0, VLEN) = w[0, VLEN) as doubles */
INLINE void widen(const float *w, double *out) {
#if VLEN == 16
    _mm512_storeu_pd(out, _mm512_cvtps_pd(_mm256_loadu_ps(w)));
    _mm512_storeu_pd(out + 8, _mm512_cvtps_pd(_mm256_loadu_ps(w + 8)));
#else
    _mm256_storeu_pd(out, _mm256_cvtps_pd(_mm_loadu_ps(w)));
    _mm256_storeu_pd(out + 4, _mm256_cvtps_pd(_mm_loadu_ps(w + 4)));
#endif
}

/* count[b] and mass[b]: how many weights of w[0, n) have bits >> FIRST_SHIFT == b, and their sum (zeros: bin 0),
 * each only where asked for (inlined with constant asks: top-k alone needs no sums, top-p alone no counts) */
INLINE void histogram(const float *w, int64_t n, scratch_t *s, double *count, double *mass, const int counting,
                      const int weighing) {
    if (counting) memset(s->counts, 0, sizeof s->counts);
    if (weighing) memset(s->masses, 0, sizeof s->masses);
    int64_t zeros = 0, i = 0;
    const vf positive = vf_set1(FLT_MIN), past = vf_set1(INFINITY); /* (every weight but 0 is a normal float) */
    for (; i + VLEN <= n; i += VLEN) {
        if (!lanes_within(vf_loadu(w + i), positive, past)) { /* a vector of zeros (most of a peaked row): counted */
            zeros += VLEN;
            continue;
        }
        double wide[VLEN]; /* widened a vector at a time: a scalar widening waits on its register's last use */
        if (weighing) widen(w + i, wide);
        for (int l = 0; l < VLEN; l++) {
            const uint32_t b = bits_of(w[i + l]) >> FIRST_SHIFT;
            if (counting) s->counts[l % COPIES][b]++;
            if (weighing) s->masses[l % COPIES][b] += wide[l];
        }
    }
    for (; i < n; i++) {
        const uint32_t b = bits_of(w[i]) >> FIRST_SHIFT;
        if (counting) s->counts[0][b]++;
        if (weighing) s->masses[0][b] += w[i];
    }
    for (int b = 0; b < BINS; b++) {
        double c = 0, m = 0;
        for (int k = 0; k < COPIES; k++) {
            c += counting ? s->counts[k][b] : 0;
            m += weighing ? s->masses[k][b] : 0;
        }
        count[b] = c;
        mass[b] = m;
    }
    count[0] += (double)zeros;
}

/* the digit, heaviest first, of hist[0, digits) where the running weight reaches need - *above (at least a
 * float's least normal worth, so an empty digit is never chosen); *above grows by the weight of the digits before
 * it. Where it never does (rounding), the lightest digit holding anything, the whole of the rest counted above. */
static int crossing(const double *hist, int digits, double need, double *above) {
    const double still = fmax(need - *above, (double)FLT_MIN);
    double running = 0;
    int last = 0;
    for (int d = digits - 1; d >= 0; d--) {
        if (hist[d] == 0) continue;
        if (running + hist[d] >= still) {
            *above += running;
            return d;
        }
        running += hist[d];
        last = d;
    }
    *above += running - hist[last];
    return last;
}

/* the tokens of w[0, n) at least lo whose bits >> FIRST_SHIFT == bin, in column order, into c; how many. A vector
 * compare a turn, so the few tokens of a bin cost no mispredicted branch each (bits order non-negative floats) */
static int64_t gather(const float *w, int64_t n, uint32_t bin, float lo, cand_t *c) {
    const float from = fmaxf(float_of(bin << FIRST_SHIFT), lo), below = float_of((bin + 1) << FIRST_SHIFT);
    const vf vfrom = vf_set1(from), vbelow = vf_set1(below);
    int64_t m = 0, i = 0;
    for (; i + VLEN <= n; i += VLEN)
        for (unsigned lanes = lanes_within(vf_loadu(w + i), vfrom, vbelow); lanes; lanes &= lanes - 1) {
            const int64_t at = i + __builtin_ctz(lanes);
            c[m++] = (cand_t){bits_of(w[at]), (int32_t)at};
        }
    for (; i < n; i++)
        if (w[i] >= from && w[i] < below) c[m++] = (cand_t){bits_of(w[i]), (int32_t)i};
    return m;
}

/* the bits of the weight among c[0, *m) (tokens of one first-digit bin) where the running weight, heaviest first
 * (each token 1 by_count, else its weight), reaches need: two digits of DIGIT bits, each by a histogram of the
 * tokens still in question; *above grows by the weight of the tokens heavier than it, and c keeps the tokens tied
 * at it, in column order (*m of them) */
static uint32_t refine(cand_t *c, int64_t *m, double need, int by_count, double *above) {
    uint32_t threshold = c[0].bits & ~((1u << FIRST_SHIFT) - 1);
    double hist[1 << DIGIT];
    for (int shift = FIRST_SHIFT - DIGIT; shift >= 0; shift -= DIGIT) {
        memset(hist, 0, sizeof hist);
        for (int64_t j = 0; j < *m; j++)
            hist[(c[j].bits >> shift) & ((1u << DIGIT) - 1)] += by_count ? 1.0 : (double)float_of(c[j].bits);
        const uint32_t d = (uint32_t)crossing(hist, 1 << DIGIT, need, above);
        int64_t kept = 0;
        for (int64_t j = 0; j < *m; j++)
            if (((c[j].bits >> shift) & ((1u << DIGIT) - 1)) == d) c[kept++] = c[j];
        *m = kept;
        threshold |= d << shift;
    }
    return threshold;
}

/* what a row keeps: weights w >= lo and w > strict, and the tokens tied at `strict` up to column last_tie */
typedef struct {
    float lo, strict;
    int64_t last_tie;
} keep_t;

INLINE float kept(const float *w, int64_t i, keep_t k) {
    return w[i] >= k.lo && (w[i] > k.strict || (w[i] == k.strict && i <= k.last_tie)) ? w[i] : 0.0f;
}

/* the index whose share of the running sum of s[0, n) (non-negative) holds u times their total; never one of weight 0:
 * rounding past the end takes the last positive one; -1 where nothing weighs */
static int64_t pick(const double *s, int64_t n, double u) {
    double total = 0;
    for (int64_t i = 0; i < n; i++) total += s[i];
    if (!(total > 0)) return -1;
    /* rounded to float32 as the reference's u * total is: where the sums are exact (equal weights, as a grammar's
     * allowed tokens may be) both then land on the same side of every boundary */
    const double target = (double)(u * (float)total);
    double running = 0;
    int64_t last = -1;
    for (int64_t i = 0; i < n; i++) {
        if (s[i] <= 0) continue;
        running += s[i];
        last = i;
        if (running > target) return i;
    }
    return last;
}

/* the token drawn from w[0, n) as k keeps it, with uniforms u0 (the block of `width` tokens) and u1 (the token in
 * it); sums: room for a sum per block, within: for one block's weights */
static int64_t draw(const float *w, int64_t n, int64_t width, keep_t k, const cand_t *ties, int64_t n_ties, float u0,
                    float u1, double *sums, double *within) {
    if (n <= width) { /* one block: the first uniform picks the token */
        for (int64_t i = 0; i < n; i++) within[i] = kept(w, i, k);
        const int64_t at = pick(within, n, u0);
        return at < 0 ? 0 : at;
    }
    const int64_t blocks = (n + width - 1) / width;
    const vf lo = vf_set1(k.lo), strict = vf_set1(k.strict), zero = vf_zero();
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t first = b * width, end = first + width < n ? first + width : n;
        vf acc = vf_zero();
        int64_t i = first;
        for (; i + VLEN <= end; i += VLEN) { /* the weights above both bounds (ties at `strict` added below) */
            const vf v = vf_loadu(w + i);
            acc = vf_add(acc, vf_select_gt(v, strict, vf_select_gt(lo, v, zero, v), zero));
        }
        double sum = vf_sum(acc);
        for (; i < end; i++) sum += w[i] >= k.lo && w[i] > k.strict ? w[i] : 0.0f;
        sums[b] = sum;
    }
    for (int64_t j = 0; j < n_ties && ties[j].index <= k.last_tie; j++)
        if (k.strict >= k.lo) sums[ties[j].index / width] += k.strict;
    const int64_t block = pick(sums, blocks, u0);
    if (block < 0) return 0; /* nothing weighs (every logit -inf): the first token, as the reference draws */
    const int64_t first = block * width, count = first + width < n ? width : n - first;
    for (int64_t i = 0; i < count; i++) within[i] = kept(w, first + i, k);
    const int64_t at = pick(within, count, u1);
    return first + (at < 0 ? 0 : at);
}

/* row x[0, n)'s token */
static int64_t sample_row(const float *x, int64_t n, float t, int64_t top_k, float top_p, float min_p, float u0,
                          float u1, scratch_t *scratch) {
    if (!(t > 0)) return kunlun_row_argmax(x, n);
    float *const w = scratch->w;
    weigh(x, n, row_max(x, n), fminf(t, FLT_MAX), scratch->lowest, w);
    keep_t k = {0.0f, -1.0f, -1};
    const int by_k = top_k > 0 && top_k < n, by_p = top_p < 1;
    /* the tokens of top-k's crossing bin (gathered), then those still in question (ties): halves of the scratch */
    cand_t *const gathered = scratch->cands, *const ties = scratch->cands + n;
    int64_t n_gathered = 0, n_ties = 0;
    if (by_k || by_p) {
        double count[BINS], mass[BINS], total = 0, above = 0;
        if (by_k && by_p)
            histogram(w, n, scratch, count, mass, 1, 1);
        else if (by_k)
            histogram(w, n, scratch, count, mass, 1, 0);
        else
            histogram(w, n, scratch, count, mass, 0, 1);
        for (int b = 0; b < BINS; b++) total += mass[b];
        int bin_k = 0;
        if (by_k) { /* the k-th heaviest weight; bin 0 holds the zeros: then every token stays */
            bin_k = crossing(count, BINS, (double)top_k, &above);
            if (bin_k > 0) {
                n_gathered = gather(w, n, (uint32_t)bin_k, 0.0f, gathered);
                int64_t left = n_gathered;
                memcpy(ties, gathered, (size_t)n_gathered * sizeof *ties);
                k.lo = float_of(refine(ties, &left, (double)top_k, 1, &above));
                /* top-p measures against the mass top-k keeps: the bins past bin_k, and its tokens from k.lo up */
                mass[bin_k] = 0;
                for (int64_t j = 0; j < n_gathered; j++)
                    if (float_of(gathered[j].bits) >= k.lo) mass[bin_k] += float_of(gathered[j].bits);
                total = 0;
                for (int b = 0; b < BINS; b++) {
                    if (b < bin_k) mass[b] = 0;
                    total += mass[b];
                }
            }
        }
        const double need = (double)(top_p * (float)total); /* rounded as the reference's float32 product is */
        if (by_p && need < total) {
            above = 0;
            const int bin_p = crossing(mass, BINS, need, &above);
            if (bin_p > 0) {
                int64_t m = 0;
                if (bin_k > 0 && bin_p == bin_k) { /* its tokens are gathered already: those top-k keeps */
                    for (int64_t j = 0; j < n_gathered; j++)
                        if (float_of(gathered[j].bits) >= k.lo) ties[m++] = gathered[j];
                } else {
                    m = gather(w, n, (uint32_t)bin_p, k.lo, ties);
                }
                const float t_p = float_of(refine(ties, &m, need, 0, &above));
                /* of the tokens tied at t_p, as many as the mass still short of need asks for (at least one) */
                const double wanted = fmax(ceil((need - above) / (double)t_p), 1.0);
                n_ties = m;
                k.strict = t_p;
                k.last_tie = ties[(int64_t)fmin(wanted, (double)m) - 1].index;
            }
        }
    }
    if (min_p > 0) k.lo = fmaxf(k.lo, min_p); /* min_p times the heaviest weight, exp(0) = 1 */
    return draw(w, n, scratch->width, k, ties, n_ties, u0, u1, scratch->sums, scratch->within);
}

/* out[r] = the token of logits[r * stride, r * stride + vocab) (float32), r < rows, with temperature[r] (0:
 * greedy), top_k[r] (0: off), top_p[r] (1: off), min_p[r] (0: off) and uniforms[2 r], [2 r + 1] in [0, 1); weights
 * whose exponent is at or below `lowest` are 0, and the draw's blocks are `width` tokens (>= 1) wide. vocab < 2^31.
 * 0 on success, -1 where scratch memory could not be had. */
int kunlun_sample_tokens(const float *logits, int64_t stride, int64_t rows, int64_t vocab, const float *temperature,
                         const int64_t *top_k, const float *top_p, const float *min_p, const float *uniforms,
                         float lowest, int64_t width, int64_t *out) {
    int failed = 0;
#pragma omp parallel if (rows >= 2) reduction(| : failed)
    {
        scratch_t *scratch = malloc(sizeof *scratch);
        if (scratch != NULL) {
            scratch->w = malloc((size_t)vocab * sizeof *scratch->w);
            scratch->cands = malloc((size_t)vocab * 2 * sizeof *scratch->cands);
            scratch->sums = malloc((size_t)((vocab + width - 1) / width) * sizeof *scratch->sums);
            scratch->within = malloc((size_t)width * sizeof *scratch->within);
            scratch->lowest = lowest;
            scratch->width = width;
        }
        const int ready = scratch != NULL && scratch->w != NULL && scratch->cands != NULL && scratch->sums != NULL
                          && scratch->within != NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            if (!ready && temperature[r] > 0) {
                failed = 1;
                continue;
            }
            out[r] = sample_row(logits + r * stride, vocab, temperature[r], top_k[r], top_p[r], min_p[r],
                                uniforms[2 * r], uniforms[2 * r + 1], scratch);
        }
        if (scratch != NULL) {
            free(scratch->w);
            free(scratch->cands);
            free(scratch->sums);
            free(scratch->within);
            free(scratch);
        }
    }
    return failed ? -1 : 0;
}
