/* Weight-only linear layers for the decode shapes: y[M,N] = x[M,K] . W[N,K]^T (+ bias), x and y fp32, W packed
 * (kernels/quant_linear.py writes the packing) as fp32, bf16, Q8_0, Q4_0 or Q4_1 blocks.
 *
 * Packing: output columns in groups of 16, the reduction dimension in blocks of 32; each (group, block) is one
 * contiguous run of bytes, groups one after another, so a thread streams its groups' weights once per call.
 *   f32:  float  w[32][16]                         bf16: uint16 w[32][16]
 *   q8_0: fp16 d[16], int8 q[32][16]               (w = d q)
 *   q4_0: fp16 d[16], uint8 q[16][16]              (w = d (q - 8); byte p,c holds k=2p low, k=2p+1 high)
 *   q4_1: fp16 d[16], fp16 m[16], uint8 q[16][16]  (w = d q + m)
 * A block's quants are turned into 16-lane fp32 vectors once and used by every row of x; scales are applied once
 * per block (sum_k x_k (d q_k + m) = d sum_k x_k q_k + m sum_k x_k), so a quantized product is the fp32 product
 * of the dequantized weights up to the order of fp32 summation. Written with GCC vector types so one source
 * compiles to SSE2, AVX2 or AVX-512 as -march says (kernels/cpu_isa.py). Returns 0, -1 on bad arguments, -2 out of memory.
 */
#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef _Float16 v16h __attribute__((vector_size(32)));

enum { F32 = 0, BF16 = 1, Q8_0 = 2, Q4_0 = 3, Q4_1 = 4 };
#define G 16
#define KB 32
#define MT 64
#ifndef PANEL_ROWS
#define PANEL_ROWS 16
#endif
///* from this many rows on, a group is dequantized whole once and tiled over */
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
    }
    return -1;
}

static inline v16f load_f(const void *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 16 fp16 scales as fp32. */
static inline v16f load_h(const void *p) {
    v16f v;
#if defined(__AVX512F__)
    _mm512_storeu_ps((float *)&v, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)));
#elif defined(__F16C__)
    _mm256_storeu_ps((float *)&v, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)));
    _mm256_storeu_ps((float *)&v + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p + 1)));
#else
    v16h h;
    memcpy(&h, p, sizeof h);
    v = __builtin_convertvector(h, v16f);
#endif
    return v;
}

/* Sixteen integers (int8, or uint8 after the nibble split) widened to fp32 into `out`: the compilers do not
 * vectorise these conversions from generic vector code, so each level has its own. */
static inline void widen_s8(__attribute__((unused)) const uint8_t *p, float *out) {
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

static inline void widen_nibbles(const uint8_t *p, float *lo_out, float *hi_out) {
#if defined(__AVX512F__) || defined(__AVX2__)
    const __m128i mask = _mm_set1_epi8(15);
    __m128i q = _mm_loadu_si128((const __m128i *)p);
    __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
#if defined(__AVX512F__)
    _mm512_storeu_ps(lo_out, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)));
    _mm512_storeu_ps(hi_out, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)));
#else
    _mm256_storeu_ps(lo_out, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
    _mm256_storeu_ps(lo_out + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
    _mm256_storeu_ps(hi_out, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
    _mm256_storeu_ps(hi_out + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))));
#endif
#else
    for (int c = 0; c < G; c++) lo_out[c] = (float)(p[c] & 15), hi_out[c] = (float)(p[c] >> 4);
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

/* One block's 32 rows of 16 columns as fp32 (unscaled quants for the quantized formats); d and m its scales. */
static inline void decode(int fmt, const uint8_t *b, v16f *w, v16f *d, v16f *m) {
    switch (fmt) {
    case F32:
        for (int k = 0; k < KB; k++) w[k] = load_f(b + k * 64);
        return;
    case BF16:
        for (int k = 0; k < KB; k++) widen_bf16(b + k * 32, (float *)&w[k]);
        return;
    case Q8_0:
        *d = load_h(b);
        for (int k = 0; k < KB; k++) widen_s8(b + 32 + k * 16, (float *)&w[k]);
        return;
    default: {
        const uint8_t *qs = b + (fmt == Q4_1 ? 64 : 32);
        *d = load_h(b);
        *m = fmt == Q4_1 ? load_h(b + 32) : *d * -8.0f;
        for (int p = 0; p < KB / 2; p++) widen_nibbles(qs + p * 16, (float *)&w[2 * p], (float *)&w[2 * p + 1]);
    }
    }
}

#if defined(__AVX512F__)
#define RT 8 /* rows per register tile: 8 (or 4 x 2 halves on AVX2) independent accumulators cover the FMA latency */
#else
#define RT 4
#endif

