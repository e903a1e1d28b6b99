/* Decode attention over the paged KV cache on CPU, reading each sequence's blocks where they lie.
 *
 * One query token a row. The work is split by (run of rows, KV head): the query heads that share a KV head
 * (grouped-query attention) are done together, and so are the rows of one sequence in a step that checks guessed
 * tokens (find_runs: each row's context a prefix of the next one's), so that every K and V row is loaded and widened
 * to fp32 once for all of them. Scores, softmax and the weighted sum of V accumulate in fp32; the output is rounded
 * once, to nearest even. Every sum has a fixed order, so the result is the same from run to run and from batch to
 * batch, and a row's is the same whatever rows share its run.
 *
 * Two builds of the same computation: with AVX-512 or AVX2 (x86 built with -march=native on a machine that has
 * it), 16 (8) tokens at a time, each score a product across lanes reduced by a transpose-and-add tree (sum_lanes);
 * a bf16 cache of 64- or 128-value heads with up to 4 query heads a KV head widens rows as even and odd halves
 * (row_scores), and a run of several rows transposes its tokens' K rows once, a token a lane, to score every head of
 * every row against them with the same products and sums in the same order (score_heads: 1.4-1.5x faster for 9 rows
 * of 8 sequences). Other shapes take attend_body, one row at a time. Elsewhere (or with -DCPU_ATTENTION_PORTABLE)
 * plain C loops that gcc -O3 vectorizes without fast-math (independent lanes, no reassociated sums). A step reads
 * its cache once, from memory (the cache of a busy batch fits no cache level, and the weights stream through them
 * between layers), so every build prefetches the next K rows and the V rows while scores are computed, and asks
 * for each item's K and V rows into L2 while the thread computes the item before it.
 *
 * Parallel with OpenMP, each thread a contiguous run of items: loaded into a process that runs torch, the library
 * binds to the libgomp torch already loaded, so its threads are torch's own pool. Built and loaded by
 * kernels/cpu_paged_attention.py.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define LANES 16

static inline float load_f32(float x) { return x; }
static inline float store_f32(float x) { return x; }
static inline float load_bf16(uint16_t x) { return bf16_to_f32(x); }
static inline uint16_t store_bf16(float f) { return f32_to_bf16(f); }

/* Into L1 (in_l1) or L2. always_inline: called, a function whose only effect is prefetching counts as pure to gcc,
 * which then deletes the calls (this file's prefetches were all gone from the build until 2026-12-03). */
static inline __attribute__((always_inline)) void prefetch_row(const void *p, int nbytes, int in_l1) {
    for (int off = 0; off < nbytes; off += 64) {
        if (in_l1) __builtin_prefetch((const char *)p + off, 0, 3);
        else __builtin_prefetch((const char *)p + off, 0, 2);
    }
}

/* The K and V rows of the item a thread does next (offsets `at`, `len` tokens, `elem` bytes a value, rows of
 * `row` bytes), asked for into L2 a few tokens at a time while the current item computes its scores: asked for all
 * at once, the prefetches filled the core's queue of misses and stalled the item they were meant to overlap (batch
 * 8, context 192, 200 layers' caches, 2 threads, Zen 5: AVX2 62 -> 51-54 us a layer, AVX-512 46-52 -> 47). */
typedef struct {
    const char *k, *v;
    const int64_t *at;
    int len, elem, row;
} Ahead;

static inline __attribute__((always_inline)) void ahead_rows(const Ahead *a, int t0, int t1) {
    if (!a) return;
    for (int t = t0; t < t1 && t < a->len; t++) {
        prefetch_row(a->k + a->at[t] * a->elem, a->row, 0);
        prefetch_row(a->v + a->at[t] * a->elem, a->row, 0);
    }
}

/* One (sequence, KV head) item: the `group` query heads of sequence b (qh = q + b * q_sb, oh = out + b * H * D)
 * that share KV head g, over its `len` tokens; `scores` [group, padded] and `at` [padded] are this thread's scratch. */

#if defined(__AVX512F__) && !defined(CPU_ATTENTION_PORTABLE)
#include <immintrin.h>
#define VECTORS 1
typedef __m512 vec;
#define VLANES 16
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vmul _mm512_mul_ps
#define vadd _mm512_add_ps
#define vfmadd _mm512_fmadd_ps
#define vstore _mm512_storeu_ps
#define vstore_aligned _mm512_store_ps

static inline vec loadv_f32(const float *p) { return _mm512_loadu_ps(p); }

static inline vec loadv_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* lane t of the result = the sum of the 16 lanes of v[t] */
static inline vec sum_lanes(const vec *v) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x88), _mm512_shuffle_f32x4(lo, hi, 0xDD));
}

#define vmax _mm512_max_ps
#define vmin _mm512_min_ps
#define vsub _mm512_sub_ps
#define vfnmadd _mm512_fnmadd_ps
/* 2^k for whole-numbered k */
static inline vec vpow2(vec k) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23));
}
/* y where x <= lim, else +inf */
static inline vec vinf_above(vec x, vec y, float lim) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, vset1(lim), _CMP_GT_OQ), y, vset1(INFINITY));
}

#elif defined(__AVX2__) && defined(__FMA__) && !defined(CPU_ATTENTION_PORTABLE)
#include <immintrin.h>
#define VECTORS 1
typedef __m256 vec;
#define VLANES 8
#define vzero _mm256_setzero_ps
#define vset1 _mm256_set1_ps
#define vmul _mm256_mul_ps
#define vadd _mm256_add_ps
#define vfmadd _mm256_fmadd_ps
#define vstore _mm256_storeu_ps
#define vstore_aligned _mm256_store_ps

static inline vec loadv_f32(const float *p) { return _mm256_loadu_ps(p); }

static inline vec loadv_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* lane t of the result = the sum of the 8 lanes of v[t] */
static inline vec sum_lanes(const vec *v) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#define vmax _mm256_max_ps
#define vmin _mm256_min_ps
#define vsub _mm256_sub_ps
#define vfnmadd _mm256_fnmadd_ps
static inline vec vpow2(vec k) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23));
}
static inline vec vinf_above(vec x, vec y, float lim) {
    return _mm256_blendv_ps(y, vset1(INFINITY), _mm256_cmp_ps(x, vset1(lim), _CMP_GT_OQ));
}
#endif

