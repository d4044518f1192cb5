/*
 * One vector vocabulary for the native kernels, compiled once per kernel set (see cpu_native.py).
 *
 * A source written against this header builds for AVX-512 (16 floats per vector, masked tails) and for
 * AVX2 + FMA (8 floats per vector, tails through a small buffer). `vf` is a vector of VLEN float32;
 * bf16 values are widened to float32 by a 16-bit shift and rounded back to nearest even. Included by every
 * kernel source; part of the build's cache key.
 */
#ifndef KUNLUN_SIMD_H
#define KUNLUN_SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* log2(e) and ln(2): the softmaxes in base 2 scale their scores by LOG2E, and give their tops back in natural units */
#define LOG2E 1.44269504088896341f
#define LN2 0.693147180559945309f

#if defined(__AVX512F__)

#define VLEN 16
typedef __m512 vf;

INLINE vf vf_zero(void) { return _mm512_setzero_ps(); }
INLINE vf vf_set1(float x) { return _mm512_set1_ps(x); }
INLINE vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
INLINE vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
INLINE vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INLINE vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
INLINE vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
INLINE vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
INLINE vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); } /* a * b + c */
INLINE vf vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
INLINE void vf_storeu(float *p, vf v) { _mm512_storeu_ps(p, v); }
INLINE float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }
INLINE float vf_hmax(vf v) { return _mm512_reduce_max_ps(v); }

INLINE vf vf_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 2 * VLEN bf16 values as two float32 vectors, in order (the AVX2 build's pair is what saves instructions) */
INLINE void vf_load_bf16_pair(const uint16_t *p, vf *lo, vf *hi) {
    *lo = vf_load_bf16(p);
    *hi = vf_load_bf16(p + VLEN);
}

INLINE void vf_unpair(vf *lo, vf *hi) { (void)lo, (void)hi; }

/* float32 -> bf16 bits, round to nearest even (NaN stays NaN), in the low 16 bits of each 32-bit lane */
INLINE __m512i bf16_bits(vf v) {
    const __m512i x = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x40)));
}

/* v as 16 bf16 values, rounded as bf16_bits rounds. With AVX512-BF16 by one VCVTNEPS2BF16, which rounds alike but
 * flushes denormals to zero: a vector with a lane whose exponent is zero (a denormal, or a zero) takes bf16_bits. The
 * test is one VPTESTNMD: on the Xeon with AMX, SwiGLU of [32, 2 x 4864] bf16 values (two roundings a value), one
 * core, took 101 us with bf16_bits, 71 with the instruction alone, 81 with it and this test, 94 with a three-step
 * test for denormals alone (512-bit work runs on two ports there, and every step counts). */
INLINE __m256i bf16_half(vf v) {
#if defined(__AVX512BF16__)
    if (!_mm512_testn_epi32_mask(_mm512_castps_si512(v), _mm512_set1_epi32(0x7F800000)))
        return (__m256i)_mm512_cvtneps_pbh(v);
#endif
    return _mm512_cvtepi32_epi16(bf16_bits(v));
}

INLINE void vf_store_bf16(uint16_t *p, vf v) { _mm256_storeu_si256((__m256i *)p, bf16_half(v)); }

/* what bf16 makes of a float32 value */
INLINE vf vf_round_bf16(vf v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_half(v)), 16));
}

INLINE __mmask16 tail_mask(int64_t count) {
    return count >= 16 ? 0xFFFF : count <= 0 ? 0 : (__mmask16)((1u << count) - 1);
}

/* `count` (<= VLEN) elements at base[i] (bf16 or float32) as float32, zeros past them */
INLINE vf vf_load_n(const void *base, int64_t i, int64_t count, const int bf16) {
    const __mmask16 m = tail_mask(count);
    if (bf16) {
        const __m256i half = _mm256_maskz_loadu_epi16(m, (const uint16_t *)base + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)base + i);
}

INLINE void vf_store_n(void *base, int64_t i, vf v, int64_t count, const int bf16) {
    const __mmask16 m = tail_mask(count);
    if (bf16)
        _mm256_mask_storeu_epi16((uint16_t *)base + i, m, bf16_half(v));
    else
        _mm512_mask_storeu_ps((float *)base + i, m, v);
}

