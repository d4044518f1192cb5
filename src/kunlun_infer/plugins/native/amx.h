/*
 * What the AMX GEMMs (gemm_bf16.c, gemm_int8.c) share: the tile state the OS must grant, and one tile layout.
 *
 * Both multiply a packed weight whose tile of 32 outputs keeps, per step of the reduction, 32 outputs x 4
 * bytes side by side (bf16 pairs or int8 quads): two AMX B tiles with a 128-byte stride, outputs 0-15 and
 * 16-31, 16 rows of 64 bytes each. Tiles 0-3 hold the sums (row block i, output half j at 2 * i + j), 4 and
 * 5 two blocks of up to 16 rows of X, 6 and 7 the weight's halves. Part of the build's cache key.
 *
 * Both walk their tiles, passes of rows and chunks of K alike (amx_walk): a reduction of `reduction` bytes a row
 * (bf16: 2 a reduction, int8: 1) whose weight tile is 32 times as long.
 */
#ifndef KUNLUN_AMX_H
#define KUNLUN_AMX_H

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

/* 1 when the GEMMs run on the tiles here, 0 when the OS refused the process the tile state (gemm_bf16.c) */
int kunlun_amx_tiles(void);

/* the compiler's tile loads (and configuration load) do not tell it they read memory: stores to local buffers
 * they read are kept by this barrier */
#define AMX_MEMORY_BARRIER() __asm__ volatile("" ::: "memory")

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_tile_config;

/* The layout above for blocks of rows0 and rows1 rows of X; loading it zeroes every tile. */
static inline void amx_configure(int rows0, int rows1) {
    amx_tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int rows[2] = {rows0, rows1};
    for (int i = 0; i < 2; i++) {
        for (int j = 0; j < 2; j++) {
            c.rows[2 * i + j] = rows[i];
            c.colsb[2 * i + j] = 64;
        }
        c.rows[4 + i] = rows[i];
        c.colsb[4 + i] = 64;
        c.rows[6 + i] = 16;
        c.colsb[6 + i] = 64;
    }
    AMX_MEMORY_BARRIER();
    _tile_loadconfig(&c);
}