#if defined(VECTORS)
/* exp_f32 on a vector (gcc does not vectorize the scalar one in the softmax loop, which cost a third of the
 * attention's time) */
static inline vec vexp(vec x) {
    const vec v = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f)), big = vset1(12582912.0f);
    const vec k = vsub(vfmadd(v, vset1(1.44269504088896341f), big), big);
    const vec r = vfmadd(k, vset1(2.12194440e-4f), vfnmadd(k, vset1(0.693359375f), v));
    vec p = vset1(1.9875691500e-4f);
    p = vfmadd(p, r, vset1(1.3981999507e-3f));
    p = vfmadd(p, r, vset1(8.3334519073e-3f));
    p = vfmadd(p, r, vset1(4.1665795894e-2f));
    p = vfmadd(p, r, vset1(1.6666665459e-1f));
    p = vfmadd(p, r, vset1(5.0000001201e-1f));
    const vec e = vadd(vfmadd(vmul(p, r), r, r), vset1(1.0f));
    return vinf_above(x, vmul(e, vpow2(k)), 88.0f);
}

/* s[0:len] = softmax(s[0:len]), in place, in fp32: VLANES at a time (exp included), the sum in VLANES partial
 * sums added in a fixed order */
static void softmax_inplace(float *s, int len) {
    const int nv = len / VLANES * VLANES;
    float m = s[0], sum = 0.0f, lane[VLANES];
    vec mv = vset1(s[0]), sv = vzero();
    for (int t = 0; t < nv; t += VLANES) mv = vmax(mv, loadv_f32(s + t));
    vstore(lane, mv);
    for (int i = 0; i < VLANES; i++) m = lane[i] > m ? lane[i] : m;
    for (int t = nv; t < len; t++) m = s[t] > m ? s[t] : m;
    const vec mb = vset1(m);
    for (int t = 0; t < nv; t += VLANES) {
        const vec e = vexp(vsub(loadv_f32(s + t), mb));
        vstore(s + t, e);
        sv = vadd(sv, e);
    }
    vstore(lane, sv);
    for (int i = 0; i < VLANES; i++) sum += lane[i];
    for (int t = nv; t < len; t++) sum += s[t] = exp_f32(s[t] - m);
    const vec inv = vset1(1.0f / sum);
    for (int t = 0; t < nv; t += VLANES) vstore(s + t, vmul(loadv_f32(s + t), inv));
    for (int t = nv; t < len; t++) s[t] *= 1.0f / sum;
}
#else
/* s[0:len] = softmax(s[0:len]), in place, in fp32 */
static void softmax_inplace(float *s, int len) {
    float m = s[0], sum = 0.0f;
    for (int t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
    for (int t = 0; t < len; t++) s[t] = exp_f32(s[t] - m);
    for (int t = 0; t < len; t++) sum += s[t];
    const float inv = 1.0f / sum;
    for (int t = 0; t < len; t++) s[t] *= inv;
}
#endif

/* at[t] = where token t's row for KV head g starts in the cache (elements): one pass over the block table, so the
 * loops over tokens divide by nothing */
static void item_offsets(const int64_t *table, int len, int g, int KVH, int D, int BS, int64_t *at) {
    for (int t = 0, b = 0; t < len; b++)
        for (int s = 0; s < BS && t < len; s++, t++) at[t] = ((table[b] * BS + s) * KVH + g) * D;
}

#if defined(VECTORS)

#define CHUNKS (MAX_HEAD_DIM / VLANES)

/* bf16 values as two fp32 vectors: the even-numbered ones (a shift) and the odd-numbered ones (a mask), half the
 * instructions of widening each half in order (zero-extend, then shift). */
#if VLANES == 16
static inline vec even_half(vec u) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(u), 16)); }
static inline vec odd_half(vec u) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(u), _mm512_set1_epi32((int)0xffff0000u)));
}
#define ACC_BUDGET 24 /* of 32 registers: accumulators, the rest for the widened pair and the weights */

/* r[i] lane t = r[t] lane i (16 x 16 32-bit values): pairs of values, then 64-bit pairs, then 128-bit lanes */
static inline __attribute__((always_inline)) void transpose_lanes(vec *r) {
    vec a[16], b[16];
    for (int i = 0; i < 8; i++)
        a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]),
                  a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    for (int i = 0; i < 4; i++) {
        const __m512d p0 = _mm512_castps_pd(a[4 * i]), p1 = _mm512_castps_pd(a[4 * i + 1]);
        const __m512d p2 = _mm512_castps_pd(a[4 * i + 2]), p3 = _mm512_castps_pd(a[4 * i + 3]);
        b[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(p0, p2));
        b[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(p0, p2));
        b[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(p1, p3));
        b[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(p1, p3));
    }
    for (int m = 0; m < 4; m++) {
        const vec c0 = _mm512_shuffle_f32x4(b[m], b[4 + m], 0x44), c1 = _mm512_shuffle_f32x4(b[8 + m], b[12 + m], 0x44);
        const vec c2 = _mm512_shuffle_f32x4(b[m], b[4 + m], 0xEE), c3 = _mm512_shuffle_f32x4(b[8 + m], b[12 + m], 0xEE);
        r[m] = _mm512_shuffle_f32x4(c0, c1, 0x88), r[m + 4] = _mm512_shuffle_f32x4(c0, c1, 0xDD);
        r[m + 8] = _mm512_shuffle_f32x4(c2, c3, 0x88), r[m + 12] = _mm512_shuffle_f32x4(c2, c3, 0xDD);
    }
}
#else
static inline vec even_half(vec u) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(u), 16)); }
static inline vec odd_half(vec u) {
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(u), _mm256_set1_epi32((int)0xffff0000u)));
}
#define ACC_BUDGET 8 /* of 16: at 12, with the broadcast scores and the widened pair, gcc spilled accumulators */

