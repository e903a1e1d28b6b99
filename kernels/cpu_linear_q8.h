/* Integer products against quantized blocks, as llama.cpp computes them: x quantized per row and block of 32 to
 * int8 with one fp32 scale, each weight block's quants multiplied by those in integers, the block's fp32 scales
 * applied once to its integer sum, fp32 accumulation across blocks.
 *
 * A decode step's 4-bit weights through the fp32 paths cost an unpack, a convert and an FMA per weight: bound by
 * those instructions, not by memory, on a real AVX2 core (Zen 3: 3.5x the bytes limit at one row). Here 32
 * products of one row are one vpmaddubsw (AVX2) or 64 one vpdpbusd (AVX512-VNNI), and a 4-bit pair of quants
 * needs only a mask and a shift.
 *
 * Activations (quantize_q8): per row and block, d = max|x| / 127, q = rint(x * (1 / d)) (fp32, ties to even;
 * q = 0 where d = 0), S = sum q; zero past K. Per (row, column, block), I = sum_k c_k q_k over the weight's codes
 * c (Q8_0: the int8 quant; 4-bit: the nibble 0..15), in int32, exactly; then
 *   Q8_0: y += (dw dx) I        Q4_0: y += (dw dx) (I - 8 S)        Q4_1: y += (dw dx) I + mw (dx S)
 * tests/test_int8_linear.py holds a NumPy reference of this arithmetic.
 *
 * Packing (kernels/quant_linear.py, pack_q8): per (group of 16 columns, block), fp16 d[16] (Q4_1: then fp16
 * m[16]), then runs of 64 bytes, each [16 columns][4 k]:
 *   Q8_0: 8 runs, run j holds k = 4j .. 4j + 3 as c + 128 (uint8: what vpdpbusd multiplies unsigned);
 *   4-bit: 4 runs, run p's low nibbles hold k = 8p .. 8p + 3 and its high nibbles k = 8p + 4 .. 8p + 7.
 * A run is one zmm of 16 columns x 4 k for vpdpbusd, or two ymm of 8 columns for vpmaddubsw: after the 4-bit
 * mask and shift, each 32-bit lane holds one column's 4 consecutive quants against one broadcast of 4 x quants.
 *
 * Included by cpu_linear.c, which defines G, KB, PREFETCH, block_nbytes and store_rows.
 */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_ISA 2 /* vpdpbusd on zmm: 16 columns a vector */
#define Q8_RT 8
#elif defined(__AVX2__)
#define Q8_ISA 1 /* vpmaddubsw + vpmaddwd on ymm: 8 columns a vector */
#define Q8_RT 4
#else
#define Q8_ISA 0 /* plain C */
#define Q8_RT 4
#endif

enum { Q8_0_Q8 = 6, Q4_0_Q8 = 7, Q4_1_Q8 = 8 };

/* The offset a block's sums carry per unit of S: Q4_0's 8, and Q8_0's 128 where vpdpbusd read c + 128. */
#define Q8_OFFSET(fmt) ((fmt) == Q4_0_Q8 ? 8 : (fmt) == Q8_0_Q8 && Q8_ISA == 2 ? 128 : 0)

/* A block's term beside I, from its row's scale dx and sum S, as the scaling reads it: Q4_1's dx S (fp32, its bits
 * in the int32), the offset's off S otherwise. The same operations as the scaling's own, so the same values. */
static inline int32_t q8_term(int fmt, float dx, int32_t s) {
    if (fmt != Q4_1_Q8) return Q8_OFFSET(fmt) * s;
    const float t = dx * (float)s;
    int32_t bits;
    memcpy(&bits, &t, sizeof bits);
    return bits;
}

static inline float q8_term_f32(const int32_t *t) {
    float f;
    memcpy(&f, t, sizeof f);
    return f;
}

static inline int is_q8(int fmt) { return fmt == Q8_0_Q8 || fmt == Q4_0_Q8 || fmt == Q4_1_Q8; }

/* Where a block's quants start: after d[16] (and m[16]). */
static inline int64_t q8_quants(int fmt) { return fmt == Q4_1_Q8 ? 4 * G : 2 * G; }

/* One block of 32 values as Q8: its quants, scale and sum, in the arithmetic the header states. The vector forms
 * compute the same fp32 operations lane by lane (max, d = amax / 127, 1 / d, v * id, ties-to-even conversion), so
 * every level gives the same bytes; they matter because a step quantizes each linear's input (a decoder layer's
 * four, 16 rows of 576-1536 values) and the scalar form took about 3 cycles a value. */
