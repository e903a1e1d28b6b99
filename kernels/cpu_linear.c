/* Weight-only linear layers: y[M,N] = x[M,K] . W[N,K]^T (+ bias), x and y fp32 or bf16, W packed
 * (kernels/quant_linear.py writes the packing) as fp32, bf16, Q8_0, Q4_0 or Q4_1 blocks.
 *
 * Q8_0 and 4-bit blocks also have packings for integer products with int8 activations: cpu_linear_q8.h.
 *
 * Packing: output columns in groups of 16, the reduction dimension in blocks of 32; each (group, block) is one
 * contiguous run of bytes, groups one after another, so a thread streams its groups' weights once per call.
 *   f32:  float  w[32][16]                         bf16: uint16 w[32][16]
 *   q8_0: fp16 d[16], int8 q[32][16]               (w = d q)
 *   q4_0: fp16 d[16], 256 bytes of quants           (w = d (q - 8))
 *   q4_1: fp16 d[16], fp16 m[16], 256 bytes of quants  (w = d q + m)
 * A 4-bit block's quants are laid out for the vector width (features() says which, quant_linear.pack writes it):
 *   bytes (AVX2, portable): uint8 q[16][16], byte [p][c] holds column c's k = 2p low, k = 2p + 1 high;
 *   chunks (AVX-512): uint16 q[4][16][2], word [j][c][s] holds column c's k = 8j + 2i + s in nibble i. One 64-byte
 *   load, shifted by 4i, then holds the pairs k = 2p, 2p + 1 (p = 4j + i) of all 16 columns in 32-bit lanes, and
 *   one table lookup makes them bf16 pairs for vdpbf16ps, with no widening of a byte per (p, column) first (one
 *   row of q4_1, 1024 x 576 in L2, 1 thread: 24 -> 18 us). Over 8 lanes that widening costs less than the
 *   shifts would, so AVX2 keeps bytes.
 *
 * (AVX2 builds run the tiles of cpu_linear_avx2.h instead of the three paths below.)
 * By rows of x: up to 3 rows stream each block straight into the products, scales applied once per block
 * (sum_k x_k (d q_k + m) = d sum_k x_k q_k + m sum_k x_k); 4 to 7 rows decode each block once for all of them;
 * from 8 rows on a group is dequantized whole into a panel and tiled over with accumulators kept in registers
 * across K (two groups per tile on AVX-512). Every path is the fp32 product of the dequantized weights up to the
 * order of fp32 summation.
 *
 * Vectors are as wide as the -march the library is built for (kernels/cpu_isa.py): 16 lanes on AVX-512, 8 on
 * AVX2, 4 on SSE2, so every level keeps its accumulators in registers; the widening of packed values has its
 * own intrinsics per level, since compilers do not vectorise those conversions from generic code. Returns 0, -1
 * on bad arguments, -2 out of memory.
 */
#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#if defined(__AVX512F__)
#define VL 16
#define Q4_CHUNKS 1 /* the 4-bit quants' layout: chunks (1) or bytes (0), as above */
#elif defined(__AVX__)
#define VL 8
#define Q4_CHUNKS 0
#else
#define VL 4
#define Q4_CHUNKS 0
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef _Float16 v16h __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));

enum { F32 = 0, BF16 = 1, Q8_0 = 2, Q4_0 = 3, Q4_1 = 4, BF16_ROWS = 5 };
#define G 16
#define NV (G / VL) /* vectors per group row */
#define RT (8 / NV) /* rows per register tile: 8 accumulators cover the FMA latency */
#define KB 32
#define MT 64
#ifndef PANEL_ROWS
#define PANEL_ROWS 8 /* from this many rows on, a group is dequantized whole once and tiled over */
#endif
#ifndef PANEL8_ROWS
/* the same for AVX2's tiles (cpu_linear_avx2.h), 4-bit blocks from 32: below, the block tiles are faster (bf16
 * weights streamed from memory at 32 rows, 2 threads, Sapphire Rapids under the AVX2 cap: blocks 37.7 ms for 212 MB,
 * panels 41.0; q4_1 the other way, 37.7 and 35.0) */
#define PANEL8_ROWS 64
#define PANEL8_ROWS_Q4 32
#endif
/* from this many bf16 rows on (Q8_0, 4-bit), vdpbf16ps tiles read each block's bf16 pairs from L1: Q8_0's pairs
 * cost twice the instructions of a nibble lookup, so turning them over once pays from fewer rows */
#ifndef DP_WIDE_ROWS_Q8
#define DP_WIDE_ROWS_Q8 9
#endif
#ifndef DP_WIDE_ROWS_Q4
#define DP_WIDE_ROWS_Q4 32
#endif
/* bf16 rows stream their weights 16 KiB ahead into L2 (prefetcht1): at 4 KiB into L1, a core with 4-8 rows of
 * dot products to do per line kept too few lines in flight, and the step took compute time plus memory time
 * (bf16 layers at 8 rows 14.8 -> 11.0 ms, at 1 row 12.4 -> 10.0 ms in one run; the 4-bit paths, bound by
 * their own instructions, did not gain). */
#ifndef PF_LOC
#define PF_LOC 2
#endif
#ifndef ROWS_PREFETCH
#define ROWS_PREFETCH 16384
#endif
#ifndef PREFETCH
#define PREFETCH 4096 /* bytes ahead: what keeps enough lines in flight for one core to stream at the memory's pace */
#endif

int64_t block_nbytes(int fmt) {
    switch (fmt) {
    case F32: return KB * G * 4;
    case BF16: return KB * G * 2;
    case Q8_0: return G * 2 + KB * G;
    case Q4_0: return G * 2 + KB * G / 2;
    case Q4_1: return G * 4 + KB * G / 2;
    case 6: return G * 2 + KB * G; /* the Q8-activation packings of cpu_linear_q8.h: Q8_0, Q4_0, Q4_1 */
    case 7: return G * 2 + KB * G / 2;
    case 8: return G * 4 + KB * G / 2;
    }
    return -1;
}

static inline vf ldv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void stv(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* 16 fp16 scales as fp32. */
static inline void load_h(const void *p, float *out) {
#if defined(__AVX512F__)
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)));
#elif defined(__F16C__)
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)));
    _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p + 1)));
#else
    v16h h;
    memcpy(&h, p, sizeof h);
    v16f f = __builtin_convertvector(h, v16f);
    memcpy(out, &f, sizeof f);
#endif
}

static inline void widen_s8(const uint8_t *p, float *out) {
#if defined(__AVX512F__)
    _mm512_storeu_ps(out, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))));
#elif defined(__AVX2__)
    __m128i q = _mm_loadu_si128((const __m128i *)p);
    _mm256_storeu_ps(out, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    _mm256_storeu_ps(out + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))));
#else
    for (int c = 0; c < G; c++) out[c] = (float)(int8_t)p[c];
#endif
}

/* Rows k = 2p (lo_out) and 2p + 1 (hi_out) of a 4-bit block's quants `qs`, 16 columns each. */
static inline void widen_nibbles(const uint8_t *qs, int p, float *lo_out, float *hi_out) {
#if Q4_CHUNKS /* nibble p % 4 of 32-bit lane c's low and high halves, in chunk p / 4 */
    const __m512i v = _mm512_loadu_si512(qs + (p / 4) * 64), mask = _mm512_set1_epi32(15);
    const int sh = 4 * (p % 4);
    _mm512_storeu_ps(lo_out, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, sh), mask)));
    _mm512_storeu_ps(hi_out, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 16 + sh), mask)));
#elif defined(__AVX2__)
    const __m128i mask = _mm_set1_epi8(15);
    __m128i q = _mm_loadu_si128((const __m128i *)(qs + p * 16));
    __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    _mm256_storeu_ps(lo_out, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
    _mm256_storeu_ps(lo_out + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
    _mm256_storeu_ps(hi_out, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
    _mm256_storeu_ps(hi_out + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))));
#else
    const uint8_t *b = qs + p * 16;
    for (int c = 0; c < G; c++) lo_out[c] = (float)(b[c] & 15), hi_out[c] = (float)(b[c] >> 4);
#endif
}

static inline void widen_bf16(const uint8_t *p, float *out) {
#if defined(__AVX512F__)
    __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    _mm512_storeu_ps(out, _mm512_castsi512_ps(u));
#elif defined(__AVX2__)
    __m128i a = _mm_loadu_si128((const __m128i *)p), b = _mm_loadu_si128((const __m128i *)p + 1);
    _mm256_storeu_ps(out, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)));
    _mm256_storeu_ps(out + 8, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)));
