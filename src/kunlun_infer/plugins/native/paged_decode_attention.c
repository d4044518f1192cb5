/*
 * Decode attention straight from the paged KV cache: one query token per sequence, no gathered copy.
 *
 * Built for every kernel set by cpu_native.py (vectors of simd.h; with bf16 caches both products through VDPBF16PS
 * where the set has AVX512-BF16: see BF16_PAIRS). One work item is (sequence, KV head): the Hq / Hk query heads that
 * share the KV head are scaled and held in float32; each cached key is read once from its block (through
 * the block table) and scored against all of them, VLEN keys at a time (bf16 keys widened once per block where
 * there is no VDPBF16PS); a float32 softmax per query head (max, exp, sum) is followed by one pass over the
 * cached values. K/V may be bf16 or float32; arithmetic is float32. Where the sequences alone would leave threads
 * idle (one long sequence, many cores), or a context's rows outgrow half of L2, each context is split into parts,
 * items of their own, whose unnormalised sums are merged after (Zen 4, 2 threads, one sequence of 4096 tokens with
 * one KV head: 0.51-0.55x the time of one thread doing it).
 *
 * A thread takes the items of a sequence's KV heads one after another (see split_work): a token's rows of all its KV
 * heads lie side by side in a block, and memory delivers the lines of the other heads beside those read, so the next
 * head's item finds them in cache, where another thread's item had read them from memory again. Scattered 4 KiB
 * blocks on the Xeon with AMX (2 threads) read at 22 GB/s whole, and at 11 GB/s of the bytes used where every other
 * 128 bytes are read (one head of two). kernel_builds.py --work decode-attention there (14 / 2 heads of 64, 24 layers
 * each with a cache of its own, blocks scattered; in turns, an A/A control of 0.93-1.05): 8 x 1024 and 32 x 1024
 * tokens 0.87-0.88x the time in bf16 (on the tiles), 0.80-0.81x in float32, 0.85-0.86x on the avx2 set; 1 x 4096
 * 0.85-0.90x (two parts, both heads in each, rather than one head a thread). In the engine (blocks mostly in order),
 * a 32-row decode step at ~1000 tokens: bf16 93.8-96.6 -> 88.6-93.8 ms, float32 212.0-219.4 -> 199.9-213.7.
 *
 * Even so, a sequence's first KV head waited on memory while the second ran from L2 and memory waited: the step's
 * compute and its reads took turns (the Xeon with AMX, 32 x 1000 tokens in bf16: ~15 ms of work with every context in
 * L2, ~18 ms to read the contexts at 22 GB/s, ~31 ms in all). With AVX-512 and enough items a thread, each thread
 * now claims its next item as it starts one and asks for that item's rows while it works (next_rows), in parts of
 * an eighth of L2 so that both fit. The Xeon with AMX, in turns against the code before (blocks in order, as the
 * engine's): bf16 on the tiles 0.83-0.86x the time at 32 x 1000, 0.79-0.80x at 8 x 2000, 0.92-0.94x at 1 x 4096
 * (scattered blocks 0.97x); in the engine a 32-row bf16 step at ~1000 tokens 89.4-92.3 -> 80.9-83.7 ms, 8 rows at
 * ~2000 tokens 67.1-67.7 -> 59.9-61.5. The Zen 5 (AVX-512, no tiles), blocks in order: bf16 0.83-0.87x at
 * 32 x 1024, 0.80-0.93x at 8 x 1024; float32 0.74-0.85x and 0.77-0.80x.
 */
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

/* A pass over the values (weighted_values) holds in registers the sums of up to VALUE_GROUP_OF(bf16) query heads of
 * one KV head by as many VLEN-feature chunks as VALUE_ACCS sums allow (value_pass: a power of two, at most
 * MAX_VALUE_CHUNKS): with AVX-512 16 of the 32 registers, 8 heads by 2 chunks; with AVX2 12 of the 16, the rest
 * holding a chunk of values (a pair and a zero to widen them with bf16) and the heads' probabilities. Each pass
 * reads every token's value row once, and the fewer the passes, the fewer the reads and broadcasts; the more sums,
 * the more chains of FMAs in flight. With AVX2 a KV head of 7 query
 * heads (head size 64) takes, in bf16, 6 heads by 2 chunks then 1 by 8 (5 passes), and in float32 4 by 2 then 3 by 4
 * (6 passes), where 4 by 2 then 3 by 2 had taken 8 (and 8 by 1 on Zen 4, 0.82-0.90x the time of that, before). The Zen
 * 5 capped to avx2, kernel_builds.py --work decode-attention in turns, bit for bit the same: bf16 0.92-0.97x the time
 * (four runs, blocks scattered, and every layer over one warm cache), float32 0.93-0.97x (two runs); in bf16 4 heads
 * first 1.05x, 5 first (then 2 by 4) 1.01-1.10x of 6 first, in float32 6 first 1.01-1.07x. */