/* The VLEN horizontal sums of v[0..VLEN-1] as one vector (lane i = sum of v[i]), by interleaving adds. */
INLINE vf vf_transpose_sum(const vf *v) {
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

/* What the attention kernels share with AVX-512 (paged_prefill_attention.c, paged_decode_attention.c) */

/* r[i] = the 32-bit elements i of r[0 .. 16): a 16 x 16 transpose in three rounds of shuffles */
INLINE void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[i + k], lane L: element 4L + k of rows i .. i + 4 */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int k = 0; k < 4; k++) { /* the 4 x 4 lanes of r[k], r[4 + k], r[8 + k], r[12 + k] transposed */
        const __m512i x0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44), x1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xee);
        const __m512i y0 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
        const __m512i y1 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xee);
        t[k] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        t[4 + k] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
        t[8 + k] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        t[12 + k] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* 2^y within 2.9e-6 relative for y >= -126 (2^-126 below), exact at integers (an unchanged max rescales by 1): 9
 * instructions where vf_exp takes 17, for probabilities rounded to bf16 (1 + f (c1 + ...), fitted to 2^f, |f| <= 1/2,
 * weighted to its largest relative error) */
INLINE __m512 pow2_probability(__m512 y) {
    y = _mm512_max_ps(y, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.009582853f), f, _mm512_set1_ps(0.055906426f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024099f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69312418f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* lanes where a > b take x, the others y */
INLINE vf vf_select_gt(vf a, vf b, vf x, vf y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), y, x);
}

INLINE vf vf_round_int(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
INLINE vf vf_pow2i(vf n) { return _mm512_scalef_ps(_mm512_set1_ps(1.0f), n); } /* 2^n, n integral */

/* two bf16 values as one pair: lo in the low half */
INLINE __m512i bf16_pairs(__m256i lo, __m256i hi) {
    return _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

#elif defined(__AVX2__) && defined(__FMA__)

#define VLEN 8
typedef __m256 vf;

INLINE vf vf_zero(void) { return _mm256_setzero_ps(); }
INLINE vf vf_set1(float x) { return _mm256_set1_ps(x); }
INLINE vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
INLINE vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
INLINE vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
INLINE vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
INLINE vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
INLINE vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
INLINE vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
INLINE vf vf_loadu(const float *p) { return _mm256_loadu_ps(p); }
INLINE void vf_storeu(float *p, vf v) { _mm256_storeu_ps(p, v); }

INLINE float vf_sum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE float vf_hmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE vf vf_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* float32 -> bf16 bits, round to nearest even (NaN stays NaN), in the low 16 bits of each 32-bit lane */
INLINE __m256i bf16_bits(vf v) {
    const __m256i x = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

/* 16 bf16 values as two float32 vectors in the order one unpack each gives them: lo holds values 0-3 and 8-11, hi
 * 4-7 and 12-15 (vf_unpair puts them back in order). One instruction a vector, where widening in order takes two
 * (a zero extension and a shift); for work whose sums do not care which lane a value is in, or that unpairs once. */
INLINE void vf_load_bf16_pair(const uint16_t *p, vf *lo, vf *hi) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)p), zero = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x));
}

/* a pair in vf_load_bf16_pair's order back in the values' own: 0-7 into lo, 8-15 into hi */
INLINE void vf_unpair(vf *lo, vf *hi) {
    const vf a = *lo, b = *hi;
    *lo = _mm256_permute2f128_ps(a, b, 0x20);
    *hi = _mm256_permute2f128_ps(a, b, 0x31);
}