#else
    uint32_t u[G];
    for (int c = 0; c < G; c++) u[c] = (uint32_t)((const uint16_t *)p)[c] << 16;
    memcpy(out, u, sizeof u);
#endif
}

/* Row k (0..31) of a block as 16 fp32 values: unscaled quants for the quantized formats. */
static inline void widen_row(int fmt, const uint8_t *b, int k, float *out) {
    switch (fmt) {
    case F32: memcpy(out, b + k * 64, 64); return;
    case BF16: widen_bf16(b + k * 32, out); return;
    case Q8_0: widen_s8(b + 32 + k * 16, out); return;
    }
}

/* A block's scales: d, and m (q4_0: -8 d); f32/bf16 have none. */
static inline void scales(int fmt, const uint8_t *b, float *d, float *m) {
    if (fmt == F32 || fmt == BF16) return;
    load_h(b, d);
    if (fmt == Q4_1)
        load_h(b + 32, m);
    else if (fmt == Q4_0)
        for (int c = 0; c < G; c++) m[c] = -8.0f * d[c];
}

/* One block's 32 rows of 16 columns as fp32 w[32][16] (unscaled quants for the quantized formats). */
static inline void decode(int fmt, const uint8_t *b, float *w) {
    if (fmt == Q4_0 || fmt == Q4_1) {
        const uint8_t *qs = b + (fmt == Q4_1 ? 64 : 32);
#pragma GCC unroll 16
        for (int p = 0; p < KB / 2; p++) widen_nibbles(qs, p, w + 2 * p * G, w + (2 * p + 1) * G);
    } else {
        for (int k = 0; k < KB; k++) widen_row(fmt, b, k, w + k * G);
    }
}

/* acc[r][:] = sum_{k < kn} x[r][k] w[k][:] for `rows` rows, RT at a time (each weight vector loaded once per RT). */
static inline void dot_rows(const float *x, int64_t ldx, int rows, int64_t kn, const float *w, float *acc) {
    int r = 0;
    for (; r + RT <= rows; r += RT) {
        vf a[RT][NV];
        for (int i = 0; i < RT; i++)
            for (int j = 0; j < NV; j++) a[i][j] = (vf){0};
        for (int64_t k = 0; k < kn; k++)
            for (int j = 0; j < NV; j++) {
                vf wk = ldv(w + k * G + j * VL);
                for (int i = 0; i < RT; i++) a[i][j] += x[(r + i) * ldx + k] * wk;
            }
        for (int i = 0; i < RT; i++)
            for (int j = 0; j < NV; j++) stv(acc + (r + i) * G + j * VL, a[i][j]);
    }
    for (; r < rows; r++) {
        const float *x0 = x + r * ldx;
        vf a0[NV], a1[NV];
        for (int j = 0; j < NV; j++) a0[j] = a1[j] = (vf){0};
        int64_t k = 0;
        for (; k + 2 <= kn; k += 2)
            for (int j = 0; j < NV; j++) {
                a0[j] += x0[k] * ldv(w + k * G + j * VL);
                a1[j] += x0[k + 1] * ldv(w + (k + 1) * G + j * VL);
            }
        for (; k < kn; k++)
            for (int j = 0; j < NV; j++) a0[j] += x0[k] * ldv(w + k * G + j * VL);
        for (int j = 0; j < NV; j++) stv(acc + r * G + j * VL, a0[j] + a1[j]);
    }
}

/* One row against a whole group, each block widened straight into the products (a decode step of a few sequences
 * reads each weight once and is bound by how fast it is widened); out[16]. */
static inline void row_one(int fmt, const uint8_t *blk, int64_t bb, int64_t nb, const float *x, int64_t K,
                           const float *xs, float *out) {
    vf acc[NV];
    for (int j = 0; j < NV; j++) acc[j] = (vf){0};
    float w0[G] __attribute__((aligned(64))) = {0}, w1[G] __attribute__((aligned(64))) = {0};
    float d[G] __attribute__((aligned(64))) = {0}, m[G] __attribute__((aligned(64))) = {0};
    for (int64_t b = 0; b < nb; b++, blk += bb) {
        int kn = K - b * KB < KB ? (int)(K - b * KB) : KB;
        const float *xb = x + b * KB;
        for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + PREFETCH + off);
        vf a0[NV], a1[NV];
        for (int j = 0; j < NV; j++) a0[j] = a1[j] = (vf){0};
        const uint8_t *qs = blk + (fmt == Q4_1 ? 64 : 32);
        int k = 0;
        for (; k + 2 <= kn; k += 2) {
            if (fmt == Q4_0 || fmt == Q4_1)
                widen_nibbles(qs, k / 2, w0, w1);
            else
                widen_row(fmt, blk, k, w0), widen_row(fmt, blk, k + 1, w1);
            for (int j = 0; j < NV; j++) a0[j] += xb[k] * ldv(w0 + j * VL), a1[j] += xb[k + 1] * ldv(w1 + j * VL);
        }
        if (k < kn) {
            if (fmt == Q4_0 || fmt == Q4_1)
                widen_nibbles(qs, k / 2, w0, w1);
            else
                widen_row(fmt, blk, k, w0);
            for (int j = 0; j < NV; j++) a0[j] += xb[k] * ldv(w0 + j * VL);
        }
        scales(fmt, blk, d, m);
        for (int j = 0; j < NV; j++) {
            vf part = a0[j] + a1[j];
            if (fmt == F32 || fmt == BF16)
                acc[j] += part;
            else if (fmt == Q8_0)
                acc[j] += ldv(d + j * VL) * part;
            else
                acc[j] += ldv(d + j * VL) * part + ldv(m + j * VL) * xs[b];
        }
    }
    for (int j = 0; j < NV; j++) stv(out + j * VL, acc[j]);
}

#if defined(__AVX512BF16__)
/* bf16 of 0..15, twice: vpermw looks up the low 5 bits of each word */
static const uint16_t NIBBLE_BF16[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                         0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
                                         0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                         0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* Rows k = 2p, 2p + 1 of a 4-bit block as 16 bf16 pairs, column c's two in lane c: in chunk p / 4, word 2c holds
 * column c's k = 2p in nibble p % 4 and word 2c + 1 its k = 2p + 1, so one shift and one table lookup (vpermw reads
 * the low 5 bits of each word; the table repeats, so the bit above the nibble does not matter) turn 32 quants
 * into bf16. */
static inline __m512bh pair_q4(const uint8_t *qs, int p, __m512i lut) {
    const __m512i v = _mm512_loadu_si512(qs + (p / 4) * 64);
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4 * (p % 4)), lut);
}

/* row_one for 4-bit blocks and a bf16 row, with AVX512-BF16: each column's quants of k = 2p, 2p + 1 become a pair
 * of bf16 values by one table lookup (pair_q4; 0..15 are exact in bf16) and meet the pair
 * x[2p], x[2p + 1] in one vdpbf16ps. The products are exact in fp32, so this is row_one's sum in another order,
 * at about half the instructions per weight. */
static inline void row_one_q4_dp(int fmt, const uint8_t *blk, int64_t bb, int64_t nb, const uint16_t *x, int64_t K,
                                 const float *xs, float *out) {
    const __m512i lut = _mm512_loadu_si512(NIBBLE_BF16);
    float d[G] __attribute__((aligned(64))) = {0}, m[G] __attribute__((aligned(64))) = {0};
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, blk += bb) {
        const int kn = K - b * KB < KB ? (int)(K - b * KB) : KB;
        const uint16_t *xb = x + b * KB;
        for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + PREFETCH + off);
        const uint8_t *qs = blk + (fmt == Q4_1 ? 64 : 32);
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        uint16_t tail[KB] = {0};
        const uint16_t *xp = xb;
        if (kn < KB) { /* K ends inside this block: the missing x are 0 */
            memcpy(tail, xb, sizeof(uint16_t) * kn);
            xp = tail;
        }
