/* cpu_linear.c's tiles for AVX2 + FMA (8 fp32 lanes, 16 registers): a group's 16 columns are two vectors, and
 * every packed format is widened straight into registers, dequantized there (w = d q + m, as the panels do) and
 * multiplied by broadcast x, with no round trip through memory.
 *
 * A tile is R rows by C vectors of columns (C = 2: the whole group; C = 1: one half, run twice), with S sets of
 * accumulators taking even and odd k in turn: R * C * S chains of FMAs, at least 8 where the rows allow (two FMA
 * pipes of 4 cycles' latency), at most 12 so that weights, scales and a broadcast still fit in registers. The
 * weights of a block are read straight from the packing, so one row costs one pass over them, and R rows share
 * each widening. From 8 rows on each block is widened once into L1 and tiles of 4-6 rows by
 * all 16 columns read it there instead (q4_1 at 128 rows over the built-in model's qkv, gate/up and down, 2
 * threads, AVX2 cap on an EPYC: 7.1-7.6 -> 5.1-5.8 ms, as fast as MKL's fp32 GEMM on fp32 weights).
 * 4-bit and Q8_0 blocks at one row (row8_raw) and from 8 rows on are not dequantized a weight at a time: x meets
 * the quants as they are (4-bit: in the pairs pair_x writes), and each block's sums are scaled once. From
 * PANEL8_ROWS rows (PANEL8_ROWS_Q4 for 4-bit blocks; a prompt) each group is dequantized whole into an fp32 panel
 * once and tiles of 6 rows keep their sums in registers over all of K (panel_rows8): at 128 rows, the built-in
 * model's layer shapes, 2 threads, Sapphire Rapids under the AVX2 cap, q4_1 4.91-4.93 -> 4.06 ms, bf16 4.55 ->
 * 4.12, the same as MKL's fp32 GEMM on fp32 weights (4.2-4.3 in the same run), and ahead of dequantizing for it
 * up to 512 rows (16.7 vs 17.7 ms).
 * Included by cpu_linear.c, which defines the formats, G, KB and PREFETCH. */
#include <immintrin.h>

#ifndef TILE8_BLOCK_ROWS
#define TILE8_BLOCK_ROWS 8 /* from this many rows on each block is widened once into L1 for all of them */
#endif

/* A block's scales for columns h*8 .. h*8+7: d, and m (q4_0: -8 d). */
static inline __attribute__((always_inline)) void scales8(const int fmt, const uint8_t *blk, int h, __m256 *d,
                                                          __m256 *m) {
    if (fmt == F32 || fmt == BF16) return;
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + h * 16)));
    if (fmt == Q4_1)
        *m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + h * 16)));
    else if (fmt == Q4_0)
        *m = _mm256_mul_ps(*d, _mm256_set1_ps(-8.0f));
}

/* The bytes (k/2, h*8 .. h*8+7) of a 4-bit block (k even), one to a 32-bit lane: k in the low nibble, k + 1 high. */
static inline __attribute__((always_inline)) __m256i bytes8(const int fmt, const uint8_t *blk, int k, int h) {
    const uint8_t *p = blk + (fmt == Q4_1 ? 64 : 32) + (k / 2) * G + h * 8;
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* Rows k and k + 1 (k even) of a 4-bit or Q8_0 block, columns h*8 .. h*8+7, as the quants are (not scaled). */
static inline __attribute__((always_inline)) void raw8(const int fmt, const uint8_t *blk, int k, int h, __m256 *w0,
                                                       __m256 *w1) {
    if (fmt == Q8_0) {
        const uint8_t *p = blk + 32 + k * G + h * 8;
        *w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
        *w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + G))));
        return;
    }
    const __m256i v = bytes8(fmt, blk, k, h);
    *w0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    *w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}

/* Rows k and k + 1 (k even) of a 4-bit block, columns h*8 .. h*8+7, as x in pair_x's pairs meets them: the low
 * nibble, and the whole byte (16 hi + lo). */