static inline void quantize_block_q8(const float *v, int8_t *q, float *d_out, int32_t *s_out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(q1));
    *d_out = d;
    *s_out = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 w[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        w[i] = _mm256_loadu_ps(v + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, w[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i i[4];
    for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(w[j], _mm256_set1_ps(id)));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *d_out = d;
    *s_out = _mm_cvtsi128_si32(s4);
#else
    float amax = 0.0f;
    for (int k = 0; k < KB; k++) amax = fabsf(v[k]) > amax ? fabsf(v[k]) : amax; /* fmaxf: a libm call here */
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t s = 0;
    for (int k = 0; k < KB; k++) {
        const int32_t qk = (int32_t)__builtin_rintf(v[k] * id);
        q[k] = (int8_t)qk;
        s += qk;
    }
    *d_out = d;
    *s_out = s;
#endif
}

/* Row x (K values, fp32 or bf16) as Q8 blocks: block b's quants at xq + b * bs * KB, its scale and sum at xd[b * bs]
 * and xs[b * bs] (bs 1: the row's blocks in a run; bs R: one of R rows side by side per block, linear_q8). */
static void quantize_row_q8(const void *x, int x_bf16, int64_t K, int8_t *xq, float *xd, int32_t *xs, int64_t bs) {
    const int64_t nb = (K + KB - 1) / KB;
    for (int64_t b = 0; b < nb; b++) {
        float v[KB] __attribute__((aligned(64)));
        const int64_t k0 = b * KB;
        const int kn = K - k0 < KB ? (int)(K - k0) : KB;
        const float *src = v;
        if (!x_bf16 && kn == KB)
            src = (const float *)x + k0;
        else if (kn == KB) {
            widen_bf16((const uint8_t *)((const uint16_t *)x + k0), v);
            widen_bf16((const uint8_t *)((const uint16_t *)x + k0 + G), v + G);
        } else
            for (int k = 0; k < KB; k++)
                v[k] = k >= kn   ? 0.0f
                       : x_bf16 ? bf16_to_f32(((const uint16_t *)x)[k0 + k])
                                : ((const float *)x)[k0 + k];
        quantize_block_q8(src, xq + k0 * bs, xd + b * bs, xs + b * bs);
    }
}

/* Row r of quantize_rows_q8. */
static inline void quantize_tile_row(const void *x, int64_t ldx, int x_bf16, int64_t r, int64_t M, int64_t K,
                                     int8_t *xq, float *xd, int32_t *xs, int tile_fmt) {
    const int64_t nb = (K + KB - 1) / KB, es = x_bf16 ? 2 : 4, r0 = r - r % Q8_RT;
    /* tiled: row r - r0 of the tile from r0, whose R rows (Q8_RT, fewer in the last) lie side by side per block */
    const int64_t bs = !tile_fmt ? 1 : M - r0 < Q8_RT ? M - r0 : Q8_RT, at = tile_fmt ? r0 * nb + r - r0 : r * nb;
    quantize_row_q8((const char *)x + r * ldx * es, x_bf16, K, xq + at * KB, xd + at, xs + at, bs);
    if (tile_fmt)
        for (int64_t b = 0; b < nb; b++) xs[at + b * bs] = q8_term(tile_fmt, xd[at + b * bs], xs[at + b * bs]);
}

/* M rows at row stride ldx; in parallel only where there is enough of them (an OpenMP region costs more than a
 * row). `tile_fmt` (0, or a packing's format): the rows in tiles of Q8_RT (the last of fewer: spaced as a full
 * tile, 4-6 rows ran up to 9% slower), a tile's rows side by side per block, and in xs each block's term (q8_term)
 * for that format in place of its sum: linear_q8's vector path. */
static void quantize_rows_q8(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, int8_t *xq, float *xd,
                             int32_t *xs, int tile_fmt, int nthreads) {
    if (M * K <= 65536) {
        for (int64_t r = 0; r < M; r++) quantize_tile_row(x, ldx, x_bf16, r, M, K, xq, xd, xs, tile_fmt);
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < M; r++) quantize_tile_row(x, ldx, x_bf16, r, M, K, xq, xd, xs, tile_fmt);
}

int quantize_q8(const void *x, int64_t ldx, int x_bf16, int64_t M, int64_t K, int8_t *xq, float *xd, int32_t *xs,
                int nthreads) {
    if (M < 0 || K <= 0 || ldx < K) return -1;
    quantize_rows_q8(x, ldx, x_bf16, M, K, xq, xd, xs, 0, nthreads);
    return 0;
}

#if Q8_ISA == 2
typedef __m512i q8_ints; /* one row's I for the group's 16 columns */
#elif Q8_ISA == 1
typedef struct {
    __m256i lo, hi; /* columns 0..7, 8..15 */
} q8_ints;
#else
typedef struct {
    int32_t c[G];
} q8_ints;
#endif

#if Q8_ISA == 1
/* AVX2, 4-bit, from 2 rows: a block's codes laid out once, [run p][low nibbles of columns 0-7, high 0-7, low 8-15,
 * high 8-15], and read back from L1 by each pair of rows (q4_rows_ints_avx2). block_ints holds them in registers for
 * all of a tile's rows, beside the rows' sums and y, and gcc spilled to the stack: llvm-mca's Zen 3 model gives a
 * block of Q4_1 at 4 rows 100 cycles that way and 74 this way (Skylake's 81 and 73); one row stays on block_ints,
 * where nothing spills and the codes' round trip through memory would cost. */
static inline __attribute__((always_inline)) void q4_codes_avx2(const uint8_t *qs, __m256i *codes) {
    const __m256i mask = _mm256_set1_epi8(15);
    for (int p = 0; p < 4; p++) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(qs + 64 * p));
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(qs + 64 * p + 32));
        codes[4 * p] = _mm256_and_si256(v0, mask);
        codes[4 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), mask);
        codes[4 * p + 2] = _mm256_and_si256(v1, mask);
        codes[4 * p + 3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), mask);
    }
}