#pragma GCC unroll 16
        for (int p = 0; p < KB / 2; p++) {
            const __m512bh wv = pair_q4(qs, p, lut);
            uint32_t pair;
            memcpy(&pair, xp + 2 * p, sizeof pair);
            a[p & 3] = _mm512_dpbf16_ps(a[p & 3], wv, (__m512bh)_mm512_set1_epi32((int)pair));
        }
        scales(fmt, blk, d, m);
        __m512 part = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
        acc = _mm512_fmadd_ps(_mm512_load_ps(d), part, acc);
        acc = _mm512_fmadd_ps(_mm512_load_ps(m), _mm512_set1_ps(xs[b]), acc);
    }
    _mm512_storeu_ps(out, acc);
}
#endif

#if defined(__AVX512F__)
/* One fp32 row against Q8_0 blocks, all in registers: per k, one sign extension, one conversion and one FMA whose
 * x comes broadcast from memory, four chains of FMAs a block. Turning the quants into bf16 pairs for vdpbf16ps takes
 * twice the instructions, and at one row nothing shares them (the output layer, 49152 x 576 of the built-in model,
 * is a third of a batch-1 step's bytes). */
static inline void row_one_q8(const uint8_t *blk, int64_t bb, int64_t nb, const float *x, int64_t K, float *out) {
    __m512 acc = _mm512_setzero_ps();
    float tail[KB];
    for (int64_t b = 0; b < nb; b++, blk += bb) {
        const int kn = K - b * KB < KB ? (int)(K - b * KB) : KB;
        const float *xb = x + b * KB;
        if (kn < KB) { /* K ends inside this block: the missing x are 0 */
            memset(tail, 0, sizeof tail);
            memcpy(tail, xb, sizeof(float) * kn);
            xb = tail;
        }
        for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + PREFETCH + off);
        const uint8_t *qs = blk + 32;
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 32
        for (int k = 0; k < KB; k++) {
            const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + k * G))));
            a[k & 3] = _mm512_fmadd_ps(w, _mm512_set1_ps(xb[k]), a[k & 3]);
        }
        float d[G] __attribute__((aligned(64))), m[G];
        scales(Q8_0, blk, d, m);
        const __m512 part = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
        acc = _mm512_fmadd_ps(_mm512_load_ps(d), part, acc);
    }
    _mm512_storeu_ps(out, acc);
}
#endif

#if defined(__AVX512BF16__)
/* Rows k = 2p, 2p + 1 of a Q8_0 block as 16 bf16 pairs (column c's two values in lane c), exactly: int8 values
 * are exact in fp32 and in bf16. */
static inline __m512bh pair_q8(const uint8_t *qs, int p) {
    const __m128i a = _mm_loadu_si128((const __m128i *)(qs + 2 * p * G));
    const __m128i b = _mm_loadu_si128((const __m128i *)(qs + (2 * p + 1) * G));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(a, b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(a, b)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* Up to 8 bf16 rows against one group of Q8_0 or 4-bit blocks with vdpbf16ps: each pair of weight rows is turned
 * into bf16 once for all the rows, each row's block sum is scaled once per block (d sum x q, + m sum x for q4,
 * as row_one); acc[R][16]. */
static inline __attribute__((always_inline)) void tile_dp(const int fmt, const uint8_t *blk, int64_t bb, int64_t nb,
                                                          const uint16_t *x, int64_t ldx, const int R, int64_t K,
                                                          const float *xs, float *acc) {
    const __m512i lut = _mm512_loadu_si512(NIBBLE_BF16);
    float d[G] __attribute__((aligned(64))) = {0}, m[G] __attribute__((aligned(64))) = {0};
    __m512 a[8];
    for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();
    uint16_t tail[8][KB];
    for (int64_t b = 0; b < nb; b++, blk += bb) {
        const int kn = K - b * KB < KB ? (int)(K - b * KB) : KB;
        const uint16_t *xr[8];
        if (kn < KB) { /* K ends inside this block: the missing x are 0 */
            memset(tail, 0, sizeof tail);
            for (int r = 0; r < R; r++) memcpy(tail[r], x + r * ldx + b * KB, sizeof(uint16_t) * kn);
        }
        for (int r = 0; r < R; r++) xr[r] = kn < KB ? tail[r] : x + r * ldx + b * KB;
        for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + PREFETCH + off);
        const uint8_t *qs = blk + (fmt == Q4_1 ? 64 : 32);
        __m512 part[8];
        for (int r = 0; r < R; r++) part[r] = _mm512_setzero_ps();
        for (int j = 0; j < KB / 8; j++)
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) { /* p % 4 known, so pair_q4 shifts by an immediate */
                const int p = 4 * j + i;
                const __m512bh wv = fmt == Q8_0 ? pair_q8(qs, p) : pair_q4(qs, p, lut);
                for (int r = 0; r < R; r++) {
                    uint32_t pair;
                    memcpy(&pair, xr[r] + 2 * p, sizeof pair);
                    part[r] = _mm512_dpbf16_ps(part[r], wv, (__m512bh)_mm512_set1_epi32((int)pair));
                }
            }
        scales(fmt, blk, d, m);
        const __m512 dv = _mm512_load_ps(d), mv = _mm512_load_ps(m);
        for (int r = 0; r < R; r++) {
            a[r] = _mm512_fmadd_ps(dv, part[r], a[r]);
            if (fmt != Q8_0) a[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * nb + b]), a[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(acc + r * G, a[r]);
}

#define TILE_DP(FMT)                                                                                                   \
    switch (R) {                                                                                                       \
    case 1: tile_dp(FMT, blk, bb, nb, xr, ldx, 1, K, xsr, ar); break;                                                  \
    case 2: tile_dp(FMT, blk, bb, nb, xr, ldx, 2, K, xsr, ar); break;                                                  \
    case 3: tile_dp(FMT, blk, bb, nb, xr, ldx, 3, K, xsr, ar); break;                                                  \
    case 4: tile_dp(FMT, blk, bb, nb, xr, ldx, 4, K, xsr, ar); break;                                                  \
    case 5: tile_dp(FMT, blk, bb, nb, xr, ldx, 5, K, xsr, ar); break;                                                  \
    case 6: tile_dp(FMT, blk, bb, nb, xr, ldx, 6, K, xsr, ar); break;                                                  \
    case 7: tile_dp(FMT, blk, bb, nb, xr, ldx, 7, K, xsr, ar); break;                                                  \
    default: tile_dp(FMT, blk, bb, nb, xr, ldx, 8, K, xsr, ar);                                                        \
    }

/* One block's products for R rows: wv, its 16 pairs of weight rows as bf16; x the rows at this block; the rows'
 * running sums acc[R][16] (in L1) take d times each block sum, plus m times the row's sum of x (xs[r * nb], 4-bit
 * formats; NULL for Q8_0). */
static inline __attribute__((always_inline)) void block_rows_dp(const __m512bh *wv, const uint16_t *x, int64_t ldx,
                                                                const int R, int kn, __m512 dv, __m512 mv,
                                                                const float *xs, int64_t nb, float *acc) {
    uint16_t tail[8][KB];
    const uint16_t *xr[8];
    if (kn < KB) { /* K ends inside this block: the missing x are 0 */
        memset(tail, 0, sizeof tail);
        for (int r = 0; r < R; r++) memcpy(tail[r], x + r * ldx, sizeof(uint16_t) * kn);
    }
    for (int r = 0; r < R; r++) xr[r] = kn < KB ? tail[r] : x + r * ldx;
    __m512 part[8];
    for (int r = 0; r < R; r++) part[r] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int p = 0; p < KB / 2; p++)
        for (int r = 0; r < R; r++) {
            uint32_t pair;
            memcpy(&pair, xr[r] + 2 * p, sizeof pair);
            part[r] = _mm512_dpbf16_ps(part[r], wv[p], (__m512bh)_mm512_set1_epi32((int)pair));
        }
    for (int r = 0; r < R; r++) {
        __m512 a = _mm512_fmadd_ps(dv, part[r], _mm512_loadu_ps(acc + r * G));
        if (xs) a = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * nb]), a);
        _mm512_storeu_ps(acc + r * G, a);
    }
}

/* More than 8 rows: each block is turned into bf16 pairs once, into L1, and every tile of 8 rows reads it there
 * (the tiles above would turn it over once per tile). */