static inline __attribute__((always_inline)) void pair8(const int fmt, const uint8_t *blk, int k, int h, __m256 *lo,
                                                        __m256 *byte) {
    const __m256i v = bytes8(fmt, blk, k, h);
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))), *byte = _mm256_cvtepi32_ps(v);
}

/* Rows k and k + 1 (k even) of a block, columns h*8 .. h*8+7, dequantized. */
static inline __attribute__((always_inline)) void widen8(const int fmt, const uint8_t *blk, int k, int h, __m256 d,
                                                         __m256 m, __m256 *w0, __m256 *w1) {
    switch (fmt) {
    case F32: {
        const float *p = (const float *)blk + k * G + h * 8;
        *w0 = _mm256_loadu_ps(p), *w1 = _mm256_loadu_ps(p + G);
        return;
    }
    case BF16: {
        const uint16_t *p = (const uint16_t *)blk + k * G + h * 8;
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
        *w1 = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + G))), 16));
        return;
    }
    case Q8_0:
        raw8(fmt, blk, k, h, w0, w1);
        *w0 = _mm256_mul_ps(d, *w0), *w1 = _mm256_mul_ps(d, *w1);
        return;
    default:
        raw8(fmt, blk, k, h, w0, w1);
        *w0 = _mm256_fmadd_ps(d, *w0, m), *w1 = _mm256_fmadd_ps(d, *w1, m);
    }
}