/* The I of n (1 or 2) rows (xq + i * ldq: row i's 32 quants at the block) against q4_codes_avx2's layout, each code
 * loaded once for both rows; the products add up in int16 as in block_ints. Each sum is passed through an empty asm
 * so that gcc keeps the adds in order: it regroups a chain of integer adds into a tree that holds all 16 products at
 * once (spills again). */
static inline __attribute__((always_inline)) void q4_rows_ints_avx2(const __m256i *codes, const int8_t *xq,
                                                                     int64_t ldq, const int n, q8_ints *a) {
    __m256i sums[2][2]; /* [row][columns 0-7, 8-15] */
    for (int i = 0; i < n; i++) sums[i][0] = sums[i][1] = _mm256_setzero_si256();
    for (int p = 0; p < 4; p++) {
        __m256i xs[2][2]; /* [row][k 8p..8p+3, 8p+4..8p+7] broadcast */
        for (int i = 0; i < n; i++) {
            int32_t x0, x1;
            memcpy(&x0, xq + i * ldq + 8 * p, 4);
            memcpy(&x1, xq + i * ldq + 8 * p + 4, 4);
            xs[i][0] = _mm256_set1_epi32(x0), xs[i][1] = _mm256_set1_epi32(x1);
        }
        for (int c = 0; c < 4; c++) {
            const __m256i w = codes[4 * p + c];
            for (int i = 0; i < n; i++) {
                __m256i *sum = &sums[i][c / 2];
                *sum = _mm256_add_epi16(*sum, _mm256_maddubs_epi16(w, xs[i][c % 2]));
                __asm__("" : "+x"(*sum));
            }
        }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < n; i++)
        a[i] = (q8_ints){_mm256_madd_epi16(sums[i][0], ones), _mm256_madd_epi16(sums[i][1], ones)};
}
#endif

/* I for R rows (xq[r * ldq ..] the block's 32 quants of row r) against one block's quants `qs`: the integer sums
 * of products, exactly, kept in registers. Q8_0 through vpdpbusd reads its quants unsigned (c + 128), so there its
 * sums carry 128 S; group_q8 takes that off with the 4-bit offset. vpmaddubsw multiplies signs instead. */
static inline __attribute__((always_inline)) void block_ints(const int fmt, const uint8_t *qs, const int8_t *xq,
                                                              int64_t ldq, const int R, q8_ints *a) {
#if Q8_ISA == 2
    for (int r = 0; r < R; r++) a[r] = _mm512_setzero_si512();
    if (fmt == Q8_0_Q8) {
        for (int j = 0; j < 8; j++) {
            const __m512i w = _mm512_loadu_si512(qs + 64 * j);
            for (int r = 0; r < R; r++) {
                int32_t xv;
                memcpy(&xv, xq + r * ldq + 4 * j, 4);
                a[r] = _mm512_dpbusd_epi32(a[r], w, _mm512_set1_epi32(xv));
            }
        }
    } else {
        const __m512i mask = _mm512_set1_epi8(15);
        for (int p = 0; p < 4; p++) {
            const __m512i v = _mm512_loadu_si512(qs + 64 * p);
            const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
            for (int r = 0; r < R; r++) {
                int32_t x0, x1;
                memcpy(&x0, xq + r * ldq + 8 * p, 4);
                memcpy(&x1, xq + r * ldq + 8 * p + 4, 4);
                a[r] = _mm512_dpbusd_epi32(a[r], lo, _mm512_set1_epi32(x0));
                a[r] = _mm512_dpbusd_epi32(a[r], hi, _mm512_set1_epi32(x1));
            }
        }
    }
#elif Q8_ISA == 1
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; r++) a[r].lo = a[r].hi = _mm256_setzero_si256();
    if (fmt == Q8_0_Q8) { /* signed x signed: |x| against w with x's sign; pairs of products fit int16, not 8 */
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        for (int j = 0; j < 8; j++) {
            const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qs + 64 * j)), flip);
            const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qs + 64 * j + 32)), flip);
            for (int r = 0; r < R; r++) {
                int32_t xv;
                memcpy(&xv, xq + r * ldq + 4 * j, 4);
                const __m256i xb = _mm256_set1_epi32(xv), ax = _mm256_abs_epi8(xb);
                a[r].lo = _mm256_add_epi32(
                    a[r].lo, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xb)), ones));
                a[r].hi = _mm256_add_epi32(
                    a[r].hi, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xb)), ones));
            }
        }
    } else { /* 0..15 x int8: a pair of products is at most 3810, the block's 8 of them 30480, within int16 */
        const __m256i mask = _mm256_set1_epi8(15);
        for (int p = 0; p < 4; p++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(qs + 64 * p));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(qs + 64 * p + 32));
            const __m256i l0 = _mm256_and_si256(v0, mask), h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), mask);
            const __m256i l1 = _mm256_and_si256(v1, mask), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), mask);
            for (int r = 0; r < R; r++) {
                int32_t x0, x1;
                memcpy(&x0, xq + r * ldq + 8 * p, 4);
                memcpy(&x1, xq + r * ldq + 8 * p + 4, 4);
                const __m256i xa = _mm256_set1_epi32(x0), xb = _mm256_set1_epi32(x1);
                a[r].lo = _mm256_add_epi16(
                    a[r].lo, _mm256_add_epi16(_mm256_maddubs_epi16(l0, xa), _mm256_maddubs_epi16(h0, xb)));
                a[r].hi = _mm256_add_epi16(
                    a[r].hi, _mm256_add_epi16(_mm256_maddubs_epi16(l1, xa), _mm256_maddubs_epi16(h1, xb)));
            }
        }
        for (int r = 0; r < R; r++) {
            a[r].lo = _mm256_madd_epi16(a[r].lo, ones);
            a[r].hi = _mm256_madd_epi16(a[r].hi, ones);
        }
    }