/* 8 lanes of bf16 bits (low halves) as 8 packed 16-bit values */
INLINE __m128i pack_bf16_bits(__m256i bits) {
    const __m256i packed = _mm256_packus_epi32(bits, bits); /* per 128-bit lane: 4 values, twice */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

INLINE void vf_store_bf16(uint16_t *p, vf v) { _mm_storeu_si128((__m128i *)p, pack_bf16_bits(bf16_bits(v))); }

INLINE vf vf_round_bf16(vf v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }

INLINE vf vf_load_n(const void *base, int64_t i, int64_t count, const int bf16) {
    if (count >= VLEN) return bf16 ? vf_load_bf16((const uint16_t *)base + i) : _mm256_loadu_ps((const float *)base + i);
    if (count <= 0) return vf_zero();
    if (bf16) {
        uint16_t tmp[VLEN] = {0};
        memcpy(tmp, (const uint16_t *)base + i, (size_t)count * sizeof(uint16_t));
        return vf_load_bf16(tmp);
    }
    float tmp[VLEN] = {0};
    memcpy(tmp, (const float *)base + i, (size_t)count * sizeof(float));
    return _mm256_loadu_ps(tmp);
}

INLINE void vf_store_n(void *base, int64_t i, vf v, int64_t count, const int bf16) {
    if (count <= 0) return;
    if (bf16) {
        uint16_t tmp[VLEN];
        vf_store_bf16(tmp, v);
        memcpy((uint16_t *)base + i, tmp, (size_t)(count < VLEN ? count : VLEN) * sizeof(uint16_t));
    } else if (count >= VLEN) {
        _mm256_storeu_ps((float *)base + i, v);
    } else {
        float tmp[VLEN];
        _mm256_storeu_ps(tmp, v);
        memcpy((float *)base + i, tmp, (size_t)count * sizeof(float));
    }
}

INLINE vf vf_transpose_sum(const vf *v) {
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3); /* lanes: 0..3 | 0..3 per half */
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

INLINE vf vf_select_gt(vf a, vf b, vf x, vf y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_GT_OQ)); }

