/*
 * What the AMX GEMMs (gemm_bf16.c, gemm_int8.c) share: the tile state the OS must grant, and one tile layout.
 *
 * Both multiply a packed weight whose tile of 32 outputs keeps, per step of the reduction, 32 outputs x 4
 * bytes side by side (bf16 pairs or int8 quads): two AMX B tiles with a 128-byte stride, outputs 0-15 and
 * 16-31, 16 rows of 64 bytes each. Tiles 0-3 hold the sums (row block i, output half j at 2 * i + j), 4 and
 * 5 two blocks of up to 16 rows of X, 6 and 7 the weight's halves. Part of the build's cache key.
 */
#ifndef KUNLUN_AMX_H
#define KUNLUN_AMX_H

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <stdint.h>
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

/* the sum tiles of a full layout (32 rows) from sums [32][32] (32-bit values), to add to them */
static inline void amx_load_sums(const void *sums) {
    _tile_loadd(0, sums, 128);
    _tile_loadd(1, (const char *)sums + 64, 128);
    _tile_loadd(2, (const char *)sums + 16 * 128, 128);
    _tile_loadd(3, (const char *)sums + 16 * 128 + 64, 128);
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
 * the weight is better left to the hardware prefetchers (int8 at 96 rows, 16 lines a step: 1.13x the time). */
#define AMX_ASK_BLOCKS 5

/* What block `blk` of a pass's `blocks` (`rows_bytes` of rows) asks for of the next weight tile (`next`, `bytes` long;
 * NULL after the last tile): its block_share (simd.h). The weight then streams in while the tiles multiply, rather
 * than while the first block of each tile waits on it. Nothing where the pass's rows and two tiles would not fit L2:
 * the next tile would push out rows the blocks still read (the down projection, K = 4864, in passes of 160 rows:
 * 1.04-1.06x the time).
 * On the Xeon with AMX (2 threads, the 0.5B model's layer GEMMs, 7 turns against asking for nothing, with an A/A
 * control beside): bf16 0.91x the time at 160 rows, 0.90x at 256, 0.94x at 1024 (A/A 0.99-1.01), 0.93x at 2048 (A/A
 * 0.95); int8 0.98x at 160-256 (A/A 0.99-1.01), 0.94x at 1024 (0.96), 0.96x at 2048 (0.98); 64 rows (two blocks) as
 * before. A bf16 prefill in the engine 1.05x the tokens a second at 256 and 1024 tokens. */
static inline ahead_t amx_share(const void *next, int64_t bytes, int64_t rows_bytes, int64_t blocks, int64_t blk) {
    if (next == NULL || blocks < AMX_ASK_BLOCKS || rows_bytes + 2 * bytes > kunlun_l2_bytes) return (ahead_t){NULL, 0};
    return block_share((const char *)next, bytes / 64, blocks, blk);
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

#endif
#endif