/* acc[r] = sum_{k < kn} x[r][k] w[k] for `rows` rows, RT at a time (each weight vector loaded once per RT). */
static inline void dot_rows(const float *x, int64_t ldx, int rows, int kn, const v16f *w, v16f *acc) {
    int r = 0;
    for (; r + RT <= rows; r += RT) {
        v16f a[RT];
        for (int i = 0; i < RT; i++) a[i] = (v16f){0};
        for (int k = 0; k < kn; k++) {
            v16f wk = w[k];
            for (int i = 0; i < RT; i++) a[i] += x[(r + i) * ldx + k] * wk;
        }
        for (int i = 0; i < RT; i++) acc[r + i] = a[i];
    }
    for (; RT > 4 && r + 4 <= rows; r += 4) {
        v16f a[4] = {{0}, {0}, {0}, {0}};
        for (int k = 0; k < kn; k++)
            for (int i = 0; i < 4; i++) a[i] += x[(r + i) * ldx + k] * w[k];
        for (int i = 0; i < 4; i++) acc[r + i] = a[i];
    }
    for (; r < rows; r++) {
        const float *x0 = x + r * ldx;
        v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int k = 0;
        for (; k + 4 <= kn; k += 4) {
            a0 += x0[k] * w[k];
            a1 += x0[k + 1] * w[k + 1];
            a2 += x0[k + 2] * w[k + 2];
            a3 += x0[k + 3] * w[k + 3];
        }
        for (; k < kn; k++) a0 += x0[k] * w[k];
        acc[r] = (a0 + a1) + (a2 + a3);
    }
}

/* One row against one block, the block decoded straight into the products (no trip through memory): a decode
 * step of one sequence reads each weight once and is bound by how fast it can be widened. */
static inline v16f dot_one(int fmt, const uint8_t *b, const float *x, int kn) {
    v16f a0 = {0}, a1 = {0}, w0, w1;
    int k = 0;
    switch (fmt) {
    case F32:
        for (; k + 2 <= kn; k += 2) a0 += x[k] * load_f(b + k * 64), a1 += x[k + 1] * load_f(b + k * 64 + 64);
        if (k < kn) a0 += x[k] * load_f(b + k * 64);
        break;
    case BF16:
        for (; k + 2 <= kn; k += 2) {
            widen_bf16(b + k * 32, (float *)&w0);
            widen_bf16(b + k * 32 + 32, (float *)&w1);
            a0 += x[k] * w0, a1 += x[k + 1] * w1;
        }
        if (k < kn) widen_bf16(b + k * 32, (float *)&w0), a0 += x[k] * w0;
        break;
    case Q8_0:
        for (; k + 2 <= kn; k += 2) {
            widen_s8(b + 32 + k * 16, (float *)&w0);
            widen_s8(b + 48 + k * 16, (float *)&w1);
            a0 += x[k] * w0, a1 += x[k + 1] * w1;
        }
        if (k < kn) widen_s8(b + 32 + k * 16, (float *)&w0), a0 += x[k] * w0;
        break;
    default: {
        const uint8_t *qs = b + (fmt == Q4_1 ? 64 : 32);
        for (; k + 2 <= kn; k += 2) {
            widen_nibbles(qs + k * 8, (float *)&w0, (float *)&w1);
            a0 += x[k] * w0, a1 += x[k + 1] * w1;
        }
        if (k < kn) widen_nibbles(qs + k * 8, (float *)&w0, (float *)&w1), a0 += x[k] * w0;
    }
    }
    return a0 + a1;
}

/* One row against a whole group: blocks decoded straight into the products, the sum kept in registers. A decode
 * step of a few sequences reads each weight once and is bound by how fast it is widened. */
static inline v16f row_one(int fmt, const uint8_t *blk, int64_t bb, int64_t nb, const float *x, int64_t K,
                           const float *xs) {
    v16f acc = {0};
    for (int64_t b = 0; b < nb; b++, blk += bb) {
        int kn = K - b * KB < KB ? (int)(K - b * KB) : KB;
        for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + PREFETCH + off);
        v16f part = dot_one(fmt, blk, x + b * KB, kn);
        if (fmt == F32 || fmt == BF16)
            acc += part;
        else if (fmt == Q8_0)
            acc += load_h(blk) * part;
        else {
            v16f d = load_h(blk);
            acc += d * part + (fmt == Q4_1 ? load_h(blk + 32) : d * -8.0f) * xs[b];
        }
    }
    return acc;
}