/* r[i] lane t = r[t] lane i (8 x 8 32-bit values) */
static inline __attribute__((always_inline)) void transpose_lanes(vec *r) {
    vec a[8], b[8];
    for (int i = 0; i < 4; i++)
        a[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]),
                  a[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    for (int i = 0; i < 2; i++) {
        const __m256d p0 = _mm256_castps_pd(a[4 * i]), p1 = _mm256_castps_pd(a[4 * i + 1]);
        const __m256d p2 = _mm256_castps_pd(a[4 * i + 2]), p3 = _mm256_castps_pd(a[4 * i + 3]);
        b[4 * i] = _mm256_castpd_ps(_mm256_unpacklo_pd(p0, p2));
        b[4 * i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(p0, p2));
        b[4 * i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(p1, p3));
        b[4 * i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(p1, p3));
    }
    for (int m = 0; m < 4; m++)
        r[m] = _mm256_permute2f128_ps(b[m], b[4 + m], 0x20), r[m + 4] = _mm256_permute2f128_ps(b[m], b[4 + m], 0x31);
}
#endif
static inline __attribute__((always_inline)) void widen_pair(const uint16_t *p, vec *even, vec *odd) {
    const vec u = loadv_f32((const float *)p);
    *even = even_half(u), *odd = odd_half(u);
}
#define PAIR_LANES (2 * VLANES)
#define MAX_PAIRS (MAX_HEAD_DIM / PAIR_LANES)
#define SCORE_HEADS 4 /* query heads scored together: their partial sums and a token pair's K vectors in registers */

/* kt[d * VLANES + t] = value d of the row rows[t], widened to fp32: each run of PAIR_LANES values is VLANES 32-bit
 * pairs, transposed across the VLANES rows (transpose_lanes), then split into its even and odd values. */
static inline __attribute__((always_inline)) void transpose_rows(const uint16_t *const *rows, const int np,
                                                                 float *kt) {
    for (int c = 0; c < np; c++) {
        vec r[VLANES];
        for (int t = 0; t < VLANES; t++) r[t] = loadv_f32((const float *)(rows[t] + c * PAIR_LANES));
        transpose_lanes(r);
        for (int i = 0; i < VLANES; i++) {
            vstore_aligned(kt + (size_t)(c * PAIR_LANES + 2 * i) * VLANES, even_half(r[i]));
            vstore_aligned(kt + (size_t)(c * PAIR_LANES + 2 * i + 1) * VLANES, odd_half(r[i]));
        }
    }
}

/* dst[x] = lane i of row_scores' per-token vector for head x, for the VLANES tokens in kt: the values at 2i and
 * 2i + 1 of each pair of the row, each chained over the pairs from the first, then added (even + odd). */
static inline __attribute__((always_inline)) void lane_parts(const float *kt, const float *qs, vec *dst, const int i,
                                                             const int HB, const int np) {
    const int D = np * PAIR_LANES;
    vec ke[MAX_PAIRS], ko[MAX_PAIRS];
    for (int c = 0; c < np; c++)
        ke[c] = loadv_f32(kt + (size_t)(c * PAIR_LANES + 2 * i) * VLANES),
        ko[c] = loadv_f32(kt + (size_t)(c * PAIR_LANES + 2 * i + 1) * VLANES);
    for (int x = 0; x < HB; x++) {
        const float *q = qs + (size_t)x * D + 2 * i;
        vec se = vmul(vset1(q[0]), ke[0]), so = vmul(vset1(q[1]), ko[0]);
        for (int c = 1; c < np; c++)
            se = vfmadd(vset1(q[c * PAIR_LANES]), ke[c], se), so = vfmadd(vset1(q[c * PAIR_LANES + 1]), ko[c], so);
        dst[x] = vadd(se, so);
    }
}

/* dst[x] = the sum of lanes 4k .. 4k + 3 in the order sum_lanes adds them: (4k + 4k+s) + (4k+3-s + 4k+3), where
 * AVX-512's tree pairs lanes two apart (s = 2) and AVX2's hadd neighbours (s = 1) */
static inline __attribute__((always_inline)) void quad_parts(const float *kt, const float *qs, vec *dst, const int k,
                                                             const int HB, const int np) {
    const int s = VLANES == 16 ? 2 : 1;
    vec a[SCORE_HEADS], b[SCORE_HEADS];
    lane_parts(kt, qs, a, 4 * k, HB, np), lane_parts(kt, qs, b, 4 * k + s, HB, np);
    for (int x = 0; x < HB; x++) a[x] = vadd(a[x], b[x]);
    lane_parts(kt, qs, b, 4 * k + 3 - s, HB, np), lane_parts(kt, qs, dst, 4 * k + 3, HB, np);
    for (int x = 0; x < HB; x++) dst[x] = vadd(a[x], vadd(b[x], dst[x]));
}

/* The scores of `HB` query heads (qs [HB][D], fp32, scaled) against the VLANES rows in kt, one token a lane, stored
 * at out + x * stride: every product and sum of row_scores in its order (its lanes are here separate vectors), so a
 * head's score of a token is the same bit for bit whether its row is scored alone or in a run. */
static inline __attribute__((always_inline)) void score_heads(const float *kt, const float *qs, float *out,
                                                              size_t stride, const int HB, const int np) {
    vec h[SCORE_HEADS], q[SCORE_HEADS];
    quad_parts(kt, qs, h, 0, HB, np), quad_parts(kt, qs, q, 1, HB, np);
#if VLANES == 16
    for (int x = 0; x < HB; x++) h[x] = vadd(h[x], q[x]);
    vec r[SCORE_HEADS];
    quad_parts(kt, qs, q, 2, HB, np), quad_parts(kt, qs, r, 3, HB, np);
    for (int x = 0; x < HB; x++) vstore_aligned(out + (size_t)x * stride, vadd(h[x], vadd(q[x], r[x])));
#else
    for (int x = 0; x < HB; x++) vstore_aligned(out + (size_t)x * stride, vadd(h[x], q[x]));
#endif
}