/* the four sum tiles zeroed */
static inline void amx_zero_sums(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* Zero sums for a block of `rows` rows (up to 32): the layout loaded for them unless *configured (the rows of the
 * layout this thread loaded last) says it is there already. */
static inline void amx_start_block(int rows, int *configured) {
    if (*configured != rows) {
        amx_configure(rows < 16 ? rows : 16, rows > 16 ? rows - 16 : 1);
        *configured = rows;
    } else {
        amx_zero_sums();
    }
}

/* the sum tiles of a block of `rows` rows from sums [32][32] (32-bit values), to add to them */
static inline void amx_load_sums(const void *sums, int rows) {
    _tile_loadd(0, sums, 128);
    _tile_loadd(1, (const char *)sums + 64, 128);
    if (rows > 16) {
        _tile_loadd(2, (const char *)sums + 16 * 128, 128);
        _tile_loadd(3, (const char *)sums + 16 * 128 + 64, 128);
    }
}

/* the sum tiles of a block of `rows` rows into sums [32][32] (32-bit values) */
static inline void amx_store_sums(void *sums, int rows) {
    _tile_stored(0, sums, 128);
    _tile_stored(1, (char *)sums + 64, 128);
    if (rows > 16) {
        _tile_stored(2, (char *)sums + 16 * 128, 128);
        _tile_stored(3, (char *)sums + 16 * 128 + 64, 128);
    }
}

/* Bytes of a GEMM's rows that one pass over the weight tiles keeps in the core's L2 beside what it streams: 3/4 of it
 * (see amx_pass_rows). */
static inline int64_t pass_bytes(void) { return kunlun_l2_bytes / 4 * 3; }

/* Rows of X a GEMM takes per pass over its weight tiles: all of them while they fit in pass_bytes(),
 * else the most blocks of 32 that do (at least one). Every weight tile multiplies every block of a pass's rows, so
 * the pass's rows stay in the core's L2 (2 MiB on the AMX Xeons: passes of 1.5 MiB), beside the weight tile, rather
 * than coming back from L3 or memory once per weight tile. On the Xeon with AMX (the 0.5B model's layer GEMMs, 2
 * threads, in turns against one pass): bf16 at 2048 rows 0.76-0.78x the time, at 256-1024 0.96-1.03x; int8 at 2048
 * rows 0.89x, at 1024 0.96x, at 256-512 1.00-1.01x. Passes of 1 MiB took 1.05-1.07x at 256 rows, of 512 KiB
 * 1.08-1.24x at 256-1024. */
static inline int64_t amx_pass_rows(int64_t m, int64_t row_bytes) {
    const int64_t budget = pass_bytes();
    if (m * row_bytes <= budget) return m;
    const int64_t blocks = budget / row_bytes / 32;
    return blocks > 0 ? blocks * 32 : 32;
}

/* Blocks of a pass from which its blocks ask for the next weight tile: a weight tile's step is 2 KiB (32 lines), so a
 * block after the first asks for 32 / (blocks - 1) lines a step, at most 8 from 5 blocks. Each ask holds one of the
 * core's few first-level miss buffers until memory answers, which the tile loads from L2 need too; with fewer blocks
 * (two to four) the weight is better left to the hardware prefetchers (int8 at 96 rows, 16 lines a step: 1.13x the
 * time); one block of more than 16 rows asks for it all (amx_share). */
#define AMX_ASK_BLOCKS 5

/* A block of one row tile (1-16 rows) that asks for nothing of the next tile (amx_share) asks, every other 2 KiB
 * step (once per 4 KiB of weight), for the one line AMX_KICK_BYTES ahead: the hardware prefetchers alone had left a
 * batch-1 step reading its weights at ~84% of the read probe. On the Xeon with AMX (the 0.5B model's
 * layer GEMMs, 2 threads, 9-11 turns, in turns with the code before run twice, whose A/A control read 0.97-1.01; bit
 * for bit the same): bf16 0.94-0.97x the time at 1-16 rows in three runs (the line 4, 8, 32 or 64 KiB ahead alike,
 * but 4 KiB took 1.07x at 16 rows; a line every step 0.95-0.96x), int8 0.97-0.99x (once 1.11x at 16 rows, 0.97x and
 * 0.99x in the other runs); 32 rows (which ask for the whole next tile) as before. STEP: the step's index, W: its
 * weight. */
#define AMX_KICK_BYTES 16384
/* A block of two row tiles (17-32 rows) in a pass of at most AMX_NEAR_BLOCKS blocks (a decode step's 17-64 rows) asks,
 * while it multiplies a step of its weight tile, for the next step (AMX_NEAR_BYTES, 32 lines) into L1: each step's
 * tile loads had waited on L2, and the multiply and that wait overlapped only in part (a 32-row step took 1.2-1.3x
 * the weights' streaming time, a 48-row one 1.8x). On the Xeon with AMX (the 0.5B model's layer GEMMs, 2 threads, 13
 * turns, with the code before run twice, whose A/A control read 0.98-1.01; bit for bit the same): bf16 0.93-0.94x
 * the time at 24-48 rows, 1-16 and 96-256 rows as before; decode steps in the engine, separate processes in turns,
 * 24 rows 51.1-51.5 -> 48.3-48.8 ms, 32 rows 54.6-54.9 -> 52.7-54.5. In passes of more blocks (a prefill's) the ask
 * took 1.08x the time at 96-256 rows, where the blocks after the first find the tile in L2 already and their asks
 * hold the first-level miss buffers their own loads need; int8 blocks (16 groups of 4 a step) read their weight
 * near the memory's rate already, and took 0.98-1.02x, so they do not ask. */
#define AMX_NEAR_BLOCKS 2
#define AMX_NEAR_BYTES 2048
#define AMX_KICK(AHEAD, ROWS, STEP, W, NEAR)                                                          \
    do {                                                                                              \
        if ((AHEAD) == NULL && (ROWS) <= 16 && ((STEP) & 1) == 0)                                     \
            _mm_prefetch((const char *)(W) + AMX_KICK_BYTES, _MM_HINT_T1);                            \
        if ((NEAR) && (ROWS) > 16)                                                                    \
            for (int line_ = 0; line_ < AMX_NEAR_BYTES; line_ += 64)                                  \
                _mm_prefetch((const char *)(W) + AMX_NEAR_BYTES + line_, _MM_HINT_T0);                \
    } while (0)

/* What block `blk` (`rows` rows) of a pass's `blocks` (`rows_bytes` of rows) asks for of the next weight tile (`next`,
 * `bytes` long; NULL after the last tile): its block_share (simd.h). The weight then streams in while the tiles
 * multiply, rather than while the first block of each tile waits on it. Nothing where the pass's rows and two tiles
 * would not fit L2: the next tile would push out rows the blocks still read (the down projection, K = 4864, in passes
 * of 160 rows: 1.04-1.06x the time).
 * On the Xeon with AMX (2 threads, the 0.5B model's layer GEMMs, 7 turns against asking for nothing, with an A/A
 * control beside): bf16 0.91x the time at 160 rows, 0.90x at 256, 0.94x at 1024 (A/A 0.99-1.01), 0.93x at 2048 (A/A
 * 0.95); int8 0.98x at 160-256 (A/A 0.99-1.01), 0.94x at 1024 (0.96), 0.96x at 2048 (0.98); 64 rows (two blocks) as
 * before. A bf16 prefill in the engine 1.05x the tokens a second at 256 and 1024 tokens.
 * A pass of one block of 17-32 rows (a decode step's, both its row tiles) asks for the whole next tile itself: 24-32
 * rows 0.90-0.93x the time in bf16, 0.88-0.90x in int8 (A/A 0.98-1.03); at 1-16 rows (one row tile) 1.03-1.04x in
 * bf16 against an A/A of 1.00-1.02, so those ask for nothing of it (but see AMX_KICK). */
static inline ahead_t amx_share(const void *next, int64_t bytes, int64_t rows_bytes, int64_t blocks, int64_t blk,
                                int rows) {
    if (next == NULL || rows_bytes + 2 * bytes > kunlun_l2_bytes) return (ahead_t){NULL, 0};
    if (blocks == 1 && rows > 16) return (ahead_t){(const char *)next, bytes / 64};
    if (blocks < AMX_ASK_BLOCKS) return (ahead_t){NULL, 0};
    return block_share((const char *)next, bytes / 64, blocks, blk);
}

/* Rows a pass where passes take at most `most` rows (a multiple of 32): as even as blocks of 32 rows let them be, so
 * that no pass is left with a few blocks (1024 rows in passes of 864 had left 160). */
static inline int64_t amx_even_passes(int64_t m, int64_t most) {
    if (most <= 0) return 0;
    if (m <= most) return m;
    const int64_t passes = (m + most - 1) / most;
    return ((m + passes - 1) / passes + 31) / 32 * 32;
}

/* Bytes of the reduction a tile GEMM takes at a time where K is longer (256 bf16 reductions, 512 int8): a weight tile's
 * chunk of 16 KiB stays in L1 while every block of a pass multiplies it, where a whole tile (K = 896: 57 KiB) came
 * from L2 for each; the blocks' sums wait in a buffer between chunks (amx_walk). */
#define AMX_CHUNK_BYTES 512
/* Rows from which a pass takes K in chunks: a weight chunk in L1 saves each block after the first reading it from L2,
 * and costs every block a store and a load of its sums. On the Xeon with AMX (the 0.5B model's layer GEMMs in turns
 * against whole tiles): 0.84-0.88x the time at 192 rows, 0.81-0.83x at 256, 1.01-1.08x at 96-160. */
#define AMX_CHUNK_ROWS 192

/* What amx_walk has a tile GEMM do for one block: rows r0.. (`rows` of them, the layout configured for them and
 * the sums zeroed) of weight tile t, bytes [b0, b0 + bytes) of the reduction; the sums before b0 are in `carry`
 * [32][32] (32-bit), and go back there unless the chunk ends the reduction (where Y is written); asking meanwhile for
 * `lines` lines from `ahead`, and where `near` (a pass of at most AMX_NEAR_BLOCKS blocks) for the weight's next step
 * into L1 (AMX_KICK). */
typedef void (*amx_block_fn)(const void *gemm, int64_t t, int64_t r0, int rows, int64_t b0, int64_t bytes,
                             void *carry, const char *ahead, int64_t lines, int near);

/* How a thread of `team` walks a tile GEMM (amx_walk, below): bytes of the reduction a chunk (all of it: whole tiles),
 * rows a pass, tiles that take a chunk in turn before the next chunk (1: each tile's chunks in turn), and bytes a
 * row of the pass keeps in L2 while the pass multiplies (amx_share). */
typedef struct {
    int64_t chunk, pass, group, room;
} amx_plan_t;

static inline amx_plan_t amx_plan(int64_t m, int64_t tiles, int64_t team, int64_t reduction, int64_t xrow) {
    const int64_t most = (tiles + team - 1) / team, chunks = (reduction + AMX_CHUNK_BYTES - 1) / AMX_CHUNK_BYTES;
    const int64_t chunk = chunks > 1 ? (reduction / chunks + 63) / 64 * 64 : reduction;
    /* rows a pass, whole tiles or each tile's chunks in turn (its rows in half the room: the blocks' sums and the
     * weight's chunks beside them), or chunks across the thread's tiles (their rows of a chunk and sums) */
    const int64_t whole = amx_pass_rows(m, xrow), within = amx_even_passes(m, amx_pass_rows(m, 2 * xrow));
    const int64_t spread = amx_even_passes(m, pass_bytes() / (chunk + most * 32 * 4) / 32 * 32);
    if (chunk < reduction && within >= AMX_CHUNK_ROWS) return (amx_plan_t){chunk, within, 1, xrow};
    if (chunk < reduction && spread >= AMX_CHUNK_ROWS && (m + spread - 1) / spread < (m + whole - 1) / whole)
        return (amx_plan_t){chunk, spread, most, chunk + most * 32 * 4};
    return (amx_plan_t){reduction, whole, 1, xrow};
}

/*
 * A tile GEMM's share of its work, for each thread of the team to call: the thread's run of the `tiles` weight tiles
 * (at `weight`, each `reduction` * 32 bytes), for the M rows of X (`xrow` bytes each), one block of up to 32 rows
 * at a time through `block`. Returns 0, or -1 where a thread had no memory for its sums (then no thread has written
 * anything). From AMX_CHUNK_ROWS rows a reduction longer than AMX_CHUNK_BYTES goes in chunks (amx_plan), in one of
 * two orders:
 *  - each tile's chunks in turn, in passes of rows that fit half of pass_bytes() (the blocks' sums and the weight's
 *    chunks beside them), as even as blocks of 32 rows let them be: the pass's rows stay in L2 over all of K;
 *  - where that cannot give a pass AMX_CHUNK_ROWS rows and would take more passes over the weight, every tile's first
 *    chunk, then every tile's second, in passes whose rows of a chunk and sums of all the thread's tiles fit
 *    pass_bytes(): the down projection (K = 4864) had taken 160 rows a pass, two passes over its weight at 256 rows,
 *    and now takes one.
 * While the blocks after the first multiply a chunk, they ask for the chunk the thread multiplies next (amx_share).
 * On the Xeon with AMX (2 threads, in turns against whole tiles, bit for bit the same): the 0.5B model's layer shapes
 * at 256 rows, a weight per layer, 1.08-1.19x the FLOP/s at K = 896 and 1.47-1.52x for the down projection (1350-1390
 * -> 2040-2080 GFLOP/s); its whole layer GEMMs in bf16 0.81-0.83x the time at 256 rows, 0.90-0.93x at 512, 0.84-0.87x
 * at 1024-2048; in int8 0.95-0.96x at 256, 0.92-0.97x at 2048 and 1.01-1.06x at 1024 (most within the noise of
 * this host). A bf16 prefill in the engine 1.09x the tokens a second at 256 tokens.
 */
static inline __attribute__((always_inline)) int amx_walk(int64_t m, int64_t tiles, int64_t reduction, int64_t xrow,
                                                          const char *weight, amx_block_fn block, const void *gemm,
                                                          int *failed) {
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num(), tile_bytes = reduction * 32;
    const int64_t first = tiles * me / team, last = tiles * (me + 1) / team;
    const amx_plan_t plan = amx_plan(m, tiles, team, reduction, xrow);
    const int64_t chunk = plan.chunk, pass = plan.pass, group = plan.group;
    void *carry = NULL;
    if (chunk < reduction) {
        carry = malloc((size_t)(4096 * ((pass + 31) / 32) * group));
        if (carry == NULL) {
            #pragma omp atomic write
            *failed = 1;
        }
    }
    #pragma omp barrier
    int stop;
    #pragma omp atomic read
    stop = *failed;
    if (stop) {
        free(carry);
        return -1;
    }
    int configured = -1;
    for (int64_t p0 = 0; p0 < m; p0 += pass) {
        const int64_t p1 = m - p0 < pass ? m : p0 + pass, blocks = (p1 - p0 + 31) / 32;
        const int64_t rows_bytes = (p1 - p0) * plan.room;
        for (int64_t g0 = first; g0 < last; g0 += group) {
            const int64_t g1 = last - g0 < group ? last : g0 + group;
            for (int64_t b0 = 0; b0 < reduction; b0 += chunk) {
                const int64_t bytes = reduction - b0 < chunk ? reduction - b0 : chunk;
                for (int64_t t = g0; t < g1; t++) {
                    int64_t next_bytes;
                    const char *next = next_chunk(weight, tile_bytes, 32, t, g0, g1, first, last, b0, bytes,
                                                  reduction, chunk, p1 < m, &next_bytes);
                    for (int64_t r0 = p0; r0 < p1; r0 += 32) {
                        const int rows = p1 - r0 < 32 ? (int)(p1 - r0) : 32;
                        const ahead_t ahead =
                            amx_share(next, next_bytes * 32, rows_bytes, blocks, (r0 - p0) / 32, rows);
                        amx_start_block(rows, &configured);
                        block(gemm, t, r0, rows, b0, bytes,
                              carry ? (char *)carry + ((t - g0) * blocks + (r0 - p0) / 32) * 4096 : NULL, ahead.from,
                              ahead.lines, blocks <= AMX_NEAR_BLOCKS);
                    }
                }
            }
        }
    }
    free(carry);
    return 0;
}

/* one step of the reduction: tile loads of X at (row block, step) with row stride LDX bytes and of the weight's
 * step W (stride 128), then DOT(sum, x, w) for each block and half */
#define AMX_STEP(DOT, X, LDX, W, TWO)                                                                          \
    do {                                                                                                      \
        _tile_loadd(6, (W), 128);                                                                             \
        _tile_loadd(7, (const char *)(W) + 64, 128);                                                         \
        _tile_loadd(4, (X), (LDX));                                                                           \
        DOT(0, 4, 6);                                                                                         \
        DOT(1, 4, 7);                                                                                         \
        if (TWO) {                                                                                            \
            _tile_loadd(5, (const char *)(X) + 16 * (LDX), (LDX));                                            \
            DOT(2, 5, 6);                                                                                     \
            DOT(3, 5, 7);                                                                                     \
        }                                                                                                     \
    } while (0)

/* What the attention kernels on the tiles (paged_prefill_attention.c, paged_decode_attention.c) share */

/* bf16 pairs (lo[i], hi[i]), lo in the low half: the B-tile rows of the probabilities of two consecutive keys */
INLINE __m512i probability_pairs(__m512 lo, __m512 hi) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

#endif
#endif