#else
    for (int r = 0; r < R; r++)
        for (int c = 0; c < G; c++) {
            int32_t s = 0;
            for (int k = 0; k < KB; k++) {
                const uint8_t byte = qs[64 * (fmt == Q8_0_Q8 ? k / 4 : k / 8) + 4 * c + k % 4];
                const int32_t code = fmt == Q8_0_Q8 ? (int32_t)byte - 128 : (k % 8 < 4 ? byte & 15 : byte >> 4);
                s += code * xq[r * ldq + k];
            }
            a[r].c[c] = s;
        }
#endif
}

/* acc[R][16] = the products of R rows with one group of 16 columns, over all nb blocks: y += (dw dx) (I - off S)
 * (+ mw dx S), in registers. Row r's quants at block b are at xq + b * qb + r * qr, its scale and sum at
 * xd[b * db + r * dr] and xs[same]: a row's blocks in a run (qb = KB, qr = nb * KB, db = 1, dr = nb) or the R rows
 * side by side per block (R * KB, KB, R, 1), which reads every row from one pointer at fixed offsets.
 * `terms`: xs holds each block's term (q8_term) in place of its sum. On a Zen 5 the scaling shares two pipes with
 * vpdpbusd, and working out Q4_1's term (a conversion, a product, a broadcast) was 24 of their ~120 operations per
 * block at 8 rows. With the tiled layout and terms the built-in model's linears ran 1.06-1.13x faster at 8-32 rows
 * (gate/up), 1.04-1.10x (the Q8_0 lm_head), 1.00-1.10x (down, o) from run to run, the same results bit for bit
 * (`python -m pdserve.benchmarks.linear_rows --against`). */
static inline __attribute__((always_inline)) void group_q8(const int fmt, const uint8_t *blk, int64_t nb,
                                                            const int8_t *xq, const int64_t qb, const int64_t qr,
                                                            const float *xd, const int32_t *xs, const int64_t db,
                                                            const int64_t dr, const int terms, const int R,
                                                            float *acc) {
    const int32_t offset = Q8_OFFSET(fmt);
#if Q8_ISA == 2
    __m512 y[Q8_RT];
    for (int r = 0; r < R; r++) y[r] = _mm512_setzero_ps();
#elif Q8_ISA == 1
    __m256 y[Q8_RT][2];
    for (int r = 0; r < R; r++) y[r][0] = y[r][1] = _mm256_setzero_ps();
#else
    float y[Q8_RT][G];
    memset(y, 0, sizeof y);
#endif
    const int64_t bb = q8_quants(fmt) + (fmt == Q8_0_Q8 ? KB * G : KB * G / 2); /* a constant: no prefetch loop */
    for (int64_t b = 0; b < nb; b++, blk += bb) {
#pragma GCC unroll 9
        for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(blk + PREFETCH + off);
        /* AVX2, 4-bit, from 2 rows: summed with the scaling, a pair of rows at a time (q4_rows_ints_avx2) */
        const int pairs = Q8_ISA == 1 && fmt != Q8_0_Q8 && R > 1;
        q8_ints a[Q8_RT];
        if (!pairs) block_ints(fmt, blk + q8_quants(fmt), xq + b * qb, qr, R, a);
#if Q8_ISA == 2
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 mw = fmt == Q4_1_Q8 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 2 * G)))
                                         : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const float dx = xd[b * db + r * dr];
            const int32_t s = xs[b * db + r * dr];
            __m512i I = offset ? _mm512_sub_epi32(a[r], _mm512_set1_epi32(terms ? s : offset * s)) : a[r];
            y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(dw, _mm512_set1_ps(dx)), y[r]);
            if (fmt == Q4_1_Q8) {
                const float t = terms ? q8_term_f32(xs + b * db + r * dr) : dx * (float)s;
                y[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(t), y[r]);
            }
        }
#elif Q8_ISA == 1
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
        if (fmt == Q4_1_Q8) {
            m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 2 * G)));
            m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 2 * G + 16)));
        }
        __m256i codes[16] __attribute__((aligned(32)));
        if (pairs) q4_codes_avx2(blk + q8_quants(fmt), codes);
#pragma GCC unroll 4
        for (int r0 = 0; r0 < R; r0 += 2) {
            const int n = R - r0 < 2 ? R - r0 : 2;
            if (pairs) {
                if (R > 2) __asm__ volatile("" : : "r"(codes) : "memory"); /* each pair reads the codes back */
                q4_rows_ints_avx2(codes, xq + b * qb + r0 * qr, qr, n, a + r0);
            }
            for (int r = r0; r < r0 + n; r++) {
                const __m256 dx = _mm256_set1_ps(xd[b * db + r * dr]);
                const int32_t s = xs[b * db + r * dr];
                __m256i I0 = a[r].lo, I1 = a[r].hi;
                if (offset) {
                    const __m256i o = _mm256_set1_epi32(terms ? s : offset * s);
                    I0 = _mm256_sub_epi32(I0, o), I1 = _mm256_sub_epi32(I1, o);
                }
                y[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I0), _mm256_mul_ps(d0, dx), y[r][0]);
                y[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I1), _mm256_mul_ps(d1, dx), y[r][1]);
                if (fmt == Q4_1_Q8) {
                    const __m256 ms =
                        _mm256_set1_ps(terms ? q8_term_f32(xs + b * db + r * dr) : xd[b * db + r * dr] * (float)s);
                    y[r][0] = _mm256_fmadd_ps(m0, ms, y[r][0]);
                    y[r][1] = _mm256_fmadd_ps(m1, ms, y[r][1]);
                }
            }
        }