/* score_heads with its head count as a constant (gcc keeps arrays of vectors in registers only at counts it knows) */
static inline __attribute__((always_inline)) void score_some(const float *kt, const float *qs, float *out,
                                                             size_t stride, int hb, const int np) {
    switch (hb) {
    case 1: score_heads(kt, qs, out, stride, 1, np); break;
    case 2: score_heads(kt, qs, out, stride, 2, np); break;
    case 3: score_heads(kt, qs, out, stride, 3, np); break;
    default: score_heads(kt, qs, out, stride, SCORE_HEADS, np);
    }
}

/* The scores of one row's `group` query heads (rows qh, head stride q_sh), into scores [group][padded]: VLANES
 * tokens at a time, a token's products across the lanes of its K row widened as even and odd halves (widen_pair),
 * chained over the row's pairs, the lanes then reduced by sum_lanes for VLANES tokens at once; the K, V and next
 * item's rows asked for as in run_scores. */
static inline __attribute__((always_inline)) void row_scores(const uint16_t *qh, int64_t q_sh, const uint16_t *k,
                                                             const uint16_t *v, const int64_t *at, int len, int g,
                                                             float scale, const int group, int padded, float *scores,
                                                             const Ahead *ahead, const int np) {
    const int D = np * PAIR_LANES;
    vec qe[4][MAX_PAIRS], qo[4][MAX_PAIRS], part[4][VLANES];
    for (int j = 0; j < group; j++) {
        const uint16_t *qr = qh + (int64_t)(g * group + j) * q_sh;
        for (int c = 0; c < np; c++) {
            widen_pair(qr + c * PAIR_LANES, &qe[j][c], &qo[j][c]);
            qe[j][c] = vmul(qe[j][c], vset1(scale)), qo[j][c] = vmul(qo[j][c], vset1(scale));
        }
    }
    for (int t0 = 0; t0 < len; t0 += VLANES) {
        const int n = len - t0 < VLANES ? len - t0 : VLANES;
        for (int t = t0 + VLANES; t < t0 + 2 * VLANES && t < len; t++) prefetch_row(k + at[t], D * 2, 1);
        for (int t = t0; t < t0 + n; t++) prefetch_row(v + at[t], D * 2, 0);
        ahead_rows(ahead, t0, t0 + VLANES);
        for (int t = 0; t < n; t++) {
            const uint16_t *kr = k + at[t0 + t];
            vec se[4], so[4], e, o;
            widen_pair(kr, &e, &o);
            for (int j = 0; j < group; j++) se[j] = vmul(qe[j][0], e), so[j] = vmul(qo[j][0], o);
            for (int c = 1; c < np; c++) {
                widen_pair(kr + c * PAIR_LANES, &e, &o);
                for (int j = 0; j < group; j++) se[j] = vfmadd(qe[j][c], e, se[j]), so[j] = vfmadd(qo[j][c], o, so[j]);
            }
            for (int j = 0; j < group; j++) part[j][t] = vadd(se[j], so[j]);
        }
        for (int j = 0; j < group; j++) {
            for (int t = n; t < VLANES; t++) part[j][t] = vzero();
            vstore_aligned(scores + (size_t)j * padded + t0, sum_lanes(part[j]));
        }
    }
    ahead_rows(ahead, (len + VLANES - 1) / VLANES * VLANES, INT32_MAX);
}

/* row_scores with its shape as constants: 64- and 128-value heads, 1 to 4 query heads a KV head */
#define ROW_CASE(G_, NP)                                                                                               \
    case (G_) * 16 + (NP):                                                                                             \
        row_scores(qh, q_sh, k, v, at, len, g, scale, G_, padded, scores, ahead, NP);                                  \
        return;
static void row_scores_of(const uint16_t *qh, int64_t q_sh, const uint16_t *k, const uint16_t *v, const int64_t *at,
                          int len, int g, int D, float scale, int group, int padded, float *scores,
                          const Ahead *ahead) {
    switch (group * 16 + D / PAIR_LANES) {
        ROW_CASE(1, 64 / PAIR_LANES)
        ROW_CASE(2, 64 / PAIR_LANES)
        ROW_CASE(3, 64 / PAIR_LANES)
        ROW_CASE(4, 64 / PAIR_LANES)
        ROW_CASE(1, 128 / PAIR_LANES)
        ROW_CASE(2, 128 / PAIR_LANES)
        ROW_CASE(3, 128 / PAIR_LANES)
        ROW_CASE(4, 128 / PAIR_LANES)
    }
}

/* The scores of a run of R rows of one sequence (row r's context is lens[r] tokens, each row's a prefix of the next
 * one's, at offsets `at`) for its nh = R * group query heads (qs [nh][D]), into scores [nh][padded]: the K rows of
 * VLANES tokens are read and transposed once for every head of every row that sees them, SCORE_HEADS heads at a time.
 * While a chunk is scored, the next chunk's K rows are asked for into L1, this chunk's V rows and the next item's
 * rows (`ahead`) into L2. */
static inline __attribute__((always_inline)) void run_scores(const uint16_t *k, const uint16_t *v, const int64_t *at,
                                                             const int32_t *lens, int R, int group, const float *qs,
                                                             float *scores, int padded, const Ahead *ahead,
                                                             const int np) {
    const int D = np * PAIR_LANES, nh = R * group, len = lens[R - 1];
    float kt[MAX_PAIRS * PAIR_LANES * VLANES] __attribute__((aligned(64)));
    const uint16_t *rows[VLANES];
    int first = 0; /* the first row whose context reaches the chunk */
    for (int t0 = 0; t0 < len; t0 += VLANES) {
        const int n = len - t0 < VLANES ? len - t0 : VLANES;
        while (lens[first] <= t0) first++;
        for (int t = 0; t < VLANES; t++) rows[t] = k + at[t0 + (t < n ? t : n - 1)];
        for (int t = t0 + VLANES; t < t0 + 2 * VLANES && t < len; t++) prefetch_row(k + at[t], D * 2, 1);
        for (int t = t0; t < t0 + n; t++) prefetch_row(v + at[t], D * 2, 0);
        ahead_rows(ahead, t0, t0 + VLANES);
        transpose_rows(rows, np, kt);
        for (int h = first * group; h < nh; h += SCORE_HEADS) {
            const int hb = nh - h < SCORE_HEADS ? nh - h : SCORE_HEADS;
            score_some(kt, qs + (size_t)h * D, scores + (size_t)h * padded + t0, (size_t)padded, hb, np);
        }
    }
    ahead_rows(ahead, (len + VLANES - 1) / VLANES * VLANES, INT32_MAX);
}