static void group_dp_wide(int fmt, const uint8_t *blk, int64_t bb, int64_t nb, const uint16_t *x, int64_t ldx,
                          int rows, int64_t K, const float *xs, float *acc) {
    const __m512i lut = _mm512_loadu_si512(NIBBLE_BF16);
    __m512bh wv[KB / 2];
    float d[G] __attribute__((aligned(64))) = {0}, m[G] __attribute__((aligned(64))) = {0};
    memset(acc, 0, sizeof(float) * rows * G);
    for (int64_t b = 0; b < nb; b++, blk += bb) {
        const int kn = K - b * KB < KB ? (int)(K - b * KB) : KB;
        for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + PREFETCH + off);
        const uint8_t *qs = blk + (fmt == Q4_1 ? 64 : 32);
#pragma GCC unroll 16
        for (int p = 0; p < KB / 2; p++) wv[p] = fmt == Q8_0 ? pair_q8(qs, p) : pair_q4(qs, p, lut);
        scales(fmt, blk, d, m);
        const __m512 dv = _mm512_load_ps(d), mv = _mm512_load_ps(m);
        for (int r0 = 0; r0 < rows; r0 += 8) {
            const uint16_t *xr = x + r0 * ldx + b * KB;
            const float *xsr = xs ? xs + r0 * nb + b : NULL;
            float *ar = acc + r0 * G;
            switch (rows - r0 < 8 ? rows - r0 : 8) {
            case 1: block_rows_dp(wv, xr, ldx, 1, kn, dv, mv, xsr, nb, ar); break;
            case 2: block_rows_dp(wv, xr, ldx, 2, kn, dv, mv, xsr, nb, ar); break;
            case 3: block_rows_dp(wv, xr, ldx, 3, kn, dv, mv, xsr, nb, ar); break;
            case 4: block_rows_dp(wv, xr, ldx, 4, kn, dv, mv, xsr, nb, ar); break;
            case 5: block_rows_dp(wv, xr, ldx, 5, kn, dv, mv, xsr, nb, ar); break;
            case 6: block_rows_dp(wv, xr, ldx, 6, kn, dv, mv, xsr, nb, ar); break;
            case 7: block_rows_dp(wv, xr, ldx, 7, kn, dv, mv, xsr, nb, ar); break;
            default: block_rows_dp(wv, xr, ldx, 8, kn, dv, mv, xsr, nb, ar);
            }
        }
    }
}

/* A group against `rows` bf16 rows (xs: the rows' block sums, 4-bit formats only). */
static void group_dp(int fmt, const uint8_t *blk, int64_t bb, int64_t nb, const uint16_t *x, int64_t ldx, int rows,
                     int64_t K, const float *xs, float *acc) {
    if (rows >= (fmt == Q8_0 ? DP_WIDE_ROWS_Q8 : DP_WIDE_ROWS_Q4)) {
        group_dp_wide(fmt, blk, bb, nb, x, ldx, rows, K, xs, acc);
        return;
    }
    for (int r0 = 0; r0 < rows; r0 += 8) {
        const int R = rows - r0 < 8 ? rows - r0 : 8;
        const uint16_t *xr = x + r0 * ldx;
        const float *xsr = xs ? xs + r0 * nb : NULL;
        float *ar = acc + r0 * G;
        if (fmt == Q8_0) {
            TILE_DP(Q8_0)
        } else if (fmt == Q4_0) {
            TILE_DP(Q4_0)
        } else {
            TILE_DP(Q4_1)
        }
    }
}
#undef TILE_DP
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && !defined(NO_AMX)
#define AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#ifndef AMX_ROWS
#define AMX_ROWS 4 /* from this many bf16 rows on, Q8_0 and 4-bit blocks multiply on the tile unit */
#endif
/* Linux hands out the tile registers' state only on request, once per process (ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); without it the first tile instruction is an illegal one. 0 unknown, 1 granted, -1 not. */
static int amx_state;
static int amx_usable(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_RELAXED);
    if (!s) {
        s = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELAXED);
    }
    return s > 0;
}

/* What ldtilecfg reads: palette 1, each tile's bytes a row and rows (0: unused). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) amx_config;

/* Six tiles of 64 bytes a row, 16 rows but for tiles 0 and 1, which have `rows` (at most 16). Blocks (group_amx):
 * tile 0 the products of the rows with one block [rows][16] fp32, tile 1 the rows' x at the block [rows][32] bf16,
 * tile 2 the block's quants as 16 bf16 pairs of rows [16][16][2] (exact, like vdpbf16ps's); a decode step's 8 rows
 * then load and store 8 rows of x and sums a block, not 16 (q4_1 over the built-in model's layer, 2 threads,
 * Sapphire Rapids: 8 rows 142 -> 130 us, 4 rows 126 -> 106). bf16_rows (bf16_rows_amx, rows 16): tiles 0-3 the
 * sums of up to 64 rows, tile 4 16 rows of the weight, tile 5 16 rows of x in pairs. */
static void amx_configure(int rows) {
    amx_config cfg = {.palette = 1};
    for (int t = 0; t < 6; t++) cfg.colsb[t] = 64, cfg.rows[t] = t < 2 ? rows : 16;
    _tile_loadconfig(&cfg);
}

/* A group against `rows` bf16 rows on the tile unit: each block's quants become bf16 pairs once (as group_dp's
 * do), one tile product per 16 rows gives the block's unscaled sums, and those are scaled into acc as tile_dp
 * scales its own (d sum x q, + m sum x for 4-bit). The tile unit reads the pairs, and the vector unit the sums,
 * through memory: so the pairs are written one block ahead and the sums scaled one block behind, and neither
 * unit waits on the other's stores. xp: the rows zero-padded to 16 and to whole blocks, row stride ldp. */
static inline __attribute__((always_inline)) void group_amx(const int fmt, const uint8_t *blk, int64_t bb, int64_t nb,
                                                            const uint16_t *xp, int64_t ldp, int rows, const int rmax,
                                                            const float *xs, float *acc) {
    const __m512i lut = _mm512_loadu_si512(NIBBLE_BF16);
    __m512bh wv[2][KB / 2];
    float c[2][MT / 16][16 * G] __attribute__((aligned(64)));
    float d[G] __attribute__((aligned(64))) = {0}, m[G] __attribute__((aligned(64))) = {0};
    __m512 dv = _mm512_setzero_ps(), mv = _mm512_setzero_ps();
    const int chunks = (rows + 15) / 16;
    __m512 ra[16]; /* up to rmax (8 or 16) rows' sums stay in registers: rmax is known, so the loops unroll */
    for (int r = 0; r < 16; r++) ra[r] = _mm512_setzero_ps();
    if (rows > rmax) memset(acc, 0, sizeof(float) * rows * G);
    for (int64_t b = 0; b <= nb; b++, blk += bb) {
        if (b < nb) {
            for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + PREFETCH + off);
            const uint8_t *qs = blk + (fmt == Q4_1 ? 64 : 32);
            if (b == 0)
#pragma GCC unroll 16
                for (int p = 0; p < KB / 2; p++) wv[0][p] = fmt == Q8_0 ? pair_q8(qs, p) : pair_q4(qs, p, lut);
            if (b + 1 < nb) {
                const uint8_t *qn = qs + bb;
#pragma GCC unroll 16
                for (int p = 0; p < KB / 2; p++)
                    wv[(b + 1) & 1][p] = fmt == Q8_0 ? pair_q8(qn, p) : pair_q4(qn, p, lut);
            }
            _tile_loadd(2, wv[b & 1], 64);
            for (int i = 0; i < chunks; i++) {
                _tile_loadd(1, xp + i * 16 * ldp + b * KB, ldp * 2);
                _tile_zero(0);
                _tile_dpbf16ps(0, 1, 2);
                _tile_stored(0, c[b & 1][i], 64);
            }
        }
        if (b > 0) { /* block b - 1's sums, scaled */
            const float *cp = &c[(b - 1) & 1][0][0];
            if (rows <= rmax) {
                for (int r = 0; r < rmax; r++) {
                    if (r >= rows) break;
                    ra[r] = _mm512_fmadd_ps(dv, _mm512_load_ps(cp + r * G), ra[r]);
                    if (fmt != Q8_0) ra[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * nb + b - 1]), ra[r]);
                }
            } else
            for (int r = 0; r < rows; r++) {
                float *ar = acc + r * G;
                __m512 a = _mm512_fmadd_ps(dv, _mm512_load_ps(cp + r * G), _mm512_loadu_ps(ar));
                if (fmt != Q8_0) a = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * nb + b - 1]), a);
                _mm512_storeu_ps(ar, a);
            }
        }
        if (b < nb) {
            scales(fmt, blk, d, m);
            dv = _mm512_load_ps(d), mv = _mm512_load_ps(m);
        }
    }
    if (rows <= rmax)
        for (int r = 0; r < rmax; r++) {
            if (r >= rows) break;
            _mm512_storeu_ps(acc + r * G, ra[r]);
        }
}