/* xs[r * nb + b]: the sum of row r's x over block b (the term a block's minimum multiplies). */
static void block_sums(const float *x, int64_t ldx, int64_t M, int64_t K, float *xs, int nthreads) {
    int64_t nb = (K + KB - 1) / KB;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K > 65536)
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++) {
            float s = 0;
            for (int64_t k = b * KB; k < K && k < (b + 1) * KB; k++) s += x[r * ldx + k];
            xs[r * nb + b] = s;
        }
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);                  /* round to nearest even */
}

/* One group for a few rows (4 to PANEL_ROWS): each block decoded into registers' worth of L1 and used by every
 * row at once, with the block's scales applied to the rows' partial sums. */
static void blockwise_group(int fmt, const uint8_t *blk, int64_t bb, int64_t nb, const float *x, int64_t ldx,
                            int rows, int64_t K, const float *xs, v16f *acc) {
    v16f wv[KB], part[MT], d = {0}, m = {0};
    for (int r = 0; r < rows; r++) acc[r] = (v16f){0};
    for (int64_t b = 0; b < nb; b++, blk += bb) {
        int kn = K - b * KB < KB ? (int)(K - b * KB) : KB;
        for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + PREFETCH + off);
        decode(fmt, blk, wv, &d, &m);
        dot_rows(x + b * KB, ldx, rows, kn, wv, part);
        if (fmt == F32 || fmt == BF16)
            for (int r = 0; r < rows; r++) acc[r] += part[r];
        else if (fmt == Q8_0)
            for (int r = 0; r < rows; r++) acc[r] += d * part[r];
        else
            for (int r = 0; r < rows; r++) acc[r] += d * part[r] + m * xs[r * nb + b];
    }
}

/* A group's whole weight as an fp32 panel [K][16], dequantized (d q + m): what the multi-row tiles read, decoded
 * once per call however many rows there are, so their accumulators stay in registers over the whole of K. */
static void decode_panel(int fmt, const uint8_t *blk, int64_t bb, int64_t nb, v16f *panel) {
    v16f d = {0}, m = {0};
    for (int64_t b = 0; b < nb; b++, blk += bb) {
        v16f *p = panel + b * KB;
        for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + PREFETCH + off);
        decode(fmt, blk, p, &d, &m);
        if (fmt == Q8_0)
            for (int k = 0; k < KB; k++) p[k] *= d;
        else if (fmt == Q4_0 || fmt == Q4_1)
            for (int k = 0; k < KB; k++) p[k] = d * p[k] + m;
    }
}

#if defined(__AVX512F__) && !defined(NO_PAIR)
/* Two panels at once for 8 rows at a time: 16 accumulators, and each broadcast of x feeds two FMAs, so the loads
 * no longer outnumber the FMAs (AVX-512 has the 32 registers this needs). */
static void two_panels(const v16f *p0, const v16f *p1, int64_t K, const float *x, int64_t ldx, int rows, v16f *acc0,
                       v16f *acc1) {
    int r = 0;
    for (; r + 8 <= rows; r += 8) {
        v16f a[8], c[8];
        for (int i = 0; i < 8; i++) a[i] = c[i] = (v16f){0};
        for (int64_t k = 0; k < K; k++) {
            v16f u = p0[k], v = p1[k];
            for (int i = 0; i < 8; i++) {
                float xv = x[(r + i) * ldx + k];
                a[i] += xv * u;
                c[i] += xv * v;
            }
        }
        for (int i = 0; i < 8; i++) acc0[r + i] = a[i], acc1[r + i] = c[i];
    }
    if (r < rows) {
        dot_rows(x + r * ldx, ldx, rows - r, (int)K, p0, acc0 + r);
        dot_rows(x + r * ldx, ldx, rows - r, (int)K, p1, acc1 + r);
    }
}
#define PAIR 2
#else
#define PAIR 1
#endif

static void store_rows(const v16f *acc, int rows, int cols, const float *bias, void *yout, int64_t ldy, int y_bf16,
                       int64_t row0, int64_t col0) {
    for (int r = 0; r < rows; r++) {
        float lane[G];
        memcpy(lane, &acc[r], sizeof lane);
        if (bias)
            for (int c = 0; c < cols; c++) lane[c] += bias[col0 + c];
        int64_t at = (row0 + r) * ldy + col0;
        if (y_bf16)
            for (int c = 0; c < cols; c++) ((uint16_t *)yout)[at + c] = f32_to_bf16(lane[c]);
        else
            memcpy((float *)yout + at, lane, sizeof(float) * cols);
    }
}

/* y = x W^T + bias. x [M, K] with row stride ldx, y [M, N] with row stride ldy, each fp32 or (x_bf16, y_bf16)
 * bf16, as torch holds them: bf16 activations are widened once here, not by the caller. */