#else
        float d[G], m[G];
        load_h(blk, d);
        if (fmt == Q4_1_Q8) load_h(blk + 2 * G, m);
        for (int r = 0; r < R; r++) {
            const float dx = xd[b * db + r * dr];
            const int32_t s = xs[b * db + r * dr];
            for (int c = 0; c < G; c++) {
                y[r][c] += (d[c] * dx) * (float)(a[r].c[c] - (offset ? (terms ? s : offset * s) : 0));
                if (fmt == Q4_1_Q8) y[r][c] += m[c] * (terms ? q8_term_f32(xs + b * db + r * dr) : dx * (float)s);
            }
        }
#endif
    }
    for (int r = 0; r < R; r++) {
#if Q8_ISA == 2
        _mm512_storeu_ps(acc + r * G, y[r]);
#elif Q8_ISA == 1
        _mm256_storeu_ps(acc + r * G, y[r][0]);
        _mm256_storeu_ps(acc + r * G + 8, y[r][1]);
#else
        memcpy(acc + r * G, y[r], sizeof(float) * G);
#endif
    }
}

/* group_q8 with its format, rows and layout known to the compiler; `tiled`: a tile's rows side by side per block, with
 * the blocks' terms in xs (quantize_rows_q8). */
static void group_q8_rows(int fmt, const uint8_t *blk, int64_t nb, const int8_t *xq, const float *xd,
                          const int32_t *xs, int tiled, int rows, float *acc) {
#define Q8_LAYOUT(F, R)                                                                                                \
    if (tiled)                                                                                                         \
        group_q8(F, blk, nb, xq, R * KB, KB, xd, xs, R, 1, 1, R, acc);                                                 \
    else                                                                                                               \
        group_q8(F, blk, nb, xq, KB, nb * KB, xd, xs, 1, nb, 0, R, acc);
#define Q8_CASE(R)                                                                                                     \
    case R:                                                                                                            \
        if (fmt == Q8_0_Q8) {                                                                                          \
            Q8_LAYOUT(Q8_0_Q8, R)                                                                                      \
        } else if (fmt == Q4_0_Q8) {                                                                                   \
            Q8_LAYOUT(Q4_0_Q8, R)                                                                                      \
        } else {                                                                                                       \
            Q8_LAYOUT(Q4_1_Q8, R)                                                                                      \
        }                                                                                                              \
        return;
    switch (rows) {
        Q8_CASE(1)
        Q8_CASE(2)
        Q8_CASE(3)
        Q8_CASE(4)
#if Q8_RT >= 5
        Q8_CASE(5)
        Q8_CASE(6)
        Q8_CASE(7)
        Q8_CASE(8)
#endif
    }
#undef Q8_CASE
#undef Q8_LAYOUT
}

#if AMX && defined(__AMX_INT8__) && Q8_ISA == 2 && !defined(NO_AMX_INT8)
#define Q8_AMX 1
/* From this many rows on the integer sums come from the tile unit (4-bit, Q8_0). Below, vpdpbusd is as fast or
 * faster: a block's product costs the tile unit a fixed ~30 cycles (mostly storing the sums), whatever the rows.
 * Sapphire Rapids, 2 threads, bf16 rows against the built-in model's gate/up (3072 x 576 Q4_1) and lm_head (49152 x
 * 576 Q8_0), vpdpbusd / tiles: 6 rows 30 / 35 and 482 / 520 us, 8 rows 37 / 35 and 557 / 516, 12 rows 50 / 50 and
 * 814 / 660. */
#ifndef Q8_AMX_ROWS
#define Q8_AMX_ROWS 8
#endif
#ifndef Q8_AMX_ROWS_Q8
#define Q8_AMX_ROWS_Q8 8
#endif
#ifndef Q8_AMX_AHEAD
#define Q8_AMX_AHEAD 2 /* blocks between laying out, multiplying and scaling (group_q8_amx) */
#endif
/* Seven tiles: 0-2 a block's sums [rows][16 columns] int32; 3, 4 the rows' quants at the block [rows][32] int8; 5, 6
 * the block's codes [8][16 columns][4 k], as vpdpbusd reads them (a Q8_0 block's 8 runs are that tile as packed).
 * Sums are stored one block after their product is issued (a store right behind its product waited for it), so
 * three sum tiles rotate, and two of the others, so that a product and the next block's loads do not wait on each
 * other (gate/up and down projections at 16-72 rows 8-14% faster than storing at once). */