/* group_amx with its format and register budget known to the compiler. */
static void group_amx_rows(int fmt, const uint8_t *blk, int64_t bb, int64_t nb, const uint16_t *xp, int64_t ldp,
                           int rows, const float *xs, float *acc) {
    const int r8 = rows <= 8;
    if (fmt == Q8_0)
        r8 ? group_amx(Q8_0, blk, bb, nb, xp, ldp, rows, 8, xs, acc)
           : group_amx(Q8_0, blk, bb, nb, xp, ldp, rows, 16, xs, acc);
    else if (fmt == Q4_0)
        r8 ? group_amx(Q4_0, blk, bb, nb, xp, ldp, rows, 8, xs, acc)
           : group_amx(Q4_0, blk, bb, nb, xp, ldp, rows, 16, xs, acc);
    else
        r8 ? group_amx(Q4_1, blk, bb, nb, xp, ldp, rows, 8, xs, acc)
           : group_amx(Q4_1, blk, bb, nb, xp, ldp, rows, 16, xs, acc);
}
#else
#define AMX 0
#endif

/* One group for 4 to PANEL_ROWS rows: each block decoded once into L1 and used by every row, the block's scales
 * applied to the rows' partial sums; acc[rows][16]. */
static void blockwise_group(int fmt, const uint8_t *blk, int64_t bb, int64_t nb, const float *x, int64_t ldx,
                            int rows, int64_t K, const float *xs, float *acc) {
    float w[KB * G] __attribute__((aligned(64))), part[MT * G] __attribute__((aligned(64)));
    float d[G] __attribute__((aligned(64))) = {0}, m[G] __attribute__((aligned(64))) = {0};
    memset(acc, 0, sizeof(float) * rows * G);
    for (int64_t b = 0; b < nb; b++, blk += bb) {
        int kn = K - b * KB < KB ? (int)(K - b * KB) : KB;
        for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + PREFETCH + off);
        decode(fmt, blk, w);
        scales(fmt, blk, d, m);
        dot_rows(x + b * KB, ldx, rows, kn, w, part);
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < NV; j++) {
                vf p = ldv(part + r * G + j * VL), a = ldv(acc + r * G + j * VL);
                if (fmt == F32 || fmt == BF16)
                    a += p;
                else if (fmt == Q8_0)
                    a += ldv(d + j * VL) * p;
                else
                    a += ldv(d + j * VL) * p + ldv(m + j * VL) * xs[r * nb + b];
                stv(acc + r * G + j * VL, a);
            }
    }
}

/* A group's whole weight as an fp32 panel [K][16], dequantized (d q + m): what the tiles of many rows read,
 * decoded once per call however many rows there are. */
static void decode_panel(int fmt, const uint8_t *blk, int64_t bb, int64_t nb, float *panel) {
    float d[G] __attribute__((aligned(64))) = {0}, m[G] __attribute__((aligned(64))) = {0};
    for (int64_t b = 0; b < nb; b++, blk += bb) {
        float *p = panel + b * KB * G;
        for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + PREFETCH + off);
        decode(fmt, blk, p);
        scales(fmt, blk, d, m);
        if (fmt == F32 || fmt == BF16) continue;
        for (int k = 0; k < KB; k++)
            for (int j = 0; j < NV; j++) {
                vf v = ldv(d + j * VL) * ldv(p + k * G + j * VL);
                stv(p + k * G + j * VL, fmt == Q8_0 ? v : v + ldv(m + j * VL));
            }
    }
}

#if VL == 16 && !defined(NO_PAIR)
/* Two panels at once for 8 rows at a time: 16 accumulators, and each broadcast of x feeds two FMAs, so the loads
 * no longer outnumber the FMAs (AVX-512 has the 32 registers this needs). */
static void two_panels(const float *p0, const float *p1, int64_t K, const float *x, int64_t ldx, int rows,
                       float *acc0, float *acc1) {
    int r = 0;
    for (; r + 8 <= rows; r += 8) {
        vf a[8], c[8];
        for (int i = 0; i < 8; i++) a[i] = c[i] = (vf){0};
        for (int64_t k = 0; k < K; k++) {
            vf u = ldv(p0 + k * G), v = ldv(p1 + k * G);
            for (int i = 0; i < 8; i++) {
                float xv = x[(r + i) * ldx + k];
                a[i] += xv * u;
                c[i] += xv * v;
            }
        }
        for (int i = 0; i < 8; i++) stv(acc0 + (r + i) * G, a[i]), stv(acc1 + (r + i) * G, c[i]);
    }
    if (r < rows) {
        dot_rows(x + r * ldx, ldx, rows - r, K, p0, acc0 + r * G);
        dot_rows(x + r * ldx, ldx, rows - r, K, p1, acc1 + r * G);
    }
}
#define PAIR 2
#else
#define PAIR 1
#endif

/* xs[r * nb + b]: the sum of row r's x over block b (the term a block's minimum multiplies). */
static inline void row_block_sums(const float *x, int64_t K, float *xs) {
    const int64_t nb = (K + KB - 1) / KB;
    for (int64_t b = 0; b < nb; b++) {
        /* 8 partial sums, added in a fixed order: one chain of 32 dependent adds cost more than the call's
         * products at one row of a small layer */
        float part[8] = {0}, s = 0;
        const float *xb = x + b * KB;
        if (K - b * KB >= KB)
            for (int k = 0; k < KB; k += 8)
                for (int j = 0; j < 8; j++) part[j] += xb[k + j];
        else
            for (int k = 0; k < K - b * KB; k++) part[k % 8] += xb[k];
        for (int j = 0; j < 8; j++) s += part[j];
        xs[b] = s;
    }
}

/* The same for M rows, in parallel only when there is enough of them: an OpenMP region, even of one thread, cost
 * more than a row's sums. */
static void block_sums(const float *x, int64_t ldx, int64_t M, int64_t K, float *xs, int nthreads) {
    const int64_t nb = (K + KB - 1) / KB;
    if (M * K <= 65536) {
        for (int64_t r = 0; r < M; r++) row_block_sums(x + r * ldx, K, xs + r * nb);
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < M; r++) row_block_sums(x + r * ldx, K, xs + r * nb);
}

static void store_rows(const float *acc, int rows, int cols, const float *bias, void *yout, int64_t ldy, int y_bf16,
                       int64_t row0, int64_t col0) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (y_bf16 && cols == G) { /* f32_to_bf16 on 16 lanes (scalar: 7-11% of an int8 call at 16 rows) */
        const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
        const __m512 b = bias ? _mm512_loadu_ps(bias + col0) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            __m512 v = _mm512_loadu_ps(acc + r * G);
            if (bias) v = _mm512_add_ps(v, b);
            const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
            __m512i h = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, half), _mm512_and_si512(hi, one)), 16);
            const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                          _mm512_set1_epi32(0x7f800000));
            h = _mm512_mask_or_epi32(h, nan, hi, _mm512_set1_epi32(0x40));
            _mm256_storeu_si256((__m256i *)((uint16_t *)yout + (row0 + r) * ldy + col0), _mm512_cvtepi32_epi16(h));
        }
        return;
    }
#endif
    for (int r = 0; r < rows; r++) {
        float lane[G];
        memcpy(lane, acc + r * G, sizeof lane);
        if (bias)
            for (int c = 0; c < cols; c++) lane[c] += bias[col0 + c];
        int64_t at = (row0 + r) * ldy + col0;
        if (y_bf16)
            for (int c = 0; c < cols; c++) ((uint16_t *)yout)[at + c] = f32_to_bf16(lane[c]);
        else if (cols == G)
            memcpy((float *)yout + at, lane, sizeof lane);
        else
            memcpy((float *)yout + at, lane, sizeof(float) * cols);
    }
}

#include "cpu_linear_q8.h"

#if VL == 8 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(NO_TILE8)
#define TILE8 1
#include "cpu_linear_avx2.h"
#else
#define TILE8 0
#endif