#define VALUE_GROUP_OF(bf16) (VLEN == 16 ? 8 : (bf16) ? 6 : 4)
#define VALUE_ACCS (VLEN == 16 ? 16 : 12)
#define MAX_VALUE_CHUNKS (VLEN == 16 ? 2 : 8)
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
 * several passes, which had each read it from the second level again (Zen 4, in turns, 0.80-0.92x the time for 1 x 4096
 * tokens, 0.92-0.97x for 8 x 1024; within the host's noise with AVX-512, whose two passes read a line each) */
#define VALUES_TILE 64
/* tokens of a pass over the values between two asks for the next item's rows (next_rows): each ask a few lines more,
 * a quarter as often as every 4 tokens. The Zen 5 (AVX-512 BF16), kernel_builds.py in turns, two or three runs, A/A
 * 0.95-1.03: bf16 caches with blocks scattered 0.90-0.92x the time at 8 and 32 x 1024 tokens, 0.95-1.00x at 8 x 256,
 * 0.97x at 1 x 4096; in order 0.93-1.05x; float32 caches within the noise (0.91-1.09x) */
#define VALUES_ASK_TOKENS 16
/* the fewest tokens of a context split among threads, and the most parts it is split into */
#define PART_TOKENS 256
#define MAX_PARTS 256
/* Where the split within half of L2 gives every thread PIPELINE_ITEMS items or more, the parts shrink until each
 * one's rows of every KV head fit 1 / PIPELINE_SHARE of L2, and a thread asks for the rows of the item it takes next
 * while it works on one (see next_rows). With AVX-512, and with AVX2 for float32 caches: with AVX2 a bf16 cache's
 * work a key, not memory, bounds it (the Xeon with AMX capped to avx2, in turns: bf16 1.00x the time at 32 x 1000
 * tokens, 1.06-1.13x at 8 x 256 and 1 x 4096; float32 0.96-0.98x at 8-32 x 1000-2000), where a float32 cache, with
 * twice the bytes a key, waits on memory: the Zen 5 capped to avx2 took 11.1 ms at 8 x 1024 tokens cold against 5.5
 * over a warm cache. There, in turns (two runs): float32 0.63-0.66x the time at 32 x 1024, 0.73-0.79x at 8 x 1024,
 * 0.76-0.85x at 1 x 4096, 0.91-0.96x at 8 x 256; bf16 0.95-1.08x. */
#define PIPELINE_SHARE 8
#define PIPELINE_ITEMS 4
#define PIPELINING(bf16) (VLEN == 16 || !(bf16))

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

/*
 * The K and V lines of the item a thread takes next, asked for into L2 a share at a time while it works on the item
 * before: every line of the next item's tokens' rows of all KV heads, block by block, spread evenly over the `calls`
 * calls of ask_next that the item before makes. A step's items then find their rows in L2, and memory streams the
 * next one's meanwhile: where each item asked only for its own rows a little ahead, memory waited while a
 * sequence's second KV head ran from L2, and the first waited on memory. A software ask holds one of the core's few
 * first-level miss buffers until memory answers, so the asks go one or two at a time between the kernel's steps,
 * not in bursts.
 */
typedef struct {
    const char *k, *v;
    const int32_t *table; /* the next item's block table; NULL: nothing to ask for */
    int64_t block_size, token_bytes, hi;
    int64_t block, off, end;      /* bytes [off, end) of the table's block `block` are still to be asked for */
    int64_t lines, calls, credit; /* lines (of K, and as many of V) in all, and their spread over the calls */
} next_rows;

/* Start asking for tokens [lo, hi) (lo < hi) of the item with block table `table`, over `calls` calls. */
INLINE void next_rows_start(next_rows *n, const int32_t *table, int64_t lo, int64_t hi, int64_t calls) {
    const int64_t first_end = (lo / n->block_size + 1) * n->block_size;
    n->table = table;
    n->hi = hi;
    n->block = lo / n->block_size;
    n->off = (lo - n->block * n->block_size) * n->token_bytes;
    n->end = ((hi < first_end ? hi : first_end) - n->block * n->block_size) * n->token_bytes;
    n->lines = ((hi - lo) * n->token_bytes + 63) / 64;
    n->calls = calls > 0 ? calls : 1;
    n->credit = 0;
}

/* this call's share of the next item's lines, one line of K and one of V at a time (none with `n` NULL, where the
 * split is not pipelined: the kernels' loops are built without asks then) */
INLINE void ask_next(next_rows *n) {
    if (n == NULL || n->table == NULL) return;
    for (n->credit += n->lines; n->credit >= n->calls && n->off < n->end; n->credit -= n->calls) {
        const int64_t at = (int64_t)n->table[n->block] * n->block_size * n->token_bytes + n->off;
        _mm_prefetch(n->k + at, _MM_HINT_T1);
        _mm_prefetch(n->v + at, _MM_HINT_T1);
        n->off += 64;
        if (n->off >= n->end) {  /* the next block, if any tokens are left */
            n->block++;
            const int64_t left = n->hi - n->block * n->block_size;
            n->off = 0;
            n->end = (left < n->block_size ? (left > 0 ? left : 0) : n->block_size) * n->token_bytes;
        }
    }
}

/* The accumulators of one pass below, held in registers: the head and chunk counts are constants here. Tokens
 * [t0, t1) of `len`; the sums start from `sums` (float32, laid out as out) unless t0 is 0, and go to `sums` unless
 * t1 is len, where they are written to out. A token's value row is taken a chunk (or a bf16 pair of chunks) at a
 * time, each multiplied into every head's sums before the next is loaded, so that a pass of one head by 8 chunks
 * holds 8 sums and 2 values, not 8 and 8 (AVX2 has 16 registers: the whole row at once had GCC keep the sums in
 * memory, and every FMA waited on a store; Zen 5 capped to avx2, in turns, 0.96-1.02x the time of that order in
 * bf16, 0.95-0.98x in float32, bit for bit the same). */
INLINE void weighted_values_fixed(const void *v_cache, const int64_t *rows, const float *p, int64_t len,
                                  int64_t t0, int64_t t1, float *sums, int64_t feature, void *out, int64_t at,
                                  int64_t d, const int heads, const int nchunks, const int bf16, const int ask,
                                  const int obf16, next_rows *nx) {
    const int paired = PAIRED && bf16 && nchunks % 2 == 0;
    vf acc[VALUE_GROUP_OF(1)][MAX_VALUE_CHUNKS]; /* bf16's group is the larger */
    UNROLL for (int g = 0; g < heads; g++)
        UNROLL for (int c = 0; c < nchunks; c++)
            acc[g][c] = t0 == 0 ? vf_zero() : vf_loadu(sums + g * d + feature + VLEN * c);
    for (int64_t t = t0; t < t1; t++) {
        if (ask && t + VALUES_AHEAD < len) ask_row(v_cache, rows[t + VALUES_AHEAD], d, bf16);  /* the first pass */
        if ((t - t0) % VALUES_ASK_TOKENS == 0) ask_next(nx);
        if (paired) {
            UNROLL for (int c = 0; c < nchunks; c += 2) {
                vf lo, hi;
                vf_load_bf16_pair((const uint16_t *)v_cache + rows[t] + feature + VLEN * c, &lo, &hi);
                UNROLL for (int g = 0; g < heads; g++) {
                    const vf weight = vf_set1(p[g * len + t]);
                    acc[g][c] = vf_fma(weight, lo, acc[g][c]);
                    acc[g][c + 1] = vf_fma(weight, hi, acc[g][c + 1]);
                }
            }
        } else {
            UNROLL for (int c = 0; c < nchunks; c++) {
                const vf v = load_vec(v_cache, rows[t] + feature + VLEN * c, bf16);
                UNROLL for (int g = 0; g < heads; g++) acc[g][c] = vf_fma(vf_set1(p[g * len + t]), v, acc[g][c]);
            }
        }
    }
    if (paired && t1 == len)
        UNROLL for (int g = 0; g < heads; g++)
            UNROLL for (int c = 0; c < nchunks; c += 2) vf_unpair(&acc[g][c], &acc[g][c + 1]);
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

#define VALUES_CASE(H, C)                                                                                             \
    case (H) * 16 + (C):                                                                                              \
        weighted_values_fixed(v_cache, rows, p, len, t0, t1, sums, feature, out, at, d, H, C, bf16, ask, obf16, nx);  \
        break;

/* out[at + g * d + f] = sum_t p[g * len + t] * V[t][feature + f] for g < heads, f < nchunks * VLEN, over tokens
 * [t0, t1) (see weighted_values_fixed). The cases are every shape value_pass gives with these constants: a build whose
 * constants give another stops here rather than leave the outputs unwritten. */
INLINE void weighted_values(const void *v_cache, const int64_t *rows, const float *p, int64_t len, int64_t t0,
                            int64_t t1, float *sums, int64_t feature, void *out, int64_t at, int64_t d, int64_t heads,
                            int64_t nchunks, const int bf16, const int ask, const int obf16, next_rows *nx) {
    switch (heads * 16 + nchunks) {
#if VLEN == 16
        VALUES_CASE(1, 1) VALUES_CASE(2, 1) VALUES_CASE(3, 1) VALUES_CASE(4, 1)
        VALUES_CASE(5, 1) VALUES_CASE(6, 1) VALUES_CASE(7, 1) VALUES_CASE(8, 1)
        VALUES_CASE(1, 2) VALUES_CASE(2, 2) VALUES_CASE(3, 2) VALUES_CASE(4, 2)
        VALUES_CASE(5, 2) VALUES_CASE(6, 2) VALUES_CASE(7, 2) VALUES_CASE(8, 2)
#else
        VALUES_CASE(1, 1) VALUES_CASE(2, 1) VALUES_CASE(3, 1) VALUES_CASE(4, 1) VALUES_CASE(5, 1) VALUES_CASE(6, 1)
        VALUES_CASE(1, 2) VALUES_CASE(2, 2) VALUES_CASE(3, 2) VALUES_CASE(4, 2) VALUES_CASE(5, 2) VALUES_CASE(6, 2)
        VALUES_CASE(1, 4) VALUES_CASE(2, 4) VALUES_CASE(3, 4) VALUES_CASE(1, 8)
#endif
        default: abort();
    }
}

/* The chunks of VLEN features that a pass over the values takes for `heads` query heads, from chunk c of `chunks`:
 * as many as the registers hold sums for (VALUE_ACCS), a power of two, no more than are left. */
INLINE int64_t value_pass(int64_t heads, int64_t c, int64_t chunks) {
    int64_t n = 1;
    while (n * 2 <= MAX_VALUE_CHUNKS && heads * n * 2 <= VALUE_ACCS && n * 2 <= chunks - c) n *= 2;
    return n;
}

/* the passes over the values of one item's `group` query heads, head size d (what one_head_asks counts) */
INLINE int64_t value_passes(int64_t group, int64_t d, const int bf16) {
    const int64_t most = VALUE_GROUP_OF(bf16);
    int64_t passes = 0;
    for (int64_t g0 = 0; g0 < group; g0 += most)
        for (int64_t c = 0, gn = group - g0 < most ? group - g0 : most; c < d / VLEN;
             c += value_pass(gn, c, d / VLEN))
            passes++;
    return passes;
}

#if defined(__AVX512BF16__)
/*
 * bf16 caches with AVX512-BF16 (head size a multiple of 32) take both products through VDPBF16PS, which multiplies
 * pairs of bf16 values into float32 sums, and their softmax in base 2:
 * - the outputs: two tokens' value rows interleaved (VPUNPCKLWD / VPUNPCKHWD: each feature's two values a lane) against
 *   the two tokens' probabilities, rounded to bf16 and broadcast as one pair: half the multiplies of float32 FMAs, and
 *   no widening of the values. The probabilities are rounded as the tile kernels round them (their sums stay float32,
 *   and the outputs are divided by them as they are written, in place of a pass over the probabilities);
 * - the softmax: the scores in units of log2 e, their exponentials by pow2_probability (9 instructions where vf_exp
 *   takes 17), each head's max, then its exponentials, sum and bf16 pairs, in two passes rather than three;
 * - the scores, where a KV head has TRANSPOSED_MIN_GROUP query heads or more: 16 keys' rows transposed (two bf16
 *   features a 32-bit lane, one key a lane: transpose16_epi32), so that one VDPBF16PS of a pair of features against a
 *   query's pair broadcast adds to all 16 keys' scores at once, and no horizontal sum is left per key and head. The
 *   transpose is shared by the query heads and pays from 7 of them; with fewer, each key's sums across lanes are as
 *   fast or faster (Zen 5, every layer over one warm cache, in turns: 4 query heads a KV head 1.04-1.06x the time of
 *   the sums across lanes, 5 1.02-1.04x, 6 0.98-1.02x, 7 0.96-0.98x, 8 0.93-0.98x, 16 0.88-0.90x).
 * kernel_builds.py --work decode-attention on the Zen 5 (2 threads, 24 layers each with a cache of its own, in turns
 * against the code before, run twice as A/A; decode_attention_bf16_pairs_zen5.json), the 0.5B model's heads (7 a KV
 * head), blocks in order: 0.78-0.82x the time at 8 x 256 tokens (A/A 0.93-0.99), 0.86-0.88x at 8 x 1024, 0.90-0.91x at
 * 32 x 1024 (0.98-0.99), 0.87-0.93x at 1 x 4096, one KV head of 8 at 4096 tokens 0.78-0.81x; blocks scattered
 * 0.89-0.98x (A/A 0.96-1.02); every layer over one warm cache 0.75-0.87x.
 */
#define BF16_PAIRS 1
/* query heads whose scores transposed_scores takes at once, and whose sums paired_values holds: a pass's (8) */
#define MAX_GROUP VALUE_GROUP_OF(1)
#define TRANSPOSED_MIN_GROUP 7

/* The 16 keys' rows at key[] (bf16, d features) as feature pairs [d / 2][16 keys] at kt */
INLINE void transposed_keys(const uint16_t *k_cache, const int64_t *key, int64_t d, uint32_t *kt) {
    for (int64_t c = 0; c < d; c += 32) {
        __m512i r[16];
        UNROLL for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(k_cache + key[i] + c);
        transpose16_epi32(r);
        UNROLL for (int j = 0; j < 16; j++) _mm512_storeu_si512(kt + (c / 2 + j) * 16, r[j]);
    }
}

/* scores[g * len + t0 ..] (tn of them) of query heads g < heads (their bf16 rows `d` apart from qg) against the
 * transposed keys kt: two sums a head, the even pairs' and the odd ones', so that twice the chains are in flight */
INLINE void transposed_scores_fixed(const uint16_t *qg, const uint32_t *kt, int64_t d, float scale, float *scores,
                                    int64_t len, int64_t t0, int64_t tn, const int heads) {
    __m512 acc[MAX_GROUP][2];
    UNROLL for (int g = 0; g < heads; g++) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < d / 2; p += 2) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * 16);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + p * 16 + 16);
        UNROLL for (int g = 0; g < heads; g++) {
            const uint32_t *qd = (const uint32_t *)(qg + g * d);
            acc[g][0] = _mm512_dpbf16_ps(acc[g][0], k0, (__m512bh)_mm512_set1_epi32((int)qd[p]));
            acc[g][1] = _mm512_dpbf16_ps(acc[g][1], k1, (__m512bh)_mm512_set1_epi32((int)qd[p + 1]));
        }
    }
    UNROLL for (int g = 0; g < heads; g++)
        vf_store_n(scores + g * len, t0, _mm512_mul_ps(_mm512_add_ps(acc[g][0], acc[g][1]), _mm512_set1_ps(scale)),
                   tn, 0);
}