/* One row's output for its `group` query heads of KV head g, from their softmaxed scores ([group][padded], `len`
 * tokens): the weighted sum of V runs over the tokens once per `cp` pairs of each V row, widened as even and odd
 * halves (widen_pair), with group * 2 * cp accumulators in registers, so that enough FMAs are independent and no
 * V row is widened twice; each output value is its tokens' sum in token order. np = D / PAIR_LANES. */
static inline __attribute__((always_inline)) void weigh_values(const uint16_t *v, const int64_t *at, int len,
                                                               const float *scores, int padded, uint16_t *oh, int g,
                                                               const int group, const int np, const int cp) {
    float even[VLANES], odd[VLANES];
    for (int c0 = 0; c0 < np; c0 += cp) {
        vec ae[4][4], ao[4][4];
        for (int j = 0; j < group; j++)
            for (int c = 0; c < cp; c++) ae[j][c] = vzero(), ao[j][c] = vzero();
        for (int t = 0; t < len; t++) {
            const uint16_t *vr = v + at[t] + c0 * PAIR_LANES;
            for (int c = 0; c < cp; c++) {
                vec e, o;
                widen_pair(vr + c * PAIR_LANES, &e, &o);
                for (int j = 0; j < group; j++) {
                    const vec p = vset1(scores[(size_t)j * padded + t]);
                    ae[j][c] = vfmadd(p, e, ae[j][c]), ao[j][c] = vfmadd(p, o, ao[j][c]);
                }
            }
        }
        for (int j = 0; j < group; j++) {
            uint16_t *out = oh + (int64_t)(g * group + j) * np * PAIR_LANES + c0 * PAIR_LANES;
            for (int c = 0; c < cp; c++) {
                vstore(even, ae[j][c]), vstore(odd, ao[j][c]);
                for (int i = 0; i < VLANES; i++) {
                    out[c * PAIR_LANES + 2 * i] = store_bf16(even[i]);
                    out[c * PAIR_LANES + 2 * i + 1] = store_bf16(odd[i]);
                }
            }
        }
    }
}

#define PAIRS_CP(group, np)                                                                                            \
    ((np) >= 4 && (group) * 8 <= ACC_BUDGET ? 4 : (np) >= 2 && (group) * 4 <= ACC_BUDGET ? 2 : 1)
#define WEIGH_CASE(G_, NP)                                                                                             \
    case (G_) * 16 + (NP):                                                                                             \
        weigh_values(v, at, len, scores, padded, oh, g, G_, NP, PAIRS_CP(G_, NP));                                     \
        return;
/* weigh_values with its shape as constants: 64- and 128-value heads, 1 to 4 query heads a KV head */
static void weigh_row(const uint16_t *v, const int64_t *at, int len, const float *scores, int padded, uint16_t *oh,
                      int g, int group, int D) {
    switch (group * 16 + D / PAIR_LANES) {
        WEIGH_CASE(1, 64 / PAIR_LANES)
        WEIGH_CASE(2, 64 / PAIR_LANES)
        WEIGH_CASE(3, 64 / PAIR_LANES)
        WEIGH_CASE(4, 64 / PAIR_LANES)
        WEIGH_CASE(1, 128 / PAIR_LANES)
        WEIGH_CASE(2, 128 / PAIR_LANES)
        WEIGH_CASE(3, 128 / PAIR_LANES)
        WEIGH_CASE(4, 128 / PAIR_LANES)
    }
}

/* One row of a bf16 cache of 64- or 128-value heads with up to 4 query heads a KV head: row_scores, softmax,
 * weigh_row. Returns 0 for any other shape. */
static int run_shape(int D, int group) { return (D == 64 || D == 128) && group <= 4; }
static int attend_row_pairs(const uint16_t *qh, int64_t q_sh, const uint16_t *k, const uint16_t *v, const int64_t *at,
                            int len, uint16_t *oh, int g, int D, float scale, int group, int padded, float *scores,
                            const Ahead *ahead) {
    if (!run_shape(D, group)) return 0;
    row_scores_of(qh, q_sh, k, v, at, len, g, D, scale, group, padded, scores, ahead);
    for (int j = 0; j < group; j++) softmax_inplace(scores + (size_t)j * padded, len);
    weigh_row(v, at, len, scores, padded, oh, g, group, D);
    return 1;
}

/* A run of R rows of one sequence, same shapes (rows qh + r * q_sb, outputs oh + r * o_sb): scores for every row's
 * heads together (run_scores), then each row's softmax and weighted sum of V on its own. A row's result does not
 * depend on the rows beside it, bit for bit: a sequence checking guesses gets, at each row, what a one-token step
 * (attend_row_pairs) would. */