/* bf16_rows: the weight as torch holds it, W [N][K] bf16 row-major, for CPUs where oneDNN multiplies bf16 in
 * hardware and runs prompt shapes on the same tensor. Each output is a dot product along K; tiles of R rows by 4
 * columns share every load. With AVX512-BF16 and bf16 activations, pairs of products go through vdpbf16ps (each
 * bf16 x bf16 product is exact in fp32, so only the order of the fp32 sums differs); elsewhere the weight is
 * widened to fp32 and multiplied by fp32 FMAs. With vdpbf16ps, tiles are up to 8 rows by 2 columns (tile_rows_dp2).
 * Either way a row's sums run in one order whatever the number of rows, so a row's output does not depend on the rows
 * beside it (speculative decoding checks guesses in the rows of one step and must pick what a one-row step picks:
 * a column-at-a-time tile for 1-4 rows, summed in another order, measured no faster on Zen 4). A thread's tiles are
 * one contiguous run of rows, prefetched ROWS_PREFETCH bytes ahead into L2. */
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

static inline vf widen_bf16_vec(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float hsum(vf v) {
    float lane[VL], s = 0;
    memcpy(lane, &v, sizeof lane);
    for (int i = 0; i < VL; i++) s += lane[i];
    return s;
}

static inline __attribute__((always_inline)) void tile_rows_f32(const float *x, int64_t ldx, const int R, int64_t K,
                                                                const uint16_t *const *wc, float out[4][4]) {
    vf acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = (vf){0};
    int64_t k = 0;
    for (; k + VL <= K; k += VL) {
        vf wv[4];
        if (k % 32 == 0)
            for (int c = 0; c < 4; c++) __builtin_prefetch((const char *)(wc[c] + k) + ROWS_PREFETCH, 0, PF_LOC);
        for (int c = 0; c < 4; c++) wv[c] = widen_bf16_vec(wc[c] + k);
        for (int r = 0; r < R; r++) {
            vf xv = ldv(x + r * ldx + k);
            for (int c = 0; c < 4; c++) acc[r][c] += xv * wv[c];
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) {
            float s = hsum(acc[r][c]);
            for (int64_t j = k; j < K; j++) s += x[r * ldx + j] * bf16_to_f32(wc[c][j]);
            out[r][c] = s;
        }
}

/* A bf16_rows tile's sums (row stride ld) plus bias into y, rounded once: R rows by cols columns at (row0, col0). */
static inline void store_tile(const float *out, int ld, int R, int cols, const float *bias, void *yout, int64_t ldy,
                              int y_bf16, int64_t row0, int64_t col0) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < cols; c++) {
            const float v = out[r * ld + c] + (bias ? bias[col0 + c] : 0.0f);
            const int64_t at = (row0 + r) * ldy + col0 + c;
            if (y_bf16)
                ((uint16_t *)yout)[at] = f32_to_bf16(v);
            else
                ((float *)yout)[at] = v;
        }
}

#if defined(__AVX512BF16__)
/* Sixteen horizontal sums in 45 instructions (sixteen _mm512_reduce_add_ps take about 150): four rounds of
 * shuffle-and-add halve the lanes per sum and double the sums per vector. Sum i lands in lane i % 4 * 4 + i / 4. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 *v) {
    __m512 w[8], u[4], x[2];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD));
}

/* Up to 8 rows against two columns, one accumulator per row and column: each 32 values of x are loaded once for
 * both columns and each 32 of a column once for all the rows, so at 8 rows the loads are 10 per 16 vdpbf16ps, where
 * a column-at-a-time order needs 10 per 8 (and then it is the loads, not the dot products, that
 * bound a batch step). */
static inline __attribute__((always_inline)) void tile_rows_dp2(const uint16_t *x, int64_t ldx, const int R, int64_t K,
                                                                const uint16_t *w0, const uint16_t *w1,
                                                                float out[8][2]) {
    __m512 a0[8], a1[8];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __builtin_prefetch((const char *)(w0 + k) + ROWS_PREFETCH, 0, PF_LOC);
        __builtin_prefetch((const char *)(w1 + k) + ROWS_PREFETCH, 0, PF_LOC);
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(w0 + k), v1 = (__m512bh)_mm512_loadu_si512(w1 + k);
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * ldx + k);
            a0[r] = _mm512_dpbf16_ps(a0[r], xv, v0);
            a1[r] = _mm512_dpbf16_ps(a1[r], xv, v1);
        }
    }
    if (k < K) {
        const __mmask32 live = (__mmask32)((1u << (K - k)) - 1);
        const __m512bh v0 = (__m512bh)_mm512_maskz_loadu_epi16(live, w0 + k);
        const __m512bh v1 = (__m512bh)_mm512_maskz_loadu_epi16(live, w1 + k);
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(live, x + r * ldx + k);
            a0[r] = _mm512_dpbf16_ps(a0[r], xv, v0);
            a1[r] = _mm512_dpbf16_ps(a1[r], xv, v1);
        }
    }
    __m512 v[16];
    for (int i = 0; i < 16; i++) { /* v[i] is sum i's transposed place (sum16), so sum 2r + c lands in out[r][c] */
        const int s = i % 4 * 4 + i / 4, r = s / 2;
        v[i] = r < R ? (s % 2 ? a1[r] : a0[r]) : _mm512_setzero_ps();
    }
    _mm512_storeu_ps(&out[0][0], sum16(v));
}
#endif

#if AMX
#ifndef AMX_BF16_ROWS
#define AMX_BF16_ROWS 4 /* from this many bf16 rows on, bf16_rows multiplies on the tile unit */
#endif
#define AMX_MT 64 /* rows per pass over a group: one tile of sums per 16 */

/* bf16_rows on the tile unit, the weight as the left operand: 16 of its rows [16][32] straight from memory per
 * tile, the activations as the right one, laid out once per call in pairs along K (xv: per 16 rows, [K/2][16][2],
 * zero-padded), so the sums come out [16 columns][16 rows] and are stored transposed. Up to AMX_MT rows share each
 * load of the weight. */
static int bf16_rows_amx(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, const uint16_t *w, int64_t N,
                         const float *bias, void *yout, int64_t ldy, int y_bf16, int nthreads) {
    const int64_t kp = (K + KB - 1) / KB * KB, chunks = (M + 15) / 16, steps = kp / KB, groups = (N + G - 1) / G;
    uint16_t *xv = aligned_alloc(64, sizeof(uint16_t) * chunks * kp * 16);
    if (!xv) return -2;
    memset(xv, 0, sizeof(uint16_t) * chunks * kp * 16);
    for (int64_t m = 0; m < M; m++) { /* a pair of x is one 32-bit word: a transpose of words */
        uint32_t *to = (uint32_t *)xv + (m / 16) * (kp / 2) * 16 + m % 16;
        const uint16_t *from = x + m * ldx;
        for (int64_t p = 0; p < K / 2; p++) memcpy(to + p * 16, from + 2 * p, sizeof(uint32_t));
        if (K & 1) memcpy(to + (K / 2) * 16, from + K - 1, sizeof(uint16_t));
    }
    /* a row's sums down the column of a [16 columns][16 rows] tile: every 16th value */
    const __m512i across = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        amx_configure(16);
        uint16_t *pad = NULL; /* a short group's rows, or a ragged last block, zero-padded: [16][kp] */
        float sums[AMX_MT / 16][16 * G] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * G;
            const int cols = N - n0 < G ? (int)(N - n0) : G;
            const uint16_t *a = w + n0 * K;
            int64_t lda = K;
            if (cols < G || K % KB) {
                if (!pad && !(pad = aligned_alloc(64, sizeof(uint16_t) * 16 * kp))) {
                    failed = 1;
                    continue;
                }
                memset(pad, 0, sizeof(uint16_t) * 16 * kp);
                for (int c = 0; c < cols; c++) memcpy(pad + c * kp, a + c * K, sizeof(uint16_t) * K);
                a = pad, lda = kp;
            }
            const uint8_t *next = (const uint8_t *)(w + (n0 + G) * K);
            const int64_t ahead = g + 1 < groups ? (int64_t)sizeof(uint16_t) * G * K / steps : 0;
            for (int64_t r0 = 0; r0 < M; r0 += AMX_MT) {
                const int64_t nc = (M - r0 + 15) / 16 < AMX_MT / 16 ? (M - r0 + 15) / 16 : AMX_MT / 16;
                const uint16_t *xb = xv + (r0 / 16) * (kp / 2) * 32;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t s = 0; s < steps; s++) {
                    if (r0 == 0)
                        for (int64_t off = 0; off < ahead; off += 64) __builtin_prefetch(next + s * ahead + off, 0, 2);
                    _tile_loadd(4, a + s * KB, lda * 2);
#define AMX_CHUNK(T)                                                                                                   \
    if (nc > T) {                                                                                                      \
        _tile_loadd(5, xb + ((T) * (kp / 2) + s * 16) * 32, 64);                                                       \
        _tile_dpbf16ps(T, 4, 5);                                                                                       \
    }
                    AMX_CHUNK(0)
                    AMX_CHUNK(1)
                    AMX_CHUNK(2)
                    AMX_CHUNK(3)
#undef AMX_CHUNK
                }
                _tile_stored(0, sums[0], 64);
                if (nc > 1) _tile_stored(1, sums[1], 64);
                if (nc > 2) _tile_stored(2, sums[2], 64);
                if (nc > 3) _tile_stored(3, sums[3], 64);
                const __mmask16 keep = (__mmask16)((1u << cols) - 1);
                const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
                for (int64_t m = r0; m < M && m < r0 + AMX_MT; m++) {
                    const __m512 v =
                        _mm512_add_ps(_mm512_i32gather_ps(across, sums[(m - r0) / 16] + (m - r0) % 16, 4), b);
                    if (y_bf16)
                        _mm256_mask_storeu_epi16((uint16_t *)yout + m * ldy + n0, keep,
                                                 (__m256i)_mm512_cvtneps_pbh(v));
                    else
                        _mm512_mask_storeu_ps((float *)yout + m * ldy + n0, keep, v);
                }
            }
        }
        free(pad);
        _tile_release();
    }
    free(xv);
    return failed ? -2 : 0;
}
#endif