#define SCORES_CASE(H)                                                                                                \
    case H:                                                                                                           \
        transposed_scores_fixed(qg, kt, d, scale, scores, len, t0, tn, H);                                            \
        break;

INLINE void transposed_scores(const uint16_t *qg, const uint32_t *kt, int64_t d, float scale, float *scores,
                              int64_t len, int64_t t0, int64_t tn, int64_t heads) {
    switch (heads) { SCORES_CASE(1) SCORES_CASE(2) SCORES_CASE(3) SCORES_CASE(4) SCORES_CASE(5) SCORES_CASE(6)
                     SCORES_CASE(7) SCORES_CASE(8) }
}

/* The softmax of the pairs' path, in base 2 (the scores are in units of log2 e): each query head's e^(score - top) as
 * bf16, in place of its float32 scores [group][len] at s, head g's at (uint16_t *)(s + g * len), with a zero after an
 * odd count, so that tokens t and t + 1 (t even) are the 32-bit pair t / 2. The exponentials' float32 sums give
 * norms[g], what the outputs are multiplied by as they are written: 1 / sum, or 1 for a part, whose top (in natural
 * units, as merge_parts reads it) and sum go to `part` as one_head's do. */
INLINE void pair_probabilities(float *s, int64_t group, int64_t len, int64_t d, float *part, float *norms) {
    for (int64_t g = 0; g < group; g++) {
        float *row = s + g * len;
        __m512 vmax = _mm512_set1_ps(-3.0e38f);
        for (int64_t t = 0; t < len; t += 16) {
            const __mmask16 m = tail_mask(len - t);
            vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, row + t));
        }
        const float top = _mm512_reduce_max_ps(vmax);
        const __m512 vtop = _mm512_set1_ps(top);
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; t += 32) {
            const int64_t n = len - t < 32 ? len - t : 32, stored = n + (n & 1);
            const __m512 e0 = pow2_probability(_mm512_sub_ps(vf_load_n(row, t, n, 0), vtop));
            const __m512 e1 = pow2_probability(_mm512_sub_ps(vf_load_n(row, t + 16, n - 16, 0), vtop));
            const __m512 lo = _mm512_maskz_mov_ps(tail_mask(n), e0), hi = _mm512_maskz_mov_ps(tail_mask(n - 16), e1);
            vsum = _mm512_add_ps(vsum, _mm512_add_ps(lo, hi));
            _mm512_mask_storeu_epi16((uint16_t *)row + t, stored >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << stored) - 1),
                                     (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
        const float total = _mm512_reduce_add_ps(vsum);
        if (part != NULL) {
            part[group * d + g] = top * LN2;
            part[group * d + group + g] = total;
        }
        norms[g] = part != NULL ? 1.0f : 1.0f / total;
    }
}

/* The outputs of weighted_values for one line of values (32 features from `feature`) and heads (< 9) query heads,
 * two tokens at a time: their rows interleaved, VPUNPCKLWD giving features 8j .. 8j + 3 and VPUNPCKHWD 8j + 4 .. 8j + 7
 * of each 128-bit lane j; the sums stay in that order between calls (in `sums`) and are put back in feature order as
 * they are written out. `pairs`: head g's bf16 probabilities at pairs + g * len floats (probabilities_to_pairs). */