INLINE vf vf_round_int(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
INLINE vf vf_pow2i(vf n) { /* 2^n for integral n in [-126, 127]: the exponent field set directly */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}

#else
#error "the native kernels need AVX2 and FMA at least"
#endif

/* How far ahead of the multiply a GEMM asks for its weight stream (bytes), one prefetch per cache line.
 * A decode step streams each weight once; the hardware prefetchers alone leave the multiply waiting on
 * memory, most where each byte costs the most instructions: bf16 widened on AVX2 measured 20% faster at one
 * row with every line asked for (half of them: no better than none), AVX-512 bf16 14% faster at 8 rows. */
#define PREFETCH_BYTES 8192

/* Whether a block of `rows` rows that reads its weight `once` (a decode step's rows all in one block) asks for
 * nothing ahead: one row with AVX-512, where one VDPBF16PS or FMA per 64 bytes leaves the hardware
 * prefetchers enough time; everything else asks into the second-level cache (T1). A prefetch into the first
 * level holds one of its few miss buffers until the line arrives from memory, and those run out before the
 * bandwidth does wherever a line costs more than a few instructions, while the second level keeps many more
 * requests in flight (the decode attention's prefetch found the same). Zen 4, in turns against first-level
 * prefetches (NTA for one block, T0 for several), the 0.5B model's layer GEMMs: AVX2 bf16 0.77-0.89x the time
 * at 1 row, 0.81-0.85x at 4, 0.89x at 8; int8 0.67-0.89x at 1 row (AVX2) and 0.70x at 8 (AVX-512); AVX-512
 * bf16 0.89-0.92x at 8 rows. Decode steps in the engine, separate processes in turns: AVX2 bf16 batch 1
 * 0.72-0.84x; AVX-512 at batch 8 bf16 0.72-0.88x, int8 0.75-0.83x; AVX-512 bf16 batch 1 1.08x (median of 5)
 * with T1, its GEMMs alone no faster. A single row of bf16 or float32 weights with AVX-512 then measured best
 * asking for nothing at all (gemm_bf16.c, gemm.c), and int8 within the noise of a non-temporal prefetch (Zen 4,
 * batch-1 steps, eight processes each in turns: medians 19.7 and 20.7 ms, each faster in four pairs). On a
 * Xeon with AMX capped to AVX-512 the non-temporal prefetch of int8 at one row read 8.5 GB/s, nothing 16.8
 * and T1 19.7 (24 layers' GEMMs, best of 5 in turns): there asking ahead is faster still, so Intel's CPUs ask
 * ahead at one row after all (kunlun_one_row_prefetch, below); int8 now asks at one row everywhere (gemm_int8.c). */
#define UNPREFETCHED(once, rows) (VLEN == 16 && (once) && (rows) == 1)

/* 1 where one-row GEMMs ask for their weight ahead all the same, as Intel's CPUs measured faster doing
 * (kunlun_gemm_set_one_row_prefetch, set when the library loads: cpu_native.py) */
extern int kunlun_one_row_prefetch;

/* The core's L2 (sysconf, read as the library loads: gemm.c; 2 MiB, an AMX Xeon's, where the system does not say). The
 * tile GEMMs' passes of rows (amx_pass_rows) and the float32 GEMMs' chunks of K (gemm.c) are sized by it, and the tile
 * GEMMs ask for the next weight tile only where a pass's rows and two tiles fit it (amx_share). */
extern int64_t kunlun_l2_bytes;

/* Cache lines of weight that a block of rows asks for while it multiplies (block_share). */
typedef struct {
    const char *from;
    int64_t lines;
} ahead_t;

/* What block `blk` of `blocks` asks for of the `lines` lines at `next` (the weight the blocks multiply next), while it
 * multiplies what the first block read: an equal share for every block but the first, which reads its own weight as
 * the blocks before asked for it; nothing for the first. Shared by the float32 GEMMs (gemm.c's tile_chunk) and the tile
 * GEMMs (amx_share). */
INLINE ahead_t block_share(const char *next, int64_t lines, int64_t blocks, int64_t blk) {
    ahead_t ahead = {NULL, 0};
    if (blk == 0) return ahead;
    const int64_t share = (lines + blocks - 2) / (blocks - 1), done = (blk - 1) * share;
    if (done < lines) {
        ahead.from = next + done * 64;
        ahead.lines = lines - done < share ? lines - done : share;
    }
    return ahead;
}

/* What a thread multiplies after reductions [k0, k0 + kc) of weight tile t, its tiles [first, last) taking K `chunk`
 * reductions at a time in groups [g0, g1) (each chunk of every tile of a group before the group's next chunk): the
 * group's next tile at this chunk, else the group's first tile's next chunk, else the next group's first chunk, else
 * (with `more` passes of rows to come) the first tile's first chunk; NULL when nothing is left. Tiles lie `tile_bytes`
 * apart from `weight`, a reduction of a tile `step` bytes; *count gets the reductions of what comes next. Shared by
 * the float32 GEMMs (gemm.c, one group of all the thread's tiles) and the tile GEMMs (amx.h's amx_walk). */
INLINE const char *next_chunk(const char *weight, int64_t tile_bytes, int64_t step, int64_t t, int64_t g0,
                              int64_t g1, int64_t first, int64_t last, int64_t k0, int64_t kc, int64_t k,
                              int64_t chunk, const int more, int64_t *count) {
    *count = chunk;
    if (t + 1 < g1) {
        *count = kc;
        return weight + (t + 1) * tile_bytes + k0 * step;
    }
    if (k0 + kc < k) {
        *count = k - k0 - kc < chunk ? k - k0 - kc : chunk;
        return weight + g0 * tile_bytes + (k0 + kc) * step;
    }
    if (g1 < last) return weight + g1 * tile_bytes;
    return more ? weight + first * tile_bytes : NULL;
}

/* One pass's part of a block's ask for `LINES` lines from `FROM`, into L2, spread evenly over the block's `PASSES`
 * passes (CREDIT, 0 before the first): by the end of pass i, (i + 1) * LINES / PASSES of them, one every few passes
 * where they are fewer than the passes. Shared by the float32 GEMMs (micro_kernel) and the tile GEMMs. A macro over
 * the block's own variables: with an ahead_t passed to the tile GEMMs' block and an inline function over it, the same
 * asks left the bf16 GEMMs at 256 rows 0.97-0.99x the time of asking for nothing, against 0.90x, for a reason the code
 * GCC emitted did not show. */
#define ASK_SPREAD(FROM, LINES, PASSES, CREDIT)                                              \
    for ((CREDIT) += (LINES); (CREDIT) >= (PASSES); (CREDIT) -= (PASSES), (FROM) += 64)      \
        _mm_prefetch((FROM), _MM_HINT_T1)

/* UNPREFETCHED's `once` for a GEMM of m rows whose blocks take up to `block_rows`: its weight read once, by one
 * block, and this CPU not asking ahead at one row all the same. Read once per GEMM, outside its loops. */
INLINE int reads_once(int64_t m, int64_t block_rows) { return m <= block_rows && !kunlun_one_row_prefetch; }

/* Every cache line of the `bytes` bytes at p + PREFETCH_BYTES, into the second-level cache; a span under one
 * line asks for the line only when p starts one (so a stream advancing by less than a line asks once per
 * line). */
INLINE void prefetch_span(const void *p, const int64_t bytes) {
    const char *ahead = (const char *)p + PREFETCH_BYTES;
    if (bytes >= 64) {
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
    } else if (((uintptr_t)p & 63) == 0) {
        _mm_prefetch(ahead, _MM_HINT_T1);
    }
}

/* e^x, x clamped to [-87, 88]: 2^n * p(r), |r| <= ln2 / 2, degree-7 Taylor polynomial (rel. err < 1e-7).
 * Serves SwiGLU's sigmoid and the softmax of decode attention. */
INLINE vf vf_exp(vf x) {
    x = vf_min(vf_max(x, vf_set1(-87.0f)), vf_set1(88.0f));
    const vf n = vf_round_int(vf_mul(x, vf_set1(LOG2E)));
    vf r = vf_fma(n, vf_set1(-0.693359375f), x);
    r = vf_fma(n, vf_set1(2.12194440e-4f), r);
    vf p = vf_set1(1.0f / 5040);
    p = vf_fma(p, r, vf_set1(1.0f / 720));
    p = vf_fma(p, r, vf_set1(1.0f / 120));
    p = vf_fma(p, r, vf_set1(1.0f / 24));
    p = vf_fma(p, r, vf_set1(1.0f / 6));
    p = vf_fma(p, r, vf_set1(0.5f));
    p = vf_fma(p, r, vf_set1(1.0f));
    p = vf_fma(p, r, vf_set1(1.0f));
    return vf_mul(p, vf_pow2i(n));
}

/* The micro-kernel of the GEMM-shaped loops (gemm.c's chunks of a prefill, the two products of prompt attention):
 * for r < rows and v < vecs (1 or 2), out[r * ldo + v * VLEN ..] = (accumulate ? out : 0) + sum over q < n of
 * a[q * a_step + r * a_row] * b[q * b_step + v * VLEN ..]. The rows x vecs sums stay in registers over the whole of
 * n (rows <= 12 with AVX-512, 6 with AVX2: 2 * rows accumulators, two vectors of b and a broadcast fit the register
 * file), each step one broadcast of a per row; two steps a turn (2-8% for gemm.c's chunks on Zen 3). */
INLINE void fma_tile(const float *a, const int64_t a_step, const int64_t a_row, const float *b, const int64_t b_step,
                     int64_t n, float *out, int64_t ldo, const int rows, const int vecs, const int accumulate) {
    vf acc0[12], acc1[12];
    _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++) {
        acc0[r] = accumulate ? vf_loadu(out + r * ldo) : vf_zero();
        acc1[r] = accumulate && vecs > 1 ? vf_loadu(out + r * ldo + VLEN) : vf_zero();
    }
    _Pragma("GCC unroll 2") for (int64_t q = 0; q < n; q++) {
        const vf b0 = vf_loadu(b + q * b_step), b1 = vecs > 1 ? vf_loadu(b + q * b_step + VLEN) : vf_zero();
        _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++) {
            const vf x = vf_set1(a[q * a_step + r * a_row]);
            acc0[r] = vf_fma(x, b0, acc0[r]);
            if (vecs > 1) acc1[r] = vf_fma(x, b1, acc1[r]);
        }
    }
    _Pragma("GCC unroll 16") for (int r = 0; r < rows; r++) {
        vf_storeu(out + r * ldo, acc0[r]);
        if (vecs > 1) vf_storeu(out + r * ldo + VLEN, acc1[r]);
    }
}

/* float32 -> bf16 bits of one value, round to nearest even */
INLINE uint16_t bf16_from_float(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

INLINE float float_from_bf16(uint16_t h) {
    const uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

#endif