static void attend_run_pairs(const uint16_t *qh, int64_t q_sb, int64_t q_sh, const uint16_t *k, const uint16_t *v,
                             const int64_t *at, const int32_t *lens, int R, uint16_t *oh, int64_t o_sb, int g, int D,
                             float scale, int group, int padded, float *scores, float *qs, const Ahead *ahead) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < group; j++) {
            const uint16_t *qr = qh + r * q_sb + (int64_t)(g * group + j) * q_sh;
            float *qf = qs + (size_t)(r * group + j) * D;
            for (int d = 0; d < D; d++) qf[d] = bf16_to_f32(qr[d]) * scale;
        }
    if (D == 64) run_scores(k, v, at, lens, R, group, qs, scores, padded, ahead, 64 / PAIR_LANES);
    else run_scores(k, v, at, lens, R, group, qs, scores, padded, ahead, 128 / PAIR_LANES);
    for (int r = 0; r < R; r++) {
        float *sr = scores + (size_t)r * group * padded;
        for (int j = 0; j < group; j++) softmax_inplace(sr + (size_t)j * padded, lens[r]);
        weigh_row(v, at, lens[r], sr, padded, oh + r * o_sb, g, group, D);
    }
}
#define ATTEND_ITEM(SUFFIX, T, STORE)                                                                                  \
    static inline __attribute__((always_inline)) void attend_body_##SUFFIX(                                            \
        const T *qh, int64_t q_sh, const T *k, const T *v, const int64_t *at, int len, T *oh, int g, int D,            \
        float scale, int group, int padded, float *scores, const Ahead *ahead, const int nc) {                         \
        vec qf[MAX_GROUP][CHUNKS], acc[MAX_GROUP][CHUNKS], part[MAX_GROUP][VLANES], row[CHUNKS];                       \
        float res[MAX_HEAD_DIM];                                                                                       \
        const T *rows[VLANES];                                                                                         \
        for (int j = 0; j < group; j++) {                                                                              \
            const T *qr = qh + (int64_t)(g * group + j) * q_sh;                                                        \
            for (int c = 0; c < nc; c++) qf[j][c] = vmul(loadv_##SUFFIX(qr + c * VLANES), vset1(scale));               \
        }                                                                                                              \
        for (int t0 = 0; t0 < len; t0 += VLANES) {                                                                     \
            const int n = len - t0 < VLANES ? len - t0 : VLANES;                                                       \
            for (int t = 0; t < n; t++) rows[t] = k + at[t0 + t];                                                      \
            for (int t = t0 + VLANES; t < t0 + 2 * VLANES && t < len; t++)                                             \
                prefetch_row(k + at[t], D * (int)sizeof(T), 1);                                                        \
            for (int t = t0; t < t0 + n; t++)                                                                          \
                prefetch_row(v + at[t], D * (int)sizeof(T), 0);                                                        \
            ahead_rows(ahead, t0, t0 + VLANES);                                                                        \
            for (int t = 0; t < n; t++) {                                                                              \
                for (int c = 0; c < nc; c++) row[c] = loadv_##SUFFIX(rows[t] + c * VLANES);                            \
                for (int j = 0; j < group; j++) {                                                                      \
                    vec s = vmul(qf[j][0], row[0]);                                                                    \
                    if (VLANES == 8) { /* twice the chunks of AVX-512: two chains of FMAs, half as long */             \
                        vec s1 = vmul(qf[j][1], row[1]);                                                               \
                        for (int c = 2; c < nc; c += 2)                                                                \
                            s = vfmadd(qf[j][c], row[c], s), s1 = vfmadd(qf[j][c + 1], row[c + 1], s1);                \
                        s = vadd(s, s1);                                                                               \
                    } else                                                                                             \
                        for (int c = 1; c < nc; c++) s = vfmadd(qf[j][c], row[c], s);                                  \
                    part[j][t] = s;                                                                                    \
                }                                                                                                      \
            }                                                                                                          \
            for (int j = 0; j < group; j++) {                                                                          \
                for (int t = n; t < VLANES; t++) part[j][t] = vzero();                                                 \
                vstore_aligned(scores + (size_t)j * padded + t0, sum_lanes(part[j]));                                  \
            }                                                                                                          \
        }                                                                                                              \
        ahead_rows(ahead, (len + VLANES - 1) / VLANES * VLANES, INT32_MAX);                                            \
        if (VLANES == 8 && D == 8 * VLANES) {                                                                          \
            /* 16 registers: one head at a time, its 8 accumulators held across the tokens (V rows from L1) */         \
            for (int j = 0; j < group; j++) {                                                                          \
                const float *pj = scores + (size_t)j * padded;                                                         \
                vec a[8];                                                                                              \
                softmax_inplace(scores + (size_t)j * padded, len);                                                     \
                for (int c = 0; c < 8; c++) a[c] = vzero();                                                            \
                for (int t = 0; t < len; t++) {                                                                        \
                    const T *vr = v + at[t];                                                                           \
                    const vec p = vset1(pj[t]);                                                                        \
                    for (int c = 0; c < 8; c++) a[c] = vfmadd(p, loadv_##SUFFIX(vr + c * VLANES), a[c]);               \
                }                                                                                                      \
                T *o = oh + (int64_t)(g * group + j) * D;                                                              \
                for (int c = 0; c < 8; c++) vstore(res + c * VLANES, a[c]);                                            \
                for (int d = 0; d < D; d++) o[d] = STORE(res[d]);                                                      \
            }                                                                                                          \
            return;                                                                                                    \
        }                                                                                                              \
        for (int j = 0; j < group; j++) {                                                                              \
            softmax_inplace(scores + (size_t)j * padded, len);                                                         \
            for (int c = 0; c < nc; c++) acc[j][c] = vzero();                                                          \
        }                                                                                                              \
        for (int t = 0; t < len; t++) {                                                                                \
            const T *vr = v + at[t];                                                                                   \
            for (int c = 0; c < nc; c++) row[c] = loadv_##SUFFIX(vr + c * VLANES);                                     \
            for (int j = 0; j < group; j++) {                                                                          \
                const vec p = vset1(scores[(size_t)j * padded + t]);                                                   \
                for (int c = 0; c < nc; c++) acc[j][c] = vfmadd(p, row[c], acc[j][c]);                                 \
            }                                                                                                          \
        }                                                                                                              \
        for (int j = 0; j < group; j++) {                                                                              \
            T *o = oh + (int64_t)(g * group + j) * D;                                                                  \
            for (int c = 0; c < nc; c++) vstore(res + c * VLANES, acc[j][c]);                                          \
            for (int d = 0; d < D; d++) o[d] = STORE(res[d]);                                                          \
        }                                                                                                              \
    }                                                                                                                  \
    /* 64- and 128-value heads (4 or 8 vectors) as constants: at a count known only at run time, gcc kept the row's    \
     * vectors in memory (B=32 at context 192: 205 -> 150 us) */                                                       \
    static void attend_item_##SUFFIX(const T *qh, int64_t q_sh, const T *k, const T *v, const int64_t *at, int len,    \
                                     T *oh, int g, int D, float scale, int group, int padded, float *scores,           \
                                     const Ahead *ahead) {                                                             \
        if (sizeof(T) == 2 &&                                                                                          \
            attend_row_pairs((const uint16_t *)qh, q_sh, (const uint16_t *)k, (const uint16_t *)v, at, len,            \
                             (uint16_t *)oh, g, D, scale, group, padded, scores, ahead))                               \
            return;                                                                                                    \
        switch (D / VLANES) {                                                                                          \
        case 4:                                                                                                        \
            attend_body_##SUFFIX(qh, q_sh, k, v, at, len, oh, g, D, scale, group, padded, scores, ahead, 4);           \
            break;                                                                                                     \
        case 8:                                                                                                        \
            attend_body_##SUFFIX(qh, q_sh, k, v, at, len, oh, g, D, scale, group, padded, scores, ahead, 8);           \
            break;                                                                                                     \
        default:                                                                                                       \
            attend_body_##SUFFIX(qh, q_sh, k, v, at, len, oh, g, D, scale, group, padded, scores, ahead, D / VLANES);  \
        }                                                                                                              \
    }

#else

/* dim is a multiple of LANES: LANES independent partial sums, added up at the end */
static inline float dot(const float *a, const float *b, int dim) {
    float acc[LANES] = {0};
    for (int i = 0; i < dim; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
}

#define ATTEND_ITEM(SUFFIX, T, STORE)                                                                                  \
    static void attend_item_##SUFFIX(const T *qh, int64_t q_sh, const T *k, const T *v, const int64_t *at, int len,    \
                                     T *oh, int g, int D, float scale, int group, int padded, float *scores,           \
                                     const Ahead *ahead) {                                                             \
        float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], row[MAX_HEAD_DIM];                            \
        for (int j = 0; j < group; j++) {                                                                              \
            const T *qr = qh + (int64_t)(g * group + j) * q_sh;                                                        \
            for (int d = 0; d < D; d++) qf[j][d] = load_##SUFFIX(qr[d]) * scale;                                       \
        }                                                                                                              \
        for (int t = 0; t < len; t++) {                                                                                \
            const T *kr = k + at[t];                                                                                   \
            for (int d = 0; d < D; d++) row[d] = load_##SUFFIX(kr[d]);                                                 \
            for (int j = 0; j < group; j++) scores[(size_t)j * padded + t] = dot(qf[j], row, D);                       \
            ahead_rows(ahead, t, t + 1);                                                                               \
        }                                                                                                              \
        ahead_rows(ahead, len, INT32_MAX);                                                                             \
        for (int j = 0; j < group; j++) {                                                                              \
            softmax_inplace(scores + (size_t)j * padded, len);                                                         \
            for (int d = 0; d < D; d++) acc[j][d] = 0.0f;                                                              \
        }                                                                                                              \
        for (int t = 0; t < len; t++) {                                                                                \
            const T *vr = v + at[t];                                                                                   \
            for (int d = 0; d < D; d++) row[d] = load_##SUFFIX(vr[d]);                                                 \
            for (int j = 0; j < group; j++) {                                                                          \
                const float p = scores[(size_t)j * padded + t];                                                        \
                for (int d = 0; d < D; d++) acc[j][d] += p * row[d];                                                   \
            }                                                                                                          \
        }                                                                                                              \
        for (int j = 0; j < group; j++) {                                                                              \
            T *o = oh + (int64_t)(g * group + j) * D;                                                                  \
            for (int d = 0; d < D; d++) o[d] = STORE(acc[j][d]);                                                       \
        }                                                                                                              \
    }