INLINE void paired_values_fixed(const uint16_t *v_cache, const int64_t *rows, const float *pairs, const float *norms,
                                int64_t len, int64_t t0, int64_t t1, float *sums, int64_t feature, void *out,
                                int64_t at, int64_t d, const int heads, const int ask, const int obf16,
                                next_rows *nx) {
    __m512 acc[MAX_GROUP][2];
    UNROLL for (int g = 0; g < heads; g++)
        UNROLL for (int c = 0; c < 2; c++)
            acc[g][c] = t0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + g * d + feature + 16 * c);
    for (int64_t t = t0; t < t1; t += 2) {
        if (ask && t + VALUES_AHEAD < len) ask_row(v_cache, rows[t + VALUES_AHEAD], d, 1);  /* the first pass */
        if (ask && t + 1 + VALUES_AHEAD < len) ask_row(v_cache, rows[t + 1 + VALUES_AHEAD], d, 1);
        if ((t - t0) % VALUES_ASK_TOKENS == 0) ask_next(nx);
        const __m512i a = _mm512_loadu_si512(v_cache + rows[t] + feature);
        const __m512i b = t + 1 < t1 ? _mm512_loadu_si512(v_cache + rows[t + 1] + feature) : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
        UNROLL for (int g = 0; g < heads; g++) {
            const __m512bh p = (__m512bh)_mm512_set1_epi32(((const int32_t *)(pairs + g * len))[t / 2]);
            acc[g][0] = _mm512_dpbf16_ps(acc[g][0], lo, p);
            acc[g][1] = _mm512_dpbf16_ps(acc[g][1], hi, p);
        }
    }
    /* feature f of the line: from the low unpack's lane 4 (f / 8) + f % 8 where f % 8 < 4, else the high one's */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    UNROLL for (int g = 0; g < heads; g++) {
        if (t1 < len) {
            UNROLL for (int c = 0; c < 2; c++) _mm512_storeu_ps(sums + g * d + feature + 16 * c, acc[g][c]);
            continue;
        }
        const __m512 norm = _mm512_set1_ps(norms[g]);
        const __m512 o[2] = {_mm512_mul_ps(_mm512_permutex2var_ps(acc[g][0], first, acc[g][1]), norm),
                             _mm512_mul_ps(_mm512_permutex2var_ps(acc[g][0], second, acc[g][1]), norm)};
        UNROLL for (int c = 0; c < 2; c++) {
            const int64_t i = at + g * d + 16 * c;
            if (obf16)
                vf_store_bf16((uint16_t *)out + i, o[c]);
            else
                _mm512_storeu_ps((float *)out + i, o[c]);
        }
    }
}

#define PAIRED_CASE(H)                                                                                                \
    case H:                                                                                                           \
        paired_values_fixed(v_cache, rows, pairs, norms, len, t0, t1, sums, feature, out, at, d, H, ask, obf16, nx);  \
        break;

INLINE void paired_values(const uint16_t *v_cache, const int64_t *rows, const float *pairs, const float *norms,
                          int64_t len, int64_t t0, int64_t t1, float *sums, int64_t feature, void *out, int64_t at,
                          int64_t d, int64_t heads, const int ask, const int obf16, next_rows *nx) {
    switch (heads) { PAIRED_CASE(1) PAIRED_CASE(2) PAIRED_CASE(3) PAIRED_CASE(4) PAIRED_CASE(5) PAIRED_CASE(6)
                     PAIRED_CASE(7) PAIRED_CASE(8) }
}
#else
#define BF16_PAIRS 0
#endif

/* Tokens [lo, hi) of part i of `parts` of a context of `len` (empty where a short context has no such part) */
INLINE void part_tokens(int64_t len, int64_t parts, int64_t i, int64_t *lo, int64_t *hi) {
    const int64_t each = (len + parts - 1) / parts;
    *lo = i * each < len ? i * each : len;
    *hi = *lo + each < len ? *lo + each : len;
}

/* where each cached token's K/V row of head h starts (elements), tokens [lo, hi) into rows[0 ..]: looked up once
 * per item (no division per token and pass) */
INLINE void token_rows(const int32_t *table, int64_t lo, int64_t hi, int64_t h, int64_t hk, int64_t d,
                       int64_t block_size, int64_t *rows) {
    for (int64_t t = lo; t < hi;) {
        const int64_t i = t / block_size, j0 = t - i * block_size;
        const int64_t first = ((int64_t)table[i] * block_size * hk + h) * d;
        for (int64_t j = j0; j < block_size && t < hi; j++, t++) rows[t - lo] = first + j * hk * d;
    }
}

/* The calls of ask_next that one_head makes for an item of `len` tokens: one per VLEN keys scored, and one per
 * VALUES_ASK_TOKENS tokens of each pass over the values. */
INLINE int64_t one_head_asks(int64_t len, int64_t d, int64_t group, const int bf16) {
    return (len + VLEN - 1) / VLEN +
           (len + VALUES_TILE - 1) / VALUES_TILE * (VALUES_TILE / VALUES_ASK_TOKENS) *
               value_passes(group, d, bf16);
}

/* One work item: the query heads of KV head h of sequence b over its cached tokens [lo, hi). With `part` NULL the
 * normalised outputs go to out (in the cache's dtype); else (a part of a context split among threads) the sums of
 * e^(score - top) * value go to part as float32 [group][d], followed by each head's top score and sum of
 * e^(score - top) (see merge_parts). With `ask_own` the item asks for its own rows ahead of it (else the item before
 * asked for them); it asks for a share of the next item's through `nx` as it goes. */