static void q8_amx_configure(int rows) {
    amx_config cfg = {.palette = 1};
    for (int t = 0; t < 7; t++) {
        cfg.colsb[t] = t == 3 || t == 4 ? KB : 64;
        cfg.rows[t] = t < 5 ? rows : KB / 4;
    }
    _tile_loadconfig(&cfg);
}

/* The 4-bit codes of a block as the tile's 8 rows of [16 columns][4 k]: run p's low nibbles are row 2p (k = 8p ..
 * 8p + 3), its high nibbles row 2p + 1. Q4_0's as c - 8 (signed), so that its sums come out as I - 8 S. */
static inline void q4_codes(const int fmt, const uint8_t *qs, uint8_t *out) {
    const __m512i mask = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(fmt == Q4_0_Q8 ? 8 : 0);
    for (int p = 0; p < 4; p++) {
        const __m512i v = _mm512_loadu_si512(qs + 64 * p);
        _mm512_store_si512(out + 128 * p, _mm512_sub_epi8(_mm512_and_si512(v, mask), eight));
        _mm512_store_si512(out + 128 * p + 64, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), mask), eight));
    }
}

/* group_q8 on the tile unit for up to 16 rows: one tdpbsud per block (x signed, codes unsigned; Q4_0 tdpbssd on c - 8)
 * gives the rows' integer sums I (less Q4_0's 8 S), which the vector unit scales exactly as group_q8 does (same
 * operations, same order: a row's result does not depend on the rows beside it, or on which unit summed its
 * integers), at 3-5 vector instructions a row and block where vpdpbusd needs 12-13. The two units meet only through
 * memory (the 4-bit codes laid out for the tile, the sums stored from it), so each step of the loop lays out block
 * t, multiplies block t - Q8_AMX_AHEAD (and stores the sums of the block before it) and scales block
 * t - 2 Q8_AMX_AHEAD: independent streams, each reading what was stored at least a step before. The rows' scales
 * and terms come as one run per block (xdt, xtt: linear_q8_amx), so that the scaling, unrolled over all rmax rows,
 * keeps y in registers and reads them at fixed offsets (rows read at r * nb + b kept y and the rows' pointers on the
 * stack: 1.07-1.19x slower from 16 to 72 rows). */
static inline __attribute__((always_inline)) void group_q8_amx(const int fmt, const uint8_t *blk, int64_t nb,
                                                                const int8_t *xq, int64_t ldq, const float *xdt,
                                                                const float *xtt, const int rmax, float *acc) {
    enum { D = Q8_AMX_AHEAD, RING = 2 * Q8_AMX_AHEAD };
    const int64_t bb = q8_quants(fmt) + (fmt == Q8_0_Q8 ? KB * G : KB * G / 2);
    uint8_t codes[RING][KB * G] __attribute__((aligned(64))); /* 4-bit only: Q8_0's tile is its packing */
    int32_t c[RING][16 * G] __attribute__((aligned(64)));
    __m512 y[16];
#pragma GCC unroll 16
    for (int r = 0; r < rmax; r++) y[r] = _mm512_setzero_ps();
    for (int64_t t = 0; t < nb + 2 * D; t++) {
        if (t < nb) {
            const uint8_t *bt = blk + t * bb;
#pragma GCC unroll 9
            for (int64_t off = 0; off < bb; off += 64) __builtin_prefetch(bt + PREFETCH + off);
            if (fmt != Q8_0_Q8) q4_codes(fmt, bt + q8_quants(fmt), codes[t % RING]);
        }
        const int64_t m = t - D; /* the block multiplied */
        if (m >= 0 && m < nb) {
            const void *w =
                fmt == Q8_0_Q8 ? (const void *)(blk + m * bb + q8_quants(fmt)) : (const void *)codes[m % RING];
            const int8_t *xa = xq + m * KB;
            int32_t *prev = c[(m + RING - 1) % RING], *cur = c[m % RING];
            const int last = m == nb - 1;
#define Q8_TILE(C, A, B, P)                                                                                            \
    _tile_loadd(A, xa, ldq);                                                                                           \
    _tile_loadd(B, w, 64);                                                                                             \
    _tile_zero(C);                                                                                                     \
    if (fmt == Q4_0_Q8)                                                                                                \
        _tile_dpbssd(C, A, B);                                                                                         \
    else                                                                                                               \
        _tile_dpbsud(C, A, B);                                                                                         \
    if (m > 0) _tile_stored(P, prev, 64);                                                                              \
    if (last) _tile_stored(C, cur, 64);                                                                                \
    break;
            switch (m % 6) { /* tile numbers are part of the instruction: sums in m % 3, operands in m % 2 */
            case 0: Q8_TILE(0, 3, 5, 2)
            case 1: Q8_TILE(1, 4, 6, 0)
            case 2: Q8_TILE(2, 3, 5, 1)
            case 3: Q8_TILE(0, 4, 6, 2)
            case 4: Q8_TILE(1, 3, 5, 0)
            default: Q8_TILE(2, 4, 6, 1)
            }
#undef Q8_TILE
        }
        const int64_t b = t - 2 * D; /* the block scaled */
        if (b >= 0) {
            const uint8_t *bs = blk + b * bb;
            const int32_t *cb = c[b % RING];
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)bs));
            const __m512 mw = fmt == Q4_1_Q8 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(bs + 2 * G)))
                                             : _mm512_setzero_ps();
            const float *xdb = xdt + b * 16, *xtb = xtt + b * 16; /* rows past M: zero scales, their y not stored */