/* runs are the vector builds' (find_runs forms none here) */
static int run_shape(int D, int group) {
    (void)D, (void)group;
    return 0;
}
static void attend_run_pairs(const uint16_t *qh, int64_t q_sb, int64_t q_sh, const uint16_t *k, const uint16_t *v,
                             const int64_t *at, const int32_t *lens, int R, uint16_t *oh, int64_t o_sb, int g, int D,
                             float scale, int group, int padded, float *scores, float *qs, const Ahead *ahead) {
    (void)qh, (void)q_sb, (void)q_sh, (void)k, (void)v, (void)at, (void)lens, (void)R, (void)oh, (void)o_sb, (void)g;
    (void)D, (void)scale, (void)group, (void)padded, (void)scores, (void)qs, (void)ahead;
}

#endif

/* Every K and V row of one (sequence, KV head) item (its rows' offsets `at`, from item_offsets) requested into L2
 * before the item is worked on: a thread prefetches its first item, then each next one while it computes the current
 * one. A step's cache is read once and comes from memory, where rows asked for one at a time arrived at a fraction
 * of the memory's pace (batch 8, context 192: 52 -> 44 us a layer, on top of the prefetch_row fix: 90 -> 52). */
static inline __attribute__((always_inline)) void prefetch_item(const void *k, const void *v, const int64_t *at,
                                                                int len, int elem_bytes, int D) {
    for (int t = 0; t < len; t++) {
        prefetch_row((const char *)k + at[t] * elem_bytes, D * elem_bytes, 0);
        prefetch_row((const char *)v + at[t] * elem_bytes, D * elem_bytes, 0);
    }
}

ATTEND_ITEM(f32, float, store_f32)
ATTEND_ITEM(bf16, uint16_t, store_bf16)

/* A run of R rows of one sequence (find_runs; rows qh + r * q_sb, outputs oh + r * o_sb, row r's context lens[r]
 * tokens at offsets `at`): one row alone, or several together (find_runs forms runs only where attend_run_pairs
 * takes them). */
#define ATTEND_RUN(SUFFIX, T)                                                                                          \
    static void attend_run_##SUFFIX(const T *qh, int64_t q_sb, int64_t q_sh, const T *k, const T *v,                   \
                                    const int64_t *at, const int32_t *lens, int R, T *oh, int64_t o_sb, int g, int D,  \
                                    float scale, int group, int padded, float *scores, float *qs,                      \
                                    const Ahead *ahead) {                                                              \
        if (R == 1)                                                                                                    \
            attend_item_##SUFFIX(qh, q_sh, k, v, at, lens[0], oh, g, D, scale, group, padded, scores, ahead);          \
        else                                                                                                           \
            attend_run_pairs((const uint16_t *)qh, q_sb, q_sh, (const uint16_t *)k, (const uint16_t *)v, at, lens, R,  \
                             (uint16_t *)oh, o_sb, g, D, scale, group, padded, scores, qs, ahead);                     \
    }