INLINE void one_head(const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int64_t lo,
                     int64_t hi, void *out, float *part, int64_t b, int64_t h, int64_t hq, int64_t hk, int64_t d,
                     int64_t block_size, float scale, float *work, int64_t *rows, const int bf16, const int ask_own,
                     next_rows *nx) {
    const int64_t group = hq / hk, chunks = d / VLEN, len = hi - lo;
    float *qf = work, *kf = work + group * d, *vsum = kf + VLEN * d, *norms = vsum + group * d, *scores = norms + group;
    token_rows(table, lo, hi, h, hk, d, block_size, rows);
    /* bf16 pairs through VDPBF16PS for both products, and the softmax in base 2 (pair_probabilities) */
    const int pairs = BF16_PAIRS && bf16 && d % 32 == 0;
#if BF16_PAIRS
    const float score_scale = pairs ? scale * LOG2E : scale;
#endif
    if (!pairs)  /* the pairs read the query heads' bf16 rows as they are */
        for (int64_t g = 0; g < group; g++) widen_row(q, (b * hq + h * group + g) * d, d, qf + g * d, bf16);
    /* scores: q . k for every cached key, VLEN keys at a time per query head (one transposing sum for VLEN dots) */
    for (int64_t t0 = 0; t0 < len; t0 += VLEN) {
        const int64_t tn = len - t0 < VLEN ? len - t0 : VLEN;
        /* the keys' rows AHEAD tokens on, scattered over the cache's blocks, are asked for now: the hardware
         * prefetchers do not follow them, and a step's cache is in no cache level by the next step */
        for (int64_t t = t0 == 0 ? 0 : t0 + AHEAD; ask_own && t < t0 + VLEN + AHEAD && t < len; t++)
            ask_row(k_cache, rows[t], d, bf16);
        ask_next(nx);
        /* the block's keys, past the context's end the last one again (those scores are not stored): a whole block
         * of sums in registers, where a loop to the block's length had kept them in memory (1.16-1.25x the time) */
        int64_t key[VLEN];
        UNROLL for (int i = 0; i < VLEN; i++) key[i] = rows[t0 + (i < tn ? i : tn - 1)];
#if BF16_PAIRS
        if (pairs && group >= TRANSPOSED_MIN_GROUP) {  /* keys a lane: see BF16_PAIRS */
            uint32_t *kt = (uint32_t *)kf;
            transposed_keys((const uint16_t *)k_cache, key, d, kt);
            const uint16_t *q0 = (const uint16_t *)q + (b * hq + h * group) * d;
            for (int64_t g0 = 0; g0 < group; g0 += MAX_GROUP)
                transposed_scores(q0 + g0 * d, kt, d, score_scale, scores + g0 * len, len, t0, tn,
                                  group - g0 < MAX_GROUP ? group - g0 : MAX_GROUP);
            continue;
        }
        if (pairs) {  /* bf16 pairs straight into VDPBF16PS, float32 sums */
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
                vf_store_n(scores + g * len, t0, vf_mul(vf_transpose_sum(dots), vf_set1(score_scale)), tn, 0);
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
#if BF16_PAIRS
    if (pairs)
        pair_probabilities(scores, group, len, d, part, norms);
    else
#endif
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
    /* out = probabilities @ values, the passes of value_pass over each group of query heads, the tokens VALUES_TILE
     * at a time so that their value rows stay in the first-level cache over every pass */
    for (int64_t t0 = 0; t0 < len; t0 += VALUES_TILE) {
        const int64_t t1 = len - t0 < VALUES_TILE ? len : t0 + VALUES_TILE;
        for (int64_t g0 = 0; g0 < group; g0 += VALUE_GROUP_OF(bf16)) {
            const int64_t gn = group - g0 < VALUE_GROUP_OF(bf16) ? group - g0 : VALUE_GROUP_OF(bf16);
            for (int64_t c = 0, n; c < chunks; c += n) {
                n = value_pass(gn, c, chunks);
                const int64_t at = (part != NULL ? g0 * d : (b * hq + h * group + g0) * d) + VLEN * c;
                const float *p = scores + g0 * len;
                float *sums = vsum + g0 * d;
                void *dst = part != NULL ? (void *)part : out;
                const int ask = ask_own && c == 0 && g0 == 0, obf16 = part == NULL && bf16;
#if BF16_PAIRS
                if (pairs) {  /* 2 * VLEN features: one line of bf16 values, tokens in pairs */
                    paired_values((const uint16_t *)v_cache, rows, p, norms + g0, len, t0, t1, sums, VLEN * c, dst,
                                  at, d, gn, ask, obf16, nx);
                    continue;
                }
#endif
                weighted_values(v_cache, rows, p, len, t0, t1, sums, VLEN * c, dst, at, d, gn, n, bf16, ask, obf16,
                                nx);
            }
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

#if defined(__AMX_TILE__)
#include "amx.h"
#define DECODE_TILES 1
/*
 * Decode attention on the AMX tiles (bf16, head size a multiple of 32, TILES_MIN_GROUP query heads a KV head or
 * more: kunlun_decode_attention_on_tiles). One work item as one_head's, its query heads the lanes of a tile (16 at a
 * time, each tile of lanes a pass over the item's keys and values):
 * - the scores S^T = K Q^T: 16 keys' rows as an A tile, loaded in place from the cache where the 16 are hk_stride
 *   apart (one block), else gathered; the queries' bf16 pairs [d / 2][16] as B tiles; 64 keys a turn in four sum
 *   tiles, so that four chains of products are in flight;
 * - the softmax over keys, one vector of 16 lanes a key, in base 2 (pow2_probability), its probabilities rounded to
 *   bf16 for the product with the values, as the prompt kernels round them (the sums are of the float32 ones);
 * - the outputs O = P V: 32 keys' probabilities as an A tile (a lane's row: 16 pairs of keys, by one 16 x 16
 *   transpose), the values as B tiles of pairs of keys [16][16 features] (two rows interleaved, built a turn before
 *   the tiles load them), 64 features a pass over the values in four sum tiles.
 * The scores' pass asks for the K and V rows AHEAD tokens on; the values' passes find them in L2. Tiles: 0-3 sums
 * (of the scores, then of the outputs), 4-5 A operands, 6 B operands; every one 16 rows of 64 bytes
 * (amx_configure(16, 16)).
 * The Xeon with AMX (2 threads, 14 / 2 heads of 64, 24 layers each with a cache of its own, in turns against the
 * vector kernel, kernel_builds.py --work decode-attention, two runs whose A/A control read 0.90-1.07): 8 x 256 tokens
 * 0.71-0.92x the time, 8 x 1024 and 32 x 1024 0.71-0.75x, 1 x 4096 0.82-0.88x, one KV head of 8 at 4096 0.75-0.82x;
 * in the engine, a 32-row bf16 decode step at ~1000 tokens of context 0.96x, at ~200 0.97x. With the context in L2,
 * one core: 54-56 cycles per (key, KV head) against 93-96; a third of them the asks for the rows ahead, which cost
 * an instruction a line even where it is cached, but without which a cold context (every step's) took 1.13-1.22x
 * the time (1.03x for one sequence of 4096 tokens). Asking
 * for only the K rows, or for one line of each row, took 1.03-1.24x; the asks 32-256 tokens ahead, or into L3, all
 * the same; the next item's first 128 tokens asked while the values run (the items claimed one ahead), 0.93-0.97x
 * with an A/A control of 0.96-0.98, not kept.
 */
#define TILE_LANES 16
#define TILE_PAIR_KEYS 32 /* keys an A tile of probabilities covers */

/* the thread's scratch for items of up to `span` keys, head size d: the scores [keys][16], the probabilities as A
 * tiles [keys / 32][16 lanes][32], four tiles' gathered keys [4][16][d], the queries' pairs [d / 2][16], two buffers
 * of 32 keys' value pairs for four sum tiles [2][4][16][16], the outputs [16][d] */
typedef struct {
    float *s, *o;
    uint16_t *pa, *kb;
    uint32_t *qt2, *vb;
} decode_scratch;

static int decode_scratch_alloc(decode_scratch *w, int64_t span, int64_t d) {
    const int64_t keys = (span + TILE_PAIR_KEYS - 1) / TILE_PAIR_KEYS * TILE_PAIR_KEYS;
    w->s = (float *)aligned_alloc(64, sizeof(float) * (size_t)(keys * TILE_LANES));
    w->o = (float *)aligned_alloc(64, sizeof(float) * (size_t)(TILE_LANES * d));
    w->pa = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * (size_t)(keys * TILE_LANES));
    w->kb = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * (size_t)(4 * 16 * d));
    w->qt2 = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * (size_t)(d / 2 * TILE_LANES));
    w->vb = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * 2 * 4 * 16 * 16);
    return w->s && w->o && w->pa && w->kb && w->qt2 && w->vb;
}

static void decode_scratch_free(decode_scratch *w) {
    free(w->s), free(w->o), free(w->pa), free(w->kb), free(w->qt2), free(w->vb);
}

/* the B-tile row of keys t and t + 1 (their rows in `rows`; zero past the context's len keys) for features
 * c .. c + 16: each feature's two values side by side */
INLINE __m512i value_pair(const uint16_t *v_cache, const int64_t *rows, int64_t t, int64_t len, int64_t c) {
    const __m256i lo = t < len ? _mm256_loadu_si256((const __m256i *)(v_cache + rows[t] + c)) : _mm256_setzero_si256();
    const __m256i hi = t + 1 < len ? _mm256_loadu_si256((const __m256i *)(v_cache + rows[t + 1] + c))
                                   : _mm256_setzero_si256();
    return bf16_pairs(lo, hi);
}

/* The calls of ask_next that tiles_head makes for an item of `len` tokens, per tile of lanes: one per score product's
 * step (four a turn of 64 keys and 32 features), one per 32 keys' probabilities, one per B tile of value pairs. */
static int64_t tiles_head_asks(int64_t len, int64_t d, int64_t group) {
    const int64_t turns = (len + TILE_PAIR_KEYS - 1) / TILE_PAIR_KEYS; /* of 32 keys */
    return (group + TILE_LANES - 1) / TILE_LANES * ((len + 63) / 64 * 4 * (d / 32) + turns + turns * (d / 16));
}

/* tiles_head for query heads lane0 .. lane0 + 16 of the group (one tile of lanes); with `ask_own`, the first tile of
 * lanes asks for the rows ahead, and the others find them in L2 */
static void tiles_lanes(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, int64_t len,
                        const int64_t *rows, int64_t hk_stride, void *out, float *part, int64_t b, int64_t h,
                        int64_t hq, int64_t hk, int64_t d, float scale, int64_t lane0, decode_scratch *w,
                        const int ask_own, next_rows *nx) {
    const int64_t group = hq / hk, padded = (len + TILE_PAIR_KEYS - 1) / TILE_PAIR_KEYS * TILE_PAIR_KEYS;
    const int64_t lanes = group - lane0 < TILE_LANES ? group - lane0 : TILE_LANES, head0 = h * group + lane0;
    /* the queries' pairs of features: B-tile row c2 holds word c2 of each lane's query, lanes past the heads zero */
    for (int64_t c2 = 0; c2 < d / 2; c2++)
        for (int64_t g = 0; g < TILE_LANES; g++)
            w->qt2[c2 * TILE_LANES + g] = g < lanes ? ((const uint32_t *)(q + (b * hq + head0 + g) * d))[c2] : 0;
    /* S^T, 64 keys a turn in four sum tiles (0-3, free until the values), so that four chains of products are in
     * flight; keys past the context score against zero rows (never used) */
    for (int64_t t0 = 0; t0 < len; t0 += 64) {
        for (int64_t t = t0 == 0 ? 0 : t0 + AHEAD; ask_own && lane0 == 0 && t < t0 + 64 + AHEAD && t < len; t++) {
            ask_row(k_cache, rows[t], d, 1);
            ask_row(v_cache, rows[t], d, 1);
        }
        const uint16_t *keys[4];
        int64_t ldk[4];
        for (int64_t g = 0; g < 4 && t0 + 16 * g < len; g++) {
            const int64_t k0 = t0 + 16 * g;
            int apart = k0 + 16 <= len; /* 16 rows hk_stride apart in the cache: one tile load in place */
            for (int64_t i = 1; apart && i < 16; i++) apart = rows[k0 + i] == rows[k0] + i * hk_stride;
            keys[g] = k_cache + rows[k0];
            ldk[g] = hk_stride * (int64_t)sizeof(uint16_t);
            if (!apart) {
                uint16_t *kb = w->kb + g * 16 * d;
                for (int64_t i = 0; i < 16; i++) {
                    if (k0 + i < len)
                        memcpy(kb + i * d, k_cache + rows[k0 + i], sizeof(uint16_t) * (size_t)d);
                    else
                        memset(kb + i * d, 0, sizeof(uint16_t) * (size_t)d);
                }
                keys[g] = kb;
                ldk[g] = d * (int64_t)sizeof(uint16_t);
            }
        }
        AMX_MEMORY_BARRIER();
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < d; c += 32) {
            _tile_loadd(6, w->qt2 + c / 2 * TILE_LANES, 64);
#define SCORE_GROUP(G, A)                                \
    ask_next(nx);                                        \
    if (t0 + 16 * (G) < len) {                           \
        _tile_loadd(A, keys[G] + c, ldk[G]);             \
        _tile_dpbf16ps(G, A, 6);                         \
    }
            SCORE_GROUP(0, 4)
            SCORE_GROUP(1, 5)
            SCORE_GROUP(2, 4)
            SCORE_GROUP(3, 5)
#undef SCORE_GROUP
        }
        _tile_stored(0, w->s + t0 * TILE_LANES, 64);
        if (t0 + 16 < len) _tile_stored(1, w->s + (t0 + 16) * TILE_LANES, 64);
        if (t0 + 32 < len) _tile_stored(2, w->s + (t0 + 32) * TILE_LANES, 64);
        if (t0 + 48 < len) _tile_stored(3, w->s + (t0 + 48) * TILE_LANES, 64);
    }
    AMX_MEMORY_BARRIER();
    /* softmax per lane over the keys, base 2 */
    const __m512 sc = _mm512_set1_ps(scale * LOG2E);
    __m512 m0 = _mm512_set1_ps(-3.0e38f), m1 = m0;
    int64_t t = 0;
    for (; t + 2 <= len; t += 2) {
        m0 = _mm512_max_ps(m0, _mm512_loadu_ps(w->s + t * TILE_LANES));
        m1 = _mm512_max_ps(m1, _mm512_loadu_ps(w->s + (t + 1) * TILE_LANES));
    }
    if (t < len) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(w->s + t * TILE_LANES));
    const __m512 top = _mm512_mul_ps(_mm512_max_ps(m0, m1), sc);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0;
    for (int64_t k0 = 0; k0 < padded; k0 += TILE_PAIR_KEYS) {
        ask_next(nx);
        __m512i r[16];
        for (int j = 0; j < 16; j++) {
            const int64_t k = k0 + 2 * j;
            __m512 p0 = _mm512_setzero_ps(), p1 = p0;
            if (k < len) {
                p0 = pow2_probability(_mm512_fmsub_ps(_mm512_loadu_ps(w->s + k * TILE_LANES), sc, top));
                sum0 = _mm512_add_ps(sum0, p0);
            }
            if (k + 1 < len) {
                p1 = pow2_probability(_mm512_fmsub_ps(_mm512_loadu_ps(w->s + (k + 1) * TILE_LANES), sc, top));
                sum1 = _mm512_add_ps(sum1, p1);
            }
            r[j] = probability_pairs(p0, p1);
        }
        transpose16_epi32(r); /* r[lane]: the lane's 16 pairs of keys */
        for (int g = 0; g < 16; g++) _mm512_storeu_si512(w->pa + k0 * TILE_LANES + g * TILE_PAIR_KEYS, r[g]);
    }
    float sums[TILE_LANES], tops[TILE_LANES];
    _mm512_storeu_ps(sums, _mm512_add_ps(sum0, sum1));
    _mm512_storeu_ps(tops, top);
    /* O = P V, 64 features (four sum tiles) a pass over the values. The value pairs of each block of 32 keys are
     * built one turn before the tiles load them (two buffers in turn), so that no tile load waits on the vector
     * stores just written. */
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
        const int tiles = d - c0 >= 64 ? 4 : (int)((d - c0) / 16);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k0 = 0; k0 <= padded; k0 += TILE_PAIR_KEYS) {
            if (k0 > 0) { /* the block before, built last turn */
                const int64_t kp = k0 - TILE_PAIR_KEYS;
                const uint32_t *vb = w->vb + (kp / TILE_PAIR_KEYS % 2) * 4 * 256;
                AMX_MEMORY_BARRIER();
                _tile_loadd(4, w->pa + kp * TILE_LANES, 64);
                _tile_loadd(5, vb, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, vb + 256, 64);
                _tile_dpbf16ps(1, 4, 6);
                if (tiles > 2) {
                    _tile_loadd(5, vb + 512, 64);
                    _tile_dpbf16ps(2, 4, 5);
                    _tile_loadd(6, vb + 768, 64);
                    _tile_dpbf16ps(3, 4, 6);
                }
            }
            if (k0 < padded) {
                uint32_t *vb = w->vb + (k0 / TILE_PAIR_KEYS % 2) * 4 * 256;
                for (int g = 0; g < tiles; g++) {
                    ask_next(nx);
                    for (int j = 0; j < 16; j++)
                        _mm512_storeu_si512(vb + (g * 16 + j) * 16,
                                            value_pair(v_cache, rows, k0 + 2 * j, len, c0 + 16 * g));
                }
            }
        }
        const int64_t ldo = d * (int64_t)sizeof(float);
        _tile_stored(0, w->o + c0, ldo);
        _tile_stored(1, w->o + c0 + 16, ldo);
        if (tiles > 2) {
            _tile_stored(2, w->o + c0 + 32, ldo);
            _tile_stored(3, w->o + c0 + 48, ldo);
        }
    }
    AMX_MEMORY_BARRIER();
    for (int64_t g = 0; g < lanes; g++) {
        const int64_t at = lane0 + g; /* the head's place in the group */
        if (part != NULL) { /* unnormalised, the top in natural units (merge_parts) */
            for (int64_t f = 0; f < d; f += 16) _mm512_storeu_ps(part + at * d + f, _mm512_loadu_ps(w->o + g * d + f));
            part[group * d + at] = tops[g] * LN2;
            part[group * d + group + at] = sums[g];
            continue;
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sums[g]);
        for (int64_t f = 0; f < d; f += 16)
            vf_store_bf16((uint16_t *)out + (b * hq + head0 + g) * d + f,
                          _mm512_mul_ps(_mm512_loadu_ps(w->o + g * d + f), inv));
    }
}