#pragma GCC unroll 16
            for (int r = 0; r < rmax; r++) {
                __m512i I = _mm512_load_si512(cb + r * G);
                if (fmt == Q8_0_Q8) I = _mm512_sub_epi32(I, _mm512_set1_epi32(((const int32_t *)xtb)[r]));
                y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(dw, _mm512_set1_ps(xdb[r])), y[r]);
                if (fmt == Q4_1_Q8) y[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xtb[r]), y[r]);
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < rmax; r++) _mm512_store_ps(acc + r * G, y[r]);
}

/* group_q8_amx with its format and register budget known to the compiler: the scaling's rows in steps of 4 (a pass
 * of 9-12 rows scaled as 16 was 6-15% slower than as 12) */
static void group_q8_amx_rows(int fmt, const uint8_t *blk, int64_t nb, const int8_t *xq, int64_t ldq,
                              const float *xdt, const float *xtt, int rows, float *acc) {
#define Q8_AMX_FMT(F)                                                                                                  \
    if (rows <= 4)                                                                                                     \
        group_q8_amx(F, blk, nb, xq, ldq, xdt, xtt, 4, acc);                                                           \
    else if (rows <= 8)                                                                                                \
        group_q8_amx(F, blk, nb, xq, ldq, xdt, xtt, 8, acc);                                                           \
    else if (rows <= 12)                                                                                               \
        group_q8_amx(F, blk, nb, xq, ldq, xdt, xtt, 12, acc);                                                          \
    else                                                                                                               \
        group_q8_amx(F, blk, nb, xq, ldq, xdt, xtt, 16, acc);
    if (fmt == Q8_0_Q8) {
        Q8_AMX_FMT(Q8_0_Q8)
    } else if (fmt == Q4_0_Q8) {
        Q8_AMX_FMT(Q4_0_Q8)
    } else {
        Q8_AMX_FMT(Q4_1_Q8)
    }
#undef Q8_AMX_FMT
}

/* linear_q8 on the tile unit: the rows in passes of 16 (more than 16 are zero-padded to whole passes, so every pass
 * loads as many rows as the tiles are configured for). A last pass of fewer than the tile unit's rows takes vpdpbusd
 * (the same sums and scaling, so the same results): a tile pass costs a block's fixed ~30 cycles whatever its rows
 * (Sapphire Rapids, the built-in model's linears, a step's sum: 16 rows 8.5-9.9 ms; 17 rows 11.2-12.9 with a second
 * tile pass, 9.4-11.0 with vpdpbusd; 24 rows 12.0-13.8 either way: from 8 rows vpdpbusd is no faster). */
static int linear_q8_amx(const int8_t *xq, const float *xd, const int32_t *xs, int64_t M, int64_t nb,
                         const uint8_t *w, int fmt, int64_t N, const float *bias, void *yout, int64_t ldy,
                         int y_bf16, int nthreads) {
    const int64_t groups = (N + G - 1) / G, bb = block_nbytes(fmt), ldq = nb * KB;
    const int tile_rows = M < 16 ? (int)M : 16;
    /* per pass of 16 rows and block, the rows' scales dx and their term beside I (Q8_0's 128 S, taken off I; Q4_1's
     * dx S, times m; Q4_0 none), [pass][block][16 rows], zero past M: what the scaling of a block reads as one run */
    const int64_t passes = (M + 15) / 16;
    float *xdt = calloc((size_t)(2 * passes * nb * 16), sizeof(float));
    if (!xdt) return -2;
    float *xtt = xdt + passes * nb * 16;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i = r * nb + b, at = ((r / 16) * nb + b) * 16 + r % 16;
            xdt[at] = xd[i];
            if (fmt == Q8_0_Q8) {
                const int32_t o = Q8_OFFSET(Q8_0_Q8) * xs[i];
                memcpy(xtt + at, &o, sizeof o);
            } else if (fmt == Q4_1_Q8)
                xtt[at] = xd[i] * (float)xs[i];
        }
    const int min_rows = fmt == Q8_0_Q8 ? Q8_AMX_ROWS_Q8 : Q8_AMX_ROWS;
#pragma omp parallel num_threads(nthreads)
    {
        q8_amx_configure(tile_rows);
        float acc[16 * G] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int cols = N - g * G < G ? (int)(N - g * G) : G;
            for (int64_t r0 = 0; r0 < M; r0 += 16) {
                const int rows = M - r0 < 16 ? (int)(M - r0) : 16;
                if (rows < min_rows) {
                    group_q8_rows(fmt, w + g * nb * bb, nb, xq + r0 * ldq, xd + r0 * nb, xs + r0 * nb, 0, rows,
                                  acc);
                } else {
                    group_q8_amx_rows(fmt, w + g * nb * bb, nb, xq + r0 * ldq, ldq, xdt + r0 * nb, xtt + r0 * nb,
                                      rows, acc);
                }
                store_rows(acc, rows, cols, bias, yout, ldy, y_bf16, r0, g * G);
            }
        }
        _tile_release();
    }
    free(xdt);
    return 0;
}
#else
#define Q8_AMX 0
#endif

/* Which instructions the integer products use here (the start-up log names them): 3 = the tile unit's from
 * Q8_AMX_ROWS rows on (AMX-INT8, granted by the kernel), vpdpbusd below. */