ATTEND_RUN(f32, float)
ATTEND_RUN(bf16, uint16_t)

#define MAX_RUN 32

/* Rows runs[i] .. runs[i + 1] - 1 are run i (at most `most` rows); returns the number of runs. A row joins the run
 * of the row before it where that row's context lies in the same blocks of its own table and is no longer: the rows
 * of a sequence in a step that checks its guesses (the cache holds every row's K and V before the call), whose K
 * rows are then read once for all of them. */
static int find_runs(const int64_t *tables, int64_t table_stride, const int32_t *lens, int B, int BS, int most,
                     int *runs) {
    int n = 0;
    runs[0] = 0;
    for (int b = 1; b <= B; b++) {
        const int joins = b < B && b - runs[n] < most && lens[b] >= lens[b - 1] &&
                          !memcmp(tables + b * table_stride, tables + (b - 1) * table_stride,
                                  sizeof(int64_t) * (size_t)((lens[b - 1] + BS - 1) / BS));
        if (!joins) runs[++n] = b;
    }
    return n;
}

/* q [B, H, D] (row strides q_sb, q_sh; D contiguous); k, v [num_blocks, block_size, KVH, D] contiguous;
 * tables [B, table_stride] block ids; lens [B] context lengths (>= 1, at most max_len); out [B, H, D] contiguous.
 * The work is (run, KV head) items, each thread a contiguous share of them by rows times tokens.
 * Returns 0, 1 for shapes it does not take, 2 when scratch memory could not be had. */
#define DECODE_ATTENTION(NAME, SUFFIX, T)                                                                              \
    int NAME(const T *q, int64_t q_sb, int64_t q_sh, const T *k, const T *v, const int64_t *tables,                    \
             int64_t table_stride, const int32_t *lens, T *out, int B, int H, int KVH, int D, int BS, float scale,     \
             int max_len, int threads) {                                                                               \
        if (H % KVH || H / KVH > MAX_GROUP || D % LANES || D > MAX_HEAD_DIM) return 1;                                 \
        const int group = H / KVH, padded = (max_len + LANES - 1) / LANES * LANES;                                     \
        int *runs = malloc(sizeof(int) * (size_t)(B + 1));                                                             \
        int64_t *cum = malloc(sizeof(int64_t) * ((size_t)B * KVH + 1));                                                \
        if (!runs || !cum) {                                                                                           \
            free(runs), free(cum);                                                                                     \
            return 2;                                                                                                  \
        }                                                                                                              \
        /* runs only where attend_run_pairs takes them: elsewhere rows go one by one, with one row's scratch */        \
        const int most = sizeof(T) == 2 && run_shape(D, group) ? MAX_RUN : 1;                                          \
        const int nruns = find_runs(tables, table_stride, lens, B, BS, most, runs), items = nruns * KVH;               \
        int longest = 1;                                                                                               \
        cum[0] = 0;                                                                                                    \
        for (int i = 0; i < items; i++) {                                                                              \
            const int r0 = runs[i / KVH], rows = runs[i / KVH + 1] - r0;                                               \
            longest = rows > longest ? rows : longest;                                                                 \
            cum[i + 1] = cum[i] + (int64_t)rows * lens[r0 + rows - 1];                                                 \
        }                                                                                                              \
        const size_t heads = (size_t)longest * group;                                                                  \
        int failed = 0;                                                                                                \
        _Pragma("omp parallel num_threads(threads) reduction(|:failed)")                                               \
        {                                                                                                              \
            float *scores = aligned_alloc(                                                                             \
                64, sizeof(float) * heads * ((size_t)padded + (size_t)D) + 2 * sizeof(int64_t) * (size_t)padded);      \
            float *qs = scores + heads * (size_t)padded;                                                               \
            int64_t *at = (int64_t *)(qs + heads * (size_t)D), *at_next = at + padded;                                 \
            failed |= scores == NULL;                                                                                  \
            const int nt = omp_get_num_threads(), me = omp_get_thread_num();                                           \
            int lo = 0, hi = 0;                                                                                        \
            for (int i = 0; i < items; i++) {                                                                          \
                int owner = (int)((cum[i] + cum[i + 1]) * nt / (2 * cum[items]));                                      \
                owner = owner < nt ? owner : nt - 1;                                                                   \
                lo += owner < me, hi += owner <= me;                                                                   \
            }                                                                                                          \
            for (int item = lo; item < hi && scores != NULL; item++) {                                                 \
                const int b = runs[item / KVH], R = runs[item / KVH + 1] - b, next = item + 1;                         \
                if (item == lo) {                                                                                      \
                    item_offsets(tables + (b + R - 1) * table_stride, lens[b + R - 1], item % KVH, KVH, D, BS, at);    \
                    prefetch_item(k, v, at, lens[b + R - 1], (int)sizeof(T), D);                                       \
                }                                                                                                      \
                Ahead ahead = {(const char *)k, (const char *)v, at_next, 0, (int)sizeof(T), D * (int)sizeof(T)};     \
                if (next < hi) {                                                                                       \
                    const int last = runs[next / KVH + 1] - 1;                                                         \
                    item_offsets(tables + last * table_stride, lens[last], next % KVH, KVH, D, BS, at_next);           \
                    ahead.len = lens[last];                                                                            \
                }                                                                                                      \
                attend_run_##SUFFIX(q + b * q_sb, q_sb, q_sh, k, v, at, lens + b, R, out + (int64_t)b * H * D,         \
                                    (int64_t)H * D, item % KVH, D, scale, group, padded, scores, qs,                   \
                                    next < hi ? &ahead : NULL);                                                        \
                int64_t *done = at;                                                                                    \
                at = at_next, at_next = done;                                                                          \
            }                                                                                                          \
            free(scores);                                                                                              \
        }                                                                                                              \
        free(runs), free(cum);                                                                                         \
        return failed ? 2 : 0;                                                                                         \
    }

DECODE_ATTENTION(decode_attention_f32, f32, float)
DECODE_ATTENTION(decode_attention_bf16, bf16, uint16_t)