/* one_head on the tiles: the same item, `rows` its tokens' row offsets, and the same outputs (out, or part); the
 * query heads of the group 16 at a time */
static void tiles_head(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, int64_t len,
                       const int64_t *rows, int64_t hk_stride, void *out, float *part, int64_t b, int64_t h, int64_t hq,
                       int64_t hk, int64_t d, float scale, decode_scratch *w, const int ask_own, next_rows *nx) {
    for (int64_t lane0 = 0; lane0 < hq / hk; lane0 += TILE_LANES)
        tiles_lanes(q, k_cache, v_cache, len, rows, hk_stride, out, part, b, h, hq, hk, d, scale, lane0, w, ask_own,
                    nx);
}
#else
#define DECODE_TILES 0
#endif

/* The fewest query heads a KV head for which the tiles beat the vector kernel: their work a key hardly grows with the
 * heads (a tile has 16 lanes), the vector kernel's grows with each. The Xeon with AMX, 4 x 1024 tokens, 24 layers,
 * against the vector kernel: 2 KV heads of 64, 4 query heads each 1.08x the time, 6 0.88x, 8 0.79x, 16 0.49x; 2 of
 * 128, 4 0.87x, 6 0.83x; 8 of 64, 4 1.04x, 6 0.94x, 8 0.82x. With 8 KV heads of 128 the tiles had needed 8 (4 1.24x,
 * 6 1.10x, 8 0.97x) while each head's item read its rows apart from the others' (split_work); since a sequence's
 * heads run in turn, 8 x 1024 tokens: 4 query heads 0.97x, 6 0.89x, 7 0.79x, and 1 x 4096 at 6 0.84x (4 KV heads of
 * 64: 4 1.03x, 5 1.00x). More than 16 take a pass for each tile of lanes: at 8 x 1024, one KV head of 17, 32, 48 and
 * 71 query heads, 0.55-0.58x, 0.41x, 0.34x and 0.32x the time. Measured again once the vector kernel asked for
 * the next item's rows and took its bf16 products in pairs (CPU_HISTORY.md, "the tiles' threshold, measured
 * again"): 4 still loses or ties (32 / 8 heads of 128: 1.03-1.04x), 5 wins only with 2 or 4 KV heads in batches
 * (1.10x on one sequence of 4096 tokens over 4 KV heads of 64, 0.91-1.06x over 40 / 8 of 128), 6 and more win. */