static int linear_bf16_rows(const void *xin, int64_t ldx, int x_bf16, int64_t M, int64_t K, const uint16_t *w,
                            int64_t N, const float *bias, void *yout, int64_t ldy, int y_bf16, int nthreads) {
#if AMX
    if (x_bf16 && M >= AMX_BF16_ROWS && amx_usable())
        return bf16_rows_amx(xin, ldx, M, K, w, N, bias, yout, ldy, y_bf16, nthreads);
#endif
    const float *x = xin;
    float *scratch = NULL;
#if defined(__AVX512BF16__)
    const int dp = x_bf16;
#else
    const int dp = 0;
#endif
    if (x_bf16 && !dp) {
        scratch = malloc(sizeof(float) * M * K);
        if (!scratch) return -2;
        for (int64_t r = 0; r < M; r++)
            for (int64_t k = 0; k < K; k++) scratch[r * K + k] = bf16_to_f32(((const uint16_t *)xin)[r * ldx + k]);
        x = scratch, ldx = K;
    }
    const int64_t tiles = (N + 3) / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * 4;
        const int cols = N - n0 < 4 ? (int)(N - n0) : 4;
        const uint16_t *wc[4];
        for (int c = 0; c < 4; c++) wc[c] = w + (n0 + (c < cols ? c : 0)) * K; /* a short tile re-reads column 0 */
#if defined(__AVX512BF16__)
        if (dp) {
            for (int64_t r0 = 0; r0 < M; r0 += 8) {
                const int R = M - r0 < 8 ? (int)(M - r0) : 8;
                const uint16_t *xr = (const uint16_t *)xin + r0 * ldx;
                for (int c = 0; c < cols; c += 2) {
                    float out[8][2];
                    switch (R) {
                    case 1: tile_rows_dp2(xr, ldx, 1, K, wc[c], wc[c + 1], out); break;
                    case 2: tile_rows_dp2(xr, ldx, 2, K, wc[c], wc[c + 1], out); break;
                    case 3: tile_rows_dp2(xr, ldx, 3, K, wc[c], wc[c + 1], out); break;
                    case 4: tile_rows_dp2(xr, ldx, 4, K, wc[c], wc[c + 1], out); break;
                    case 5: tile_rows_dp2(xr, ldx, 5, K, wc[c], wc[c + 1], out); break;
                    case 6: tile_rows_dp2(xr, ldx, 6, K, wc[c], wc[c + 1], out); break;
                    case 7: tile_rows_dp2(xr, ldx, 7, K, wc[c], wc[c + 1], out); break;
                    default: tile_rows_dp2(xr, ldx, 8, K, wc[c], wc[c + 1], out);
                    }
                    store_tile(&out[0][0], 2, R, cols - c < 2 ? cols - c : 2, bias, yout, ldy, y_bf16, r0, n0 + c);
                }
            }
            continue;
        }
#endif
        for (int64_t r0 = 0; r0 < M; r0 += 4) {
            const int R = M - r0 < 4 ? (int)(M - r0) : 4;
            float out[4][4];
            const float *xr = x + r0 * ldx;
            switch (R) {
            case 1: tile_rows_f32(xr, ldx, 1, K, wc, out); break;
            case 2: tile_rows_f32(xr, ldx, 2, K, wc, out); break;
            case 3: tile_rows_f32(xr, ldx, 3, K, wc, out); break;
            default: tile_rows_f32(xr, ldx, 4, K, wc, out);
            }
            store_tile(&out[0][0], 4, R, cols, bias, yout, ldy, y_bf16, r0, n0);
        }
    }
    free(scratch);
    return 0;
}

/* What this build computes with: 1 = vdpbf16ps (AVX512-BF16) for bf16 activations; 2 = 4-bit quants in chunks;
 * 4 = AMX tiles, built for and granted by the kernel (asked for here, once per process). */
int features(void) {
    int f = Q4_CHUNKS ? 2 : 0;
#if defined(__AVX512BF16__)
    f |= 1;
#endif
#if AMX
    if (amx_usable()) f |= 4;
#endif
    return f;
}

/* y = x W^T + bias. x [M, K] with row stride ldx, y [M, N] with row stride ldy, each fp32 or (x_bf16, y_bf16)
 * bf16, as torch holds them: bf16 activations are widened once here, not by the caller. */