/* acc[r][h*8 ..] (+)= sum_k x[r][k] w[k][h*8 ..] over the group for R rows and columns h0*8 .. (h0 + C)*8 - 1. */
static inline __attribute__((always_inline)) void tile8(const int fmt, const uint8_t *blk, int64_t bb, int64_t nb,
                                                        const float *x, int64_t ldx, const int R, const int C,
                                                        const int S, int h0, int64_t K, float *acc) {
    __m256 a[8][2][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            for (int s = 0; s < S; s++) a[r][c][s] = _mm256_setzero_ps();
    float tail[8][KB];
    for (int64_t b = 0; b < nb; b++, blk += bb) {
        const int kn = K - b * KB < KB ? (int)(K - b * KB) : KB;
        const float *xb = x + b * KB;
        int64_t ld = ldx;
        if (kn < KB) { /* K ends inside this block: the missing x are 0 (the packing's padding is finite) */
            memset(tail, 0, sizeof tail);
            for (int r = 0; r < R; r++) memcpy(tail[r], xb + r * ldx, sizeof(float) * kn);
            xb = tail[0], ld = KB;
        }
        if (h0 == 0)
            for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + PREFETCH + off);
        __m256 d[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, m[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int c = 0; c < C; c++) scales8(fmt, blk, h0 + c, &d[c], &m[c]);
#pragma GCC unroll 2
        for (int k = 0; k < KB; k += 2) {
            __m256 w0[2], w1[2];
            for (int c = 0; c < C; c++) widen8(fmt, blk, k, h0 + c, d[c], m[c], &w0[c], &w1[c]);
            for (int r = 0; r < R; r++) {
                const __m256 x0 = _mm256_broadcast_ss(xb + r * ld + k);
                const __m256 x1 = _mm256_broadcast_ss(xb + r * ld + k + 1);
                for (int c = 0; c < C; c++) {
                    a[r][c][0] = _mm256_fmadd_ps(x0, w0[c], a[r][c][0]);
                    a[r][c][S - 1] = _mm256_fmadd_ps(x1, w1[c], a[r][c][S - 1]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            _mm256_storeu_ps(acc + r * G + (h0 + c) * 8, S == 2 ? _mm256_add_ps(a[r][c][0], a[r][c][1]) : a[r][c][0]);
}

/* One row's x as row8_raw reads it against 4-bit bytes: per pair k = 2p, 2p + 1, x_2p - x_2p+1 / 16 (which the low
 * nibble multiplies) and x_2p+1 / 16 (which the whole byte, 16 hi + lo, multiplies), so that the byte needs no shift:
 * x_2p lo + x_2p+1 hi = (x_2p - x_2p+1 / 16) lo + (x_2p+1 / 16) (16 hi + lo). The division by 16 is exact; the
 * difference rounds once, as one more fp32 addition would. K is padded with zeros to whole blocks. */
static void pair_x(const float *x, int64_t K, int64_t nb, float *xp) {
    for (int64_t k = 0; k < nb * KB; k += 2) {
        const float x0 = k < K ? x[k] : 0, x1 = k + 1 < K ? x[k + 1] * 0.0625f : 0;
        xp[k] = x0 - x1, xp[k + 1] = x1;
    }
}

/* One row against a group of 4-bit or Q8_0 blocks: x times the quants as they are, each block's sums then scaled
 * once, acc += d * sum(x q) + m * sum(x) (xs: the row's block sums of x; 4-bit only, with x as pair_x wrote it). At
 * one row the FP pipes' instructions set the pace, not the FMAs' latency or the memory: per pair of k and 8
 * columns a widening, an and, two conversions and two FMAs (without pair_x a shift more), and eight accumulators so
 * that no FMA waits on the one before (q4_1, 1536 x 576 in L2, 1 thread, AVX2 cap on a Zen 5 EPYC: 34 -> 28 us).
 * acc[0 .. 15]. */
static inline __attribute__((always_inline)) void row8_raw(const int fmt, const uint8_t *blk, int64_t bb, int64_t nb,
                                                           const float *x, const float *xs, int64_t K, float *acc) {
    __m256 t[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    float tail[KB];
    for (int64_t b = 0; b < nb; b++, blk += bb) {
        const float *xb = x + b * KB;
        if (fmt == Q8_0 && K - b * KB < KB) { /* K ends inside this block: the missing x are 0 */
            memset(tail, 0, sizeof tail);
            memcpy(tail, xb, sizeof(float) * (K - b * KB));
            xb = tail;
        }
        for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + PREFETCH + off);
        __m256 a[2][4]; /* [column half][k pair's parity, then k's] */
        for (int c = 0; c < 2; c++)
            for (int s = 0; s < 4; s++) a[c][s] = _mm256_setzero_ps();
#pragma GCC unroll 16
        for (int k = 0; k < KB; k += 2) {
            const int s = k & 2;
            __m256 w0[2], w1[2];
            for (int c = 0; c < 2; c++)
                if (fmt == Q8_0)
                    raw8(fmt, blk, k, c, &w0[c], &w1[c]);
                else
                    pair8(fmt, blk, k, c, &w0[c], &w1[c]);
            const __m256 x0 = _mm256_broadcast_ss(xb + k), x1 = _mm256_broadcast_ss(xb + k + 1);
            for (int c = 0; c < 2; c++)
                a[c][s] = _mm256_fmadd_ps(x0, w0[c], a[c][s]), a[c][s + 1] = _mm256_fmadd_ps(x1, w1[c], a[c][s + 1]);
        }
        for (int c = 0; c < 2; c++) {
            __m256 d, m = _mm256_setzero_ps();
            scales8(fmt, blk, c, &d, &m);
            const __m256 sum = _mm256_add_ps(_mm256_add_ps(a[c][0], a[c][1]), _mm256_add_ps(a[c][2], a[c][3]));
            t[c] = _mm256_fmadd_ps(d, sum, t[c]);
            if (fmt != Q8_0) t[c] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs + b), t[c]);
        }
    }
    _mm256_storeu_ps(acc, t[0]), _mm256_storeu_ps(acc + 8, t[1]);
}

/* a[r][h] += sum_{k < K} x[r][k] w[k][h*8 .. h*8+7] for R <= 6 rows, w fp32 [K][16] (32-byte aligned rows): per k two
 * loads of w and R broadcasts for 2R FMAs. */
static inline __attribute__((always_inline)) void fma_rows16(const float *w, int64_t K, const float *x, int64_t ldx,
                                                             const int R, __m256 a[6][2]) {
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; k++) {
        const __m256 w0 = _mm256_load_ps(w + k * G), w1 = _mm256_load_ps(w + k * G + 8);
        for (int r = 0; r < R; r++) {
            const __m256 xr = _mm256_broadcast_ss(x + r * ldx + k);
            a[r][0] = _mm256_fmadd_ps(xr, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xr, w1, a[r][1]);
        }
    }
}

/* acc[r][0 .. 15] += sum_k x[r][k] w[k][0 .. 15] over one block already widened to fp32 (w [32][16]), R <= 6
 * rows: 2R accumulators, and per k two loads of w and R broadcasts for 2R FMAs (an 8 x 8 tile needed nine loads
 * for eight FMAs: the load ports, not the FMA pipes, set its pace). With `raw` the block holds its quants as they
 * are, and the sums are scaled once: acc += d * sum, + m * xs[r * nb] for 4-bit blocks (raw 1: as pair_x's x meets
 * them, low nibble and whole byte); raw 2 is Q8_0's. */
static inline __attribute__((always_inline)) void tile16_block(const float *w, const float *x, int64_t ldx,
                                                               const int R, float *acc, const int raw,
                                                               const __m256 *d, const __m256 *m, const float *xs,
                                                               int64_t nb) {
    __m256 a[6][2];
    for (int r = 0; r < R; r++)
        if (raw)
            a[r][0] = a[r][1] = _mm256_setzero_ps();
        else
            a[r][0] = _mm256_loadu_ps(acc + r * G), a[r][1] = _mm256_loadu_ps(acc + r * G + 8);
    fma_rows16(w, KB, x, ldx, R, a);
    for (int r = 0; r < R; r++) {
        if (raw)
            for (int h = 0; h < 2; h++) {
                const __m256 before = _mm256_loadu_ps(acc + r * G + h * 8);
                const __m256 offset =
                    raw == 1 ? _mm256_fmadd_ps(m[h], _mm256_broadcast_ss(xs + r * nb), before) : before;
                a[r][h] = _mm256_fmadd_ps(d[h], a[r][h], offset);
            }
        _mm256_storeu_ps(acc + r * G, a[r][0]), _mm256_storeu_ps(acc + r * G + 8, a[r][1]);
    }
}

/* One group for 8 or more rows: each block is widened once into L1 for all of them (the widening then costs one
 * vector per R FMAs however many tiles of 8 rows there are); acc[rows][16]. 4-bit blocks are widened as their
 * quants are, against x as pair_x wrote it (xp, nb * KB a row; xs the block sums): no shift and no dequantizing
 * FMA a weight, the scales applied once a block and row (q4_1 at 8 rows, the built-in model's layers, 2 threads,
 * AVX2 cap on a Zen 5 EPYC: 14.2-15.4 -> 13.4-14.0 ms; at 32 rows, where one widening serves 32, no change). Q8_0
 * is widened as its quants are too, and scaled once a block and row. Every format takes this path from 8 rows (it
 * was 16 for bf16 and Q8_0): at 12 rows, the built-in model's four layer shapes in cache, 2 threads, Sapphire
 * Rapids under the AVX2 cap, bf16 547-569 -> 494-513 us and Q8_0 576-592 -> 503-504; at 8 rows no change. */
static inline __attribute__((always_inline)) void group8_blocks_fmt(const int fmt, const uint8_t *blk, int64_t bb,
                                                                    int64_t nb, const float *x, int64_t ldx,
                                                                    int rows, int64_t K, const float *xs,
                                                                    const float *xp, float *acc) {
    float w[KB * G] __attribute__((aligned(32)));
    const int raw = fmt == Q4_0 || fmt == Q4_1 ? 1 : fmt == Q8_0 ? 2 : 0;
    memset(acc, 0, sizeof(float) * rows * G);
    for (int64_t b = 0; b < nb; b++, blk += bb) {
        const int kn = K - b * KB < KB ? (int)(K - b * KB) : KB;
        for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + PREFETCH + off);
        __m256 d[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, m[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int h = 0; h < 2; h++) {
            scales8(fmt, blk, h, &d[h], &m[h]);
            for (int k = 0; k < KB; k += 2) {
                __m256 w0, w1;
                if (raw == 1)
                    pair8(fmt, blk, k, h, &w0, &w1);
                else if (raw == 2)
                    raw8(fmt, blk, k, h, &w0, &w1);
                else
                    widen8(fmt, blk, k, h, d[h], m[h], &w0, &w1);
                _mm256_store_ps(w + k * G + h * 8, w0), _mm256_store_ps(w + (k + 1) * G + h * 8, w1);
            }
        }
        if (raw != 1 && kn < KB) /* K ends inside this block: weights past it meet no x (xp's are 0 there) */
            memset(w + kn * G, 0, sizeof(float) * (KB - kn) * G);
        const int tiles = (rows + 5) / 6; /* as even as they go: 8 rows are two of 4, not 6 and a slow 2 */
        for (int t = 0, r0 = 0; t < tiles; t++) {
            const int R = (rows - r0) / (tiles - t);
            float tail[6][KB];
            const float *xb = raw == 1 ? xp + r0 * nb * KB + b * KB : x + r0 * ldx + b * KB;
            int64_t ld = raw == 1 ? nb * KB : ldx;
            if (raw != 1 && kn < KB) { /* and x has no values there to read */
                memset(tail, 0, sizeof tail);
                for (int r = 0; r < R; r++) memcpy(tail[r], xb + r * ldx, sizeof(float) * kn);
                xb = tail[0], ld = KB;
            }
            const float *xsb = raw == 1 ? xs + r0 * nb + b : NULL;
            switch (R) { /* 4 to 6: this path takes 8 rows or more */
            case 4: tile16_block(w, xb, ld, 4, acc + r0 * G, raw, d, m, xsb, nb); break;
            case 5: tile16_block(w, xb, ld, 5, acc + r0 * G, raw, d, m, xsb, nb); break;
            default: tile16_block(w, xb, ld, 6, acc + r0 * G, raw, d, m, xsb, nb);
            }
            r0 += R;
        }
    }
}

/* acc[r][0 .. 15] = sum_k x[r][k] p[k][0 .. 15] for R <= 6 rows over a group's whole weight as an fp32 panel
 * [K][16] (decode_panel): 2R accumulators held across all of K, so a prompt's rows pay no block's epilogue (the
 * block tiles load, scale and store their sums every 32 k). */
static inline __attribute__((always_inline)) void panel_tile(const float *p, int64_t K, const float *x, int64_t ldx,
                                                             const int R, float *acc) {
    __m256 a[6][2];
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    fma_rows16(p, K, x, ldx, R, a);
    for (int r = 0; r < R; r++) _mm256_storeu_ps(acc + r * G, a[r][0]), _mm256_storeu_ps(acc + r * G + 8, a[r][1]);
}

/* Any number of rows against a group's fp32 panel, in tiles as even as they go of at most 6; acc[rows][16]. */
static void panel_rows8(const float *p, int64_t K, const float *x, int64_t ldx, int rows, float *acc) {
    const int tiles = (rows + 5) / 6;
    for (int t = 0, r0 = 0; t < tiles; t++) {
        const int R = (rows - r0) / (tiles - t);
        const float *xr = x + r0 * ldx;
        float *ar = acc + r0 * G;
        switch (R) {
        case 1: panel_tile(p, K, xr, ldx, 1, ar); break;
        case 2: panel_tile(p, K, xr, ldx, 2, ar); break;
        case 3: panel_tile(p, K, xr, ldx, 3, ar); break;
        case 4: panel_tile(p, K, xr, ldx, 4, ar); break;
        case 5: panel_tile(p, K, xr, ldx, 5, ar); break;
        default: panel_tile(p, K, xr, ldx, 6, ar);
        }
        r0 += R;
    }
}

/* One group for any number of rows: acc[rows][16]. Every tile keeps two accumulators a column (even and odd k),
 * so a row's sums run in one order whatever the number of rows beside it (speculative decoding checks guesses as
 * rows of one step and must pick what a one-row step picks). Up to 4 rows go in tiles of 2 taking both column
 * halves at once; more in tiles as even as they go of at most 6 rows, a column half at a time (6 rows x 2
 * accumulators fill 12 registers). Under the AVX2 cap on a Zen 4 (alternated runs) the built-in model's decode
 * steps of 3-7 rows measured within run-to-run noise of the one-accumulator tiles this replaced (a cap: an AVX2 core
 * was not at hand). */
static inline __attribute__((always_inline)) void group8_fmt(const int fmt, const uint8_t *blk, int64_t bb,
                                                             int64_t nb, const float *x, int64_t ldx, int rows,
                                                             int64_t K, float *acc) {
    if (rows <= 4) {
        for (int r0 = 0; r0 < rows; r0 += 2) {
            if (rows - r0 == 1)
                tile8(fmt, blk, bb, nb, x + r0 * ldx, ldx, 1, 2, 2, 0, K, acc + r0 * G);
            else
                tile8(fmt, blk, bb, nb, x + r0 * ldx, ldx, 2, 2, 2, 0, K, acc + r0 * G);
        }
        return;
    }
    const int tiles = (rows + 5) / 6;
    for (int t = 0, r0 = 0; t < tiles; t++) {
        const int R = (rows - r0) / (tiles - t);
        const float *xr = x + r0 * ldx;
        float *ar = acc + r0 * G;
        for (int h = 0; h < 2; h++) switch (R) {
            case 1: tile8(fmt, blk, bb, nb, xr, ldx, 1, 1, 2, h, K, ar); break;
            case 2: tile8(fmt, blk, bb, nb, xr, ldx, 2, 1, 2, h, K, ar); break;
            case 3: tile8(fmt, blk, bb, nb, xr, ldx, 3, 1, 2, h, K, ar); break;
            case 4: tile8(fmt, blk, bb, nb, xr, ldx, 4, 1, 2, h, K, ar); break;
            case 5: tile8(fmt, blk, bb, nb, xr, ldx, 5, 1, 2, h, K, ar); break;
            default: tile8(fmt, blk, bb, nb, xr, ldx, 6, 1, 2, h, K, ar);
            }
        r0 += R;
    }
}

/* One group for any number of rows; acc[rows][16]. xs and xp: the rows' block sums of x and their pair_x (4-bit, for
 * one row and from 8 rows on). */
static void group8(int fmt, const uint8_t *blk, int64_t bb, int64_t nb, const float *x, int64_t ldx, int rows,
                   int64_t K, const float *xs, const float *xp, float *acc) {
    const int q4 = fmt == Q4_0 || fmt == Q4_1;
    if (rows == 1 && (q4 ? xs && xp : fmt == Q8_0)) switch (fmt) {
        case Q8_0: row8_raw(Q8_0, blk, bb, nb, x, xs, K, acc); return;
        case Q4_0: row8_raw(Q4_0, blk, bb, nb, xp, xs, K, acc); return;
        default: row8_raw(Q4_1, blk, bb, nb, xp, xs, K, acc); return;
        }
    if (fmt != F32 && rows >= TILE8_BLOCK_ROWS && (!q4 || (xs && xp))) switch (fmt) {
        case BF16: group8_blocks_fmt(BF16, blk, bb, nb, x, ldx, rows, K, xs, xp, acc); return;
        case Q8_0: group8_blocks_fmt(Q8_0, blk, bb, nb, x, ldx, rows, K, xs, xp, acc); return;
        case Q4_0: group8_blocks_fmt(Q4_0, blk, bb, nb, x, ldx, rows, K, xs, xp, acc); return;
        default: group8_blocks_fmt(Q4_1, blk, bb, nb, x, ldx, rows, K, xs, xp, acc); return;
        }
    switch (fmt) {
    case F32: group8_fmt(F32, blk, bb, nb, x, ldx, rows, K, acc); break;
    case BF16: group8_fmt(BF16, blk, bb, nb, x, ldx, rows, K, acc); break;
    case Q8_0: group8_fmt(Q8_0, blk, bb, nb, x, ldx, rows, K, acc); break;
    case Q4_0: group8_fmt(Q4_0, blk, bb, nb, x, ldx, rows, K, acc); break;
    default: group8_fmt(Q4_1, blk, bb, nb, x, ldx, rows, K, acc);
    }
}