int q8_isa(void) {
#if Q8_AMX
    if (amx_usable()) return 3;
#endif
    return Q8_ISA;
}

/* y = x W^T + bias over Q8-activation packings: x quantized once (in tiles of Q8_RT rows side by side per block, for
 * the vector path), then each thread's groups of columns, Q8_RT rows at a time (after the first tile, a group's
 * blocks come from L1 or L2). */
static int linear_q8(const void *xin, int64_t ldx, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int fmt,
                     int64_t N, const float *bias, void *yout, int64_t ldy, int y_bf16, int nthreads) {
    const int64_t nb = (K + KB - 1) / KB, groups = (N + G - 1) / G, bb = block_nbytes(fmt);
#if Q8_AMX
    const int amx = M >= (fmt == Q8_0_Q8 ? Q8_AMX_ROWS_Q8 : Q8_AMX_ROWS) && amx_usable();
    const int64_t mq = amx && M > 16 ? (M + 15) / 16 * 16 : M; /* the tiles' passes read whole 16 rows */
#else
    const int amx = 0;
    const int64_t mq = M;
#endif
    int8_t *xq = malloc((size_t)(mq * nb * KB));
    float *xd = malloc(sizeof(float) * (size_t)(M * nb));
    int32_t *xs = malloc(sizeof(int32_t) * (size_t)(M * nb));
    if (!xq || !xd || !xs) {
        free(xq), free(xd), free(xs);
        return -2;
    }
    quantize_rows_q8(xin, ldx, x_bf16, M, K, xq, xd, xs, amx ? 0 : fmt, nthreads);
#if Q8_AMX
    if (amx) {
        memset(xq + M * nb * KB, 0, (size_t)((mq - M) * nb * KB));
        const int rc = linear_q8_amx(xq, xd, xs, M, nb, w, fmt, N, bias, yout, ldy, y_bf16, nthreads);
        free(xq), free(xd), free(xs);
        return rc;
    }
#endif
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        float acc[Q8_RT * G] __attribute__((aligned(64)));
        const int cols = N - g * G < G ? (int)(N - g * G) : G;
        for (int64_t r0 = 0; r0 < M; r0 += Q8_RT) {
            const int rows = M - r0 < Q8_RT ? (int)(M - r0) : Q8_RT;
            group_q8_rows(fmt, w + g * nb * bb, nb, xq + r0 * nb * KB, xd + r0 * nb, xs + r0 * nb, 1, rows, acc);
            store_rows(acc, rows, cols, bias, yout, ldy, y_bf16, r0, g * G);
        }
    }
    free(xq), free(xd), free(xs);
    return 0;
}

/* For the tests: out[r][n][b] = I, the integer sum of block b of weight row n with quantized row r, from the
 * same block_ints the products use (less the 128 S of vpdpbusd's Q8_0). */
int block_dots_q8(const uint8_t *w, int fmt, int64_t N, int64_t K, const int8_t *xq, int64_t M, int32_t *out) {
    if (!is_q8(fmt) || N <= 0 || K <= 0 || M < 0) return -1;
    const int64_t nb = (K + KB - 1) / KB, groups = (N + G - 1) / G, bb = block_nbytes(fmt);
    const int32_t offset = fmt == Q8_0_Q8 ? Q8_OFFSET(Q8_0_Q8) : 0;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < nb; b++)
            for (int64_t r = 0; r < M; r++) {
                q8_ints a[1];
                int32_t I[G], s = 0;
                const int8_t *xr = xq + r * nb * KB + b * KB;
                block_ints(fmt, w + (g * nb + b) * bb + q8_quants(fmt), xr, nb * KB, 1, a);
                memcpy(I, a, sizeof I);
                for (int k = 0; k < KB; k++) s += xr[k];
                for (int c = 0; c < G && g * G + c < N; c++) out[(r * N + g * G + c) * nb + b] = I[c] - offset * s;
            }
    return 0;
}

/* The weight as fp32, transposed (out [K, N]), from a Q8-activation packing. */
static int dequantize_q8(const uint8_t *w, int fmt, int64_t N, int64_t K, float *out, int nthreads) {
    const int64_t nb = (K + KB - 1) / KB, groups = (N + G - 1) / G, bb = block_nbytes(fmt);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int cols = N - g * G < G ? (int)(N - g * G) : G;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + (g * nb + b) * bb, *qs = blk + q8_quants(fmt);
            float d[G], m[G];
            load_h(blk, d);
            if (fmt == Q4_1_Q8) load_h(blk + 2 * G, m);
            const int kn = K - b * KB < KB ? (int)(K - b * KB) : KB;
            for (int k = 0; k < kn; k++)
                for (int c = 0; c < cols; c++) {
                    const uint8_t byte = qs[64 * (fmt == Q8_0_Q8 ? k / 4 : k / 8) + 4 * c + k % 4];
                    const float code = fmt == Q8_0_Q8 ? (float)((int32_t)byte - 128)
                                                      : (float)(k % 8 < 4 ? byte & 15 : byte >> 4);
                    out[(b * KB + k) * N + g * G + c] = fmt == Q4_0_Q8   ? d[c] * (code - 8.0f)
                                                        : fmt == Q4_1_Q8 ? d[c] * code + m[c]
                                                                         : d[c] * code;
                }
        }
    }
    return 0;
}