#define TILES_MIN_GROUP 6

/* 1 when decode attention of this dtype (bf16: 1), head size and heads (hq query heads over hk KV heads) runs on the
 * AMX tiles here (tiles_head): bf16, d a multiple of 32, TILES_MIN_GROUP query heads a KV head or more, the tiles built
 * in and granted by the OS; else 0 (one_head) */
int kunlun_decode_attention_on_tiles(int bf16, int64_t d, int64_t hq, int64_t hk) {
#if DECODE_TILES
    const int64_t group = hk > 0 ? hq / hk : 0;
    return bf16 && d % 32 == 0 && group >= TILES_MIN_GROUP && kunlun_amx_tiles();
#else
    (void)bf16, (void)d, (void)hq, (void)hk;
    return 0;
#endif
}

/* One work item with head size D. With AVX2 and bf16 caches the common head sizes (64, 128) are each compiled with D a
 * constant, so that the loops over a row's vectors unroll whole: Zen 4 capped to AVX2, in turns, bit for bit the same,
 * the 0.5B model's step (14 / 2 heads of 64) 0.87-0.94x the time at 8 x 256 and 8 x 1024 tokens and 0.92-0.93x at
 * 1 x 4096 (one KV head of 8: 0.95-1.02x). Float32 caches (0.97-1.08x) and AVX-512 (0.96-1.07x) gained nothing from
 * it and keep one body. PIPELINED: built to ask for the next item's rows (a pipelined split, AVX-512 only), else
 * built without the asks, its loops as they were (with the asks' checks left in, the avx2 set's bf16 kernel took
 * 1.06-1.15x the time with nothing to ask). Each build is a function of its own, called once an item, so that its
 * loops are compiled apart from the loop that hands out the items: inlined into it, the Zen 5's bf16 kernel took
 * 1.05-1.15x the time of the same split before the items were claimed by hand (1 x 4096 tokens, one KV head of 8). */
typedef void one_head_fn(const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int64_t lo,
                         int64_t hi, void *out, float *part, int64_t b, int64_t h, int64_t hq, int64_t hk, int64_t d,
                         int64_t block_size, float scale, float *work, int64_t *rows, int ask_own, next_rows *nx);

#define ONE_HEAD_OF_SIZE(NAME, D, BF16, PIPELINED)                                                                    \
    static __attribute__((noinline)) void NAME(const void *q, const void *k_cache, const void *v_cache,               \
                                               const int32_t *table, int64_t lo, int64_t hi, void *out, float *part,  \
                                               int64_t b, int64_t h, int64_t hq, int64_t hk, int64_t d,               \
                                               int64_t block_size, float scale, float *work, int64_t *rows,           \
                                               int ask_own, next_rows *nx) {                                          \
        (void)d;                                                                                                      \
        one_head(q, k_cache, v_cache, table, lo, hi, out, part, b, h, hq, hk, D, block_size, scale, work, rows, BF16, \
                 PIPELINED ? ask_own : 1, PIPELINED ? nx : NULL);                                                     \
    }

#if VLEN == 8
ONE_HEAD_OF_SIZE(one_head_bf16_64, 64, 1, 0)
ONE_HEAD_OF_SIZE(one_head_bf16_128, 128, 1, 0)
#endif
ONE_HEAD_OF_SIZE(one_head_bf16, d, 1, 0)
ONE_HEAD_OF_SIZE(one_head_f32, d, 0, 0)
#if PIPELINING(1)
ONE_HEAD_OF_SIZE(one_head_bf16_pipelined, d, 1, 1)
#endif
ONE_HEAD_OF_SIZE(one_head_f32_pipelined, d, 0, 1)

/* the build of one_head for this dtype, head size and split (see ONE_HEAD_OF_SIZE) */
static one_head_fn *one_head_build(const int bf16, int64_t d, const int pipelined) {
#if PIPELINING(1)
    if (pipelined && bf16) return one_head_bf16_pipelined;
#endif
    if (pipelined && !bf16) return one_head_f32_pipelined;
#if VLEN == 8
    if (bf16 && d == 64) return one_head_bf16_64;
    if (bf16 && d == 128) return one_head_bf16_128;
#endif
    (void)pipelined, (void)d;
    return bf16 ? one_head_bf16 : one_head_f32;
}