int linear(const void *xin, int64_t ldx, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int fmt, int64_t N,
           const float *bias, void *yout, int64_t ldy, int y_bf16, int nthreads) {
    if (fmt == BF16_ROWS && M >= 0 && K > 0 && N > 0 && ldx >= K && ldy >= N)
        return M ? linear_bf16_rows(xin, ldx, x_bf16, M, K, (const uint16_t *)w, N, bias, yout, ldy, y_bf16, nthreads)
                 : 0;
    int64_t bb = block_nbytes(fmt);
    if (bb < 0 || M < 0 || K <= 0 || N <= 0 || ldx < K || ldy < N) return -1;
    if (M == 0) return 0;
    if (is_q8(fmt)) return linear_q8(xin, ldx, x_bf16, M, K, w, fmt, N, bias, yout, ldy, y_bf16, nthreads);
    int64_t nb = (K + KB - 1) / KB, groups = (N + G - 1) / G;
    /* AVX2 from PANEL8_ROWS rows: each group dequantized whole once, and tiled over with plain x */
    const int panels8 = TILE8 && fmt != F32 && M >= (fmt == Q4_0 || fmt == Q4_1 ? PANEL8_ROWS_Q4 : PANEL8_ROWS);
    /* the tiles that need each block's sum of x: all but AVX2's from 2 to 7 rows (tile8 dequantizes) and panels */
    int minimum = (fmt == Q4_0 || fmt == Q4_1) && (!TILE8 || M == 1 || M >= 8) && !panels8;
#if defined(__AVX512BF16__)
    const int dp4 = x_bf16 && minimum; /* 4-bit blocks and bf16 rows: vdpbf16ps, no fp32 panels */
    const int dp8 = x_bf16 && fmt == Q8_0; /* Q8_0 and bf16 rows: vdpbf16ps, which reads x as it is */
#else
    const int dp4 = 0, dp8 = 0;
#endif
    const int widen = x_bf16 && (!dp8 || M == 1); /* the fp32 paths (and the 4-bit block sums) read x widened */
    const int pairs = TILE8 && minimum; /* AVX2's 4-bit rows read x as pair_x writes it, nb * KB a row */
    float *scratch = NULL, *xs = NULL;
    __attribute__((unused)) float *xp = NULL;
    const float *x = xin;
    __attribute__((unused)) const int64_t ldx_in = ldx;
    if (widen || minimum) {
        scratch = malloc(sizeof(float) * ((widen ? M * K : 0) + (minimum ? M * nb : 0) + (pairs ? M * nb * KB : 0)));
        if (!scratch) return -2;
    }
    if (widen) {
        for (int64_t r = 0; r < M; r++)
            for (int64_t k = 0; k < K; k++) scratch[r * K + k] = bf16_to_f32(((const uint16_t *)xin)[r * ldx + k]);
        x = scratch, ldx = K;
    }
    if (minimum) {
        xs = scratch + (widen ? M * K : 0);
        block_sums(x, ldx, M, K, xs, nthreads);
    }
#if TILE8
    if (pairs) {
        xp = xs + M * nb;
        for (int64_t r = 0; r < M; r++) pair_x(x + r * ldx, K, nb, xp + r * nb * KB);
    }
#endif
    int64_t tasks = (groups + PAIR - 1) / PAIR;
    int use_panels = (TILE8 ? panels8 : M >= PANEL_ROWS) && !dp4 && !dp8, failed = 0;
    uint16_t *xpad = NULL; /* the tile unit's x: rows padded to 16, K to whole blocks, with zeros */
    __attribute__((unused)) const int64_t ldp = nb * KB;
#if AMX
    if ((dp4 || dp8) && M >= AMX_ROWS && amx_usable()) {
        const int64_t mp = (M + 15) / 16 * 16;
        xpad = aligned_alloc(64, sizeof(uint16_t) * mp * ldp);
        if (!xpad) {
            free(scratch);
            return -2;
        }
        memset(xpad, 0, sizeof(uint16_t) * mp * ldp);
        for (int64_t r = 0; r < M; r++)
            memcpy(xpad + r * ldp, (const uint16_t *)xin + r * ldx_in, sizeof(uint16_t) * K);
    }
#endif
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
#if AMX
        if (xpad) amx_configure(M < 16 ? (int)M : 16);
#endif
        float *panels = use_panels ? aligned_alloc(64, sizeof(float) * PAIR * nb * KB * G) : NULL;
        float acc0[MT * G] __attribute__((aligned(64)));
        __attribute__((unused)) float acc1[MT * G] __attribute__((aligned(64)));
        failed |= use_panels && !panels;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            if (use_panels && !panels) continue;
            int64_t g0 = t * PAIR, n_g = groups - g0 < PAIR ? groups - g0 : PAIR;
            if (use_panels)
                for (int64_t i = 0; i < n_g; i++)
                    decode_panel(fmt, w + (g0 + i) * nb * bb, bb, nb, panels + i * nb * KB * G);
            for (int64_t r0 = 0; r0 < M; r0 += MT) {
                int rows = M - r0 < MT ? (int)(M - r0) : MT;
                const float *xr = x + r0 * ldx, *xsr = xs ? xs + r0 * nb : NULL;
#if PAIR == 2
                if (use_panels && n_g == 2 && rows >= 8) {
                    two_panels(panels, panels + nb * KB * G, K, xr, ldx, rows, acc0, acc1);
                    store_rows(acc0, rows, G, bias, yout, ldy, y_bf16, r0, g0 * G);
                    store_rows(acc1, rows, N - (g0 + 1) * G < G ? (int)(N - (g0 + 1) * G) : G, bias, yout, ldy,
                               y_bf16, r0, (g0 + 1) * G);
                    continue;
                }
#endif
                for (int64_t i = 0; i < n_g; i++) {
                    int64_t g = g0 + i;
#if TILE8
                    if (use_panels)
                        panel_rows8(panels + i * nb * KB * G, K, xr, ldx, rows, acc0);
                    else
                        group8(fmt, w + g * nb * bb, bb, nb, xr, ldx, rows, K, xsr, xp ? xp + r0 * nb * KB : NULL,
                               acc0);
                    store_rows(acc0, rows, N - g * G < G ? (int)(N - g * G) : G, bias, yout, ldy, y_bf16, r0, g * G);
                    continue;
#endif
#if defined(__AVX512F__)
                    if (fmt == Q8_0 && rows == 1) {
                        row_one_q8(w + g * nb * bb, bb, nb, xr, K, acc0);
                        store_rows(acc0, 1, N - g * G < G ? (int)(N - g * G) : G, bias, yout, ldy, y_bf16, r0, g * G);
                        continue;
                    }
#endif
#if AMX
                    if (xpad) {
                        group_amx_rows(fmt, w + g * nb * bb, bb, nb, xpad + r0 * ldp, ldp, rows, xsr, acc0);
                        store_rows(acc0, rows, N - g * G < G ? (int)(N - g * G) : G, bias, yout, ldy, y_bf16, r0,
                                   g * G);
                        continue;
                    }
#endif
#if defined(__AVX512BF16__)
                    if ((dp4 && rows > 1) || dp8) {
                        const uint16_t *xb = (const uint16_t *)xin + r0 * ldx_in;
                        group_dp(fmt, w + g * nb * bb, bb, nb, xb, ldx_in, rows, K, xsr, acc0);
                        store_rows(acc0, rows, N - g * G < G ? (int)(N - g * G) : G, bias, yout, ldy, y_bf16, r0,
                                   g * G);
                        continue;
                    }
#endif
                    if (rows < 4)
                        for (int r = 0; r < rows; r++) {
#if defined(__AVX512BF16__)
                            if (x_bf16 && minimum) {
                                const uint16_t *xb = (const uint16_t *)xin + (r0 + r) * ldx_in;
                                row_one_q4_dp(fmt, w + g * nb * bb, bb, nb, xb, K, xsr + r * nb, acc0 + r * G);
                                continue;
                            }
#endif
                            row_one(fmt, w + g * nb * bb, bb, nb, xr + r * ldx, K, xsr ? xsr + r * nb : NULL,
                                    acc0 + r * G);
                        }
                    else if (use_panels)
                        dot_rows(xr, ldx, rows, K, panels + i * nb * KB * G, acc0);
                    else
                        blockwise_group(fmt, w + g * nb * bb, bb, nb, xr, ldx, rows, K, xsr, acc0);
                    store_rows(acc0, rows, N - g * G < G ? (int)(N - g * G) : G, bias, yout, ldy, y_bf16, r0, g * G);
                }
            }
        }
        free(panels);
#if AMX
        if (xpad) _tile_release();
#endif
    }
    free(xpad);
    free(scratch);
    return failed ? -2 : 0;
}

/* The whole weight as fp32, transposed: out [K, N] row-major, so each block row is a run of vector stores
 * (prompt shapes run torch's fp32 GEMM over it). */
int dequantize(const uint8_t *w, int fmt, int64_t N, int64_t K, float *out, int nthreads) {
    if (fmt == BF16_ROWS && K > 0 && N > 0) {
        const uint16_t *wr = (const uint16_t *)w;
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t k = 0; k < K; k++)
            for (int64_t n = 0; n < N; n++) out[k * N + n] = bf16_to_f32(wr[n * K + k]);
        return 0;
    }
    int64_t bb = block_nbytes(fmt);
    if (bb < 0 || K <= 0 || N <= 0) return -1;
    if (is_q8(fmt)) return dequantize_q8(w, fmt, N, K, out, nthreads);
    int64_t nb = (K + KB - 1) / KB, groups = (N + G - 1) / G;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        float wv[KB * G] __attribute__((aligned(64))), d[G] __attribute__((aligned(64)));
        float m[G] __attribute__((aligned(64)));
        int cols = N - g * G < G ? (int)(N - g * G) : G;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + (g * nb + b) * bb;
            decode(fmt, blk, wv);
            scales(fmt, blk, d, m);
            int kn = K - b * KB < KB ? (int)(K - b * KB) : KB;
            for (int k = 0; k < kn; k++) {
                float *to = out + (b * KB + k) * N + g * G;
                float row[G] __attribute__((aligned(64)));
                for (int j = 0; j < NV; j++) {
                    vf v = ldv(wv + k * G + j * VL);
                    if (fmt == Q8_0)
                        v = ldv(d + j * VL) * v;
                    else if (fmt == Q4_0 || fmt == Q4_1)
                        v = ldv(d + j * VL) * v + ldv(m + j * VL);
                    stv(row + j * VL, v);
                }
                if (cols == G)
                    memcpy(to, row, sizeof row);
                else
                    memcpy(to, row, sizeof(float) * cols);
            }
        }
    }
    return 0;
}