int linear(const void *xin, int64_t ldx, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int fmt, int64_t N,
           const float *bias, void *yout, int64_t ldy, int y_bf16, int nthreads) {
    int64_t bb = block_nbytes(fmt);
    if (bb < 0 || M < 0 || K <= 0 || N <= 0 || ldx < K || ldy < N) return -1;
    if (M == 0) return 0;
    int64_t nb = (K + KB - 1) / KB, groups = (N + G - 1) / G;
    int minimum = fmt == Q4_0 || fmt == Q4_1;
    float *scratch = NULL, *xs = NULL;
    const float *x = xin;
    if (x_bf16 || minimum) {
        scratch = malloc(sizeof(float) * ((x_bf16 ? M * K : 0) + (minimum ? M * nb : 0)));
        if (!scratch) return -2;
    }
    if (x_bf16) {
        for (int64_t r = 0; r < M; r++)
            for (int64_t k = 0; k < K; k++) scratch[r * K + k] = bf16_to_f32(((const uint16_t *)xin)[r * ldx + k]);
        x = scratch, ldx = K;
    }
    if (minimum) {
        xs = scratch + (x_bf16 ? M * K : 0);
        block_sums(x, ldx, M, K, xs, nthreads);
    }
    int64_t tasks = (groups + PAIR - 1) / PAIR;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        int use_panels = M >= PANEL_ROWS;
        v16f *panels = use_panels ? aligned_alloc(64, sizeof(v16f) * PAIR * nb * KB) : NULL;
        failed |= use_panels && !panels;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            if (use_panels && !panels) continue;
            v16f acc0[MT], acc1[MT];
            int64_t g0 = t * PAIR, n_g = groups - g0 < PAIR ? groups - g0 : PAIR;
            if (use_panels)
                for (int64_t i = 0; i < n_g; i++) decode_panel(fmt, w + (g0 + i) * nb * bb, bb, nb, panels + i * nb * KB);
            for (int64_t r0 = 0; r0 < M; r0 += MT) {
                int rows = M - r0 < MT ? (int)(M - r0) : MT;
                const float *xr = x + r0 * ldx, *xsr = xs ? xs + r0 * nb : NULL;
#if PAIR == 2
                if (use_panels && n_g == 2 && rows >= 8) {
                    two_panels(panels, panels + nb * KB, K, xr, ldx, rows, acc0, acc1);
                    store_rows(acc0, rows, G, bias, yout, ldy, y_bf16, r0, g0 * G);
                    store_rows(acc1, rows, N - (g0 + 1) * G < G ? (int)(N - (g0 + 1) * G) : G, bias, yout, ldy,
                               y_bf16, r0, (g0 + 1) * G);
                    continue;
                }
#endif
                for (int64_t i = 0; i < n_g; i++) {
                    int64_t g = g0 + i;
                    if (rows < 4)
                        for (int r = 0; r < rows; r++)
                            acc0[r] = row_one(fmt, w + g * nb * bb, bb, nb, xr + r * ldx, K, xsr ? xsr + r * nb : NULL);
                    else if (use_panels)
                        dot_rows(xr, ldx, rows, (int)K, panels + i * nb * KB, acc0);
                    else
                        blockwise_group(fmt, w + g * nb * bb, bb, nb, xr, ldx, rows, K, xsr, acc0);
                    store_rows(acc0, rows, N - g * G < G ? (int)(N - g * G) : G, bias, yout, ldy, y_bf16, r0, g * G);
                }
            }
        }
        free(panels);
    }
    if (failed) {
        free(scratch);
        return -2;
    }
    free(scratch);
    return 0;
}

/* The whole weight as fp32, transposed: out [K, N] row-major, so each block row is one vector store (prompt
 * shapes run torch's fp32 GEMM over it). */
int dequantize(const uint8_t *w, int fmt, int64_t N, int64_t K, float *out, int nthreads) {
    int64_t bb = block_nbytes(fmt);
    if (bb < 0 || K <= 0 || N <= 0) return -1;
    int64_t nb = (K + KB - 1) / KB, groups = (N + G - 1) / G;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        v16f wv[KB], d = {0}, m = {0};
        int cols = N - g * G < G ? (int)(N - g * G) : G;
        for (int64_t b = 0; b < nb; b++) {
            decode(fmt, w + (g * nb + b) * bb, wv, &d, &m);
            int kn = K - b * KB < KB ? (int)(K - b * KB) : KB;
            for (int k = 0; k < kn; k++) {
                v16f v = fmt == F32 || fmt == BF16 ? wv[k] : fmt == Q8_0 ? d * wv[k] : d * wv[k] + m;
                float *to = out + (b * KB + k) * N + g * G;
                if (cols == G)
                    memcpy(to, &v, sizeof v);
                else
                    memcpy(to, &v, sizeof(float) * cols);
            }
        }
    }
    return 0;
}