/* How the step's work is split among `threads` threads: each sequence's context into `parts`, each part's KV heads
 * into runs of `heads` heads that one thread takes in turn. A part's rows of every KV head (`token_bytes` a token, K
 * and V) fit half of L2, else the next head's item no longer finds them there (against the way before: 4 KV heads of
 * 128 at 8 x 1024 tokens 0.86-0.90x the time, 0.93-0.95x in whole contexts; 2 x 4096 tokens of 14 / 2 heads
 * 0.78-0.79x, 0.90-0.97x whole; 8 KV heads of 128 0.94-0.95x either way); no part is shorter than PART_TOKENS.
 * Whole sequences where their number keeps the threads busy evenly; else contexts split into the fewest parts that
 * do, a sequence's heads still together; else (short contexts) the heads split too. Pipelined (see PIPELINE_SHARE)
 * where that split already gives every thread PIPELINE_ITEMS items or more, each of all the KV heads: then in parts
 * of an eighth of L2 (the Xeon with AMX, in parts of a quarter rather than an eighth: 0.95-0.96x the time at 32 x 1000
 * tokens, 0.90-0.92x at 8 x 2000, against 0.91x and 0.85-0.87x). A few long contexts cut finer only to pipeline them
 * lost more than the asks won back where the kernel is quick a byte: on the Zen 5 (1 MiB of L2), one sequence of
 * 4096 tokens and one KV head of 8 took 1.19-1.33x the time in bf16 in 8 parts against 2 (0.88-0.93x in float32). */
typedef struct {
    int64_t parts, heads;
    int pipelined; /* each thread asks for its next item's rows while it works on one (next_rows) */
} work_split;

/* whether `items` equal items keep `threads` threads even: the busiest within 1.25x of the mean */
INLINE int evenly(int64_t items, int64_t threads) { return (items + threads - 1) / threads * threads * 4 <= items * 5; }

/* split_work's ways, the parts' rows of every KV head within `budget` bytes */
static work_split split_within(int64_t batch, int64_t hk, int64_t longest, int64_t threads, int64_t token_bytes,
                               int64_t budget) {
    work_split split = {1, hk, 0};
    const int64_t most = longest / PART_TOKENS < MAX_PARTS ? longest / PART_TOKENS : MAX_PARTS;
    int64_t fit = budget / token_bytes;
    fit = fit > PART_TOKENS ? fit : PART_TOKENS;
    int64_t least = (longest + fit - 1) / fit;
    least = least < most ? least : most;
    split.parts = least > 1 ? least : 1;
    if (evenly(batch * split.parts, threads)) return split;
    for (int64_t parts = split.parts + 1; parts <= most; parts++) {
        split.parts = parts;
        if (evenly(batch * parts, threads)) return split;
    }
    split.heads = 1;
    for (int64_t runs = 2; runs < hk; runs++)
        if (hk % runs == 0 && evenly(batch * split.parts * runs, threads)) {
            split.heads = hk / runs;
            break;
        }
    return split;
}

static work_split split_work(int64_t batch, int64_t hk, int64_t longest, int64_t threads, int64_t token_bytes,
                             const int bf16) {
    const work_split whole = split_within(batch, hk, longest, threads, token_bytes, kunlun_l2_bytes / 2);
    if (!PIPELINING(bf16) || whole.heads != hk || batch * whole.parts < PIPELINE_ITEMS * threads) return whole;
    work_split split = split_within(batch, hk, longest, threads, token_bytes, kunlun_l2_bytes / PIPELINE_SHARE);
    split.pipelined = split.heads == hk;
    return split.pipelined ? split : whole;
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
    const int64_t group = hq / hk;
    const int64_t token_bytes = hk * d * (bf16 ? 2 : 4); /* a token's K (or V) rows of every KV head */
    const work_split split = split_work(batch, hk, longest, omp_get_max_threads(), 2 * token_bytes, bf16);
    const int64_t parts = split.parts, runs = hk / split.heads;
    const int64_t span = (longest + parts - 1) / parts, part_floats = group * (d + 2);
    float *partial = parts > 1 ? (float *)malloc(sizeof(float) * batch * hk * parts * part_floats) : NULL;
    if (parts > 1 && partial == NULL) return -1;
    const int64_t per_item = group * d + VLEN * d + group * d + group + group * span;
    int failed = 0;
    const int tiles = kunlun_decode_attention_on_tiles(bf16, d, hq, hk);
    one_head_fn *const head = one_head_build(bf16, d, split.pipelined);
    const int64_t items = batch * runs * parts;
    int64_t claimed = 0;
    #pragma omp parallel reduction(|| : failed)
    {
        float *work = tiles ? NULL : (float *)malloc(sizeof(float) * per_item);
        int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * span);
        int ready = rows != NULL && (tiles || work != NULL);
#if DECODE_TILES
        decode_scratch tw = {0};
        if (tiles) {
            ready = decode_scratch_alloc(&tw, span, d) && ready;
            amx_configure(16, 16); /* every tile 16 rows of 64 bytes, as the prompt kernel's */
        }
#endif
        if (!ready) failed = 1;
        /* The items (b, run, i), in that order, claimed one at a time as a dynamic schedule would; where the split is
         * pipelined a thread claims its next item as it starts one, while more are left unclaimed than there are
         * threads (past that, no thread should wait on an item another holds), and asks for its rows meanwhile. */
        const int64_t team = omp_get_num_threads();
        next_rows nx = {(const char *)k_cache, (const char *)v_cache, NULL, block_size, token_bytes};
        int64_t item = ready ? __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED) : items;
        while (item < items) {
            const int ask_own = nx.table == NULL; /* no item before asked for this one's rows */
            int64_t next = -1, lo, hi;
            if (split.pipelined && items - __atomic_load_n(&claimed, __ATOMIC_RELAXED) > team)
                next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            const int64_t b = item / (runs * parts), run = item / parts % runs, i = item % parts;
            const int32_t *table = block_tables + b * table_stride;
            part_tokens(seq_lens[b], parts, i, &lo, &hi);
            nx.table = NULL;
            if (next >= 0 && next < items && lo < hi) {  /* pipelined: one run of every KV head, item = b * parts + i */
                int64_t next_lo, next_hi;
                part_tokens(seq_lens[next / parts], parts, next % parts, &next_lo, &next_hi);
#if DECODE_TILES
                const int64_t calls =
                    tiles ? tiles_head_asks(hi - lo, d, group) : one_head_asks(hi - lo, d, group, bf16);
#else
                const int64_t calls = one_head_asks(hi - lo, d, group, bf16);
#endif
                if (next_lo < next_hi)
                    next_rows_start(&nx, block_tables + next / parts * table_stride, next_lo, next_hi, hk * calls);
            }
            for (int64_t h = run * split.heads; h < (run + 1) * split.heads; h++) {
                float *part = parts > 1 ? partial + ((b * hk + h) * parts + i) * part_floats : NULL;
                if (lo == hi) {  /* a short context: nothing in this part */
                    for (int64_t g = 0; g < group; g++) part[group * d + group + g] = 0.0f;
                    continue;
                }
#if DECODE_TILES
                if (tiles) {
                    token_rows(table, lo, hi, h, hk, d, block_size, rows);
                    tiles_head((const uint16_t *)q, (const uint16_t *)k_cache, (const uint16_t *)v_cache, hi - lo,
                               rows, hk * d, out, part, b, h, hq, hk, d, scale, &tw, ask_own, &nx);
                    continue;
                }
#endif
                head(q, k_cache, v_cache, table, lo, hi, out, part, b, h, hq, hk, d, block_size, scale, work, rows,
                     ask_own, &nx);
            }
            item = next >= 0 ? next : __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        }
        #pragma omp barrier
        if (parts > 1) {
            #pragma omp for collapse(2) schedule(static)
            for (int64_t b = 0; b < batch; b++)
                for (int64_t h = 0; h < hk; h++)
                    merge_parts(partial + (b * hk + h) * parts * part_floats, parts, group, d, out,
                                (b * hq + h * group) * d, bf16);
        }
#if DECODE_TILES
        if (tiles) {
            _tile_release();
            decode_scratch_free(&tw);
        }
#endif
        free(work);
        free(rows);
    }
    free(partial);
    return failed ? -1 : 0;
}
