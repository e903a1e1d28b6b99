/* Decode attention over the paged KV cache on CPU, reading each sequence's blocks where they lie.
 *
 * One query token per sequence. The work is split by (sequence, KV head): the query heads that share a KV head
 * (grouped-query attention) are done together, so every K and V row is loaded and widened to fp32 once for the
 * whole group. Scores, softmax and the weighted sum of V accumulate in fp32; the output is rounded once, to
 * nearest even. Every sum has a fixed order, so the result is the same from run to run and from batch to batch.
 *
 * Two builds of the same computation: with AVX-512 or AVX2 (x86 built with -march=native on a machine that has
 * it), scores for 16 (8) tokens at a time, each a product across lanes reduced by one transpose-and-add tree, and
 * the next K rows and the V rows prefetched while the scores are computed (a bf16 cache of 64- or 128-value heads
 * with up to 4 query heads a KV head takes attend_pairs, which widens rows as even and odd halves); elsewhere (or with
 * -DCPU_ATTENTION_PORTABLE) plain C loops that gcc -O3 vectorizes without fast-math (independent lanes, no
 * reassociated sums). A step reads its cache once, from memory (the cache of a busy batch fits no cache level,
 * and the weights stream through them between layers), so every build also asks for each item's K and V rows
 * into L2 while the thread computes the item before it.
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
static inline __attribute__((always_inline)) void widen_pair(const uint16_t *p, vec *even, vec *odd) {
    const __m512i u = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}
#define ACC_BUDGET 24 /* of 32 registers: accumulators, the rest for the widened pair and the weights */
#else
static inline __attribute__((always_inline)) void widen_pair(const uint16_t *p, vec *even, vec *odd) {
    const __m256i u = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}
#define ACC_BUDGET 8 /* of 16: at 12, with the broadcast scores and the widened pair, gcc spilled accumulators */
#endif
#define PAIR_LANES (2 * VLANES)
#define MAX_PAIRS (MAX_HEAD_DIM / PAIR_LANES)

/* A bf16 item of up to 4 query heads a KV head, each row widened as even and odd halves (widen_pair), with the
 * queries and the output accumulators held in that order. Scores are taken VLANES tokens at a time as in
 * attend_body; the weighted sum of V runs over the tokens once per `cp` pairs of each row, with group * 2 * cp
 * accumulators in registers, so that enough FMAs are independent and no V row is widened twice. np = D / PAIR_LANES.
 * Each output value is still its tokens' sum in token order; a score's order of summation differs from
 * attend_body's. Batch 8, context 192, one layer's cache in L3, 2 threads: AVX2 48 -> 40 us, AVX-512 33 -> 21 us
 * (Zen 5; with the cache in memory the item's reads bound it, see Ahead). */
static inline __attribute__((always_inline)) void attend_pairs(const uint16_t *qh, int64_t q_sh, const uint16_t *k,
                                                               const uint16_t *v, const int64_t *at, int len,
                                                               uint16_t *oh, int g, float scale, const int group,
                                                               int padded, float *scores, const Ahead *ahead,
                                                               const int np, const int cp) {
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
    for (int j = 0; j < group; j++) softmax_inplace(scores + (size_t)j * padded, len);
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
            uint16_t *out = oh + (int64_t)(g * group + j) * D + c0 * PAIR_LANES;
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

/* attend_pairs with its shape as constants (gcc keeps arrays of vectors in registers only at counts it knows):
 * 64- and 128-value heads, 1 to 4 query heads a KV head. Returns 0 for any other shape. */
#define PAIRS_CP(group, np)                                                                                            \
    ((np) >= 4 && (group) * 8 <= ACC_BUDGET ? 4 : (np) >= 2 && (group) * 4 <= ACC_BUDGET ? 2 : 1)
#define PAIRS_CASE(G_, NP)                                                                                             \
    case (G_) * 16 + (NP):                                                                                             \
        attend_pairs(qh, q_sh, k, v, at, len, oh, g, scale, G_, padded, scores, ahead, NP, PAIRS_CP(G_, NP));          \
        return 1;
static int attend_item_pairs(const uint16_t *qh, int64_t q_sh, const uint16_t *k, const uint16_t *v, const int64_t *at,
                             int len, uint16_t *oh, int g, int D, float scale, int group, int padded, float *scores,
                             const Ahead *ahead) {
    if (D % PAIR_LANES || group > 4) return 0;
    switch (group * 16 + D / PAIR_LANES) {
        PAIRS_CASE(1, 64 / PAIR_LANES)
        PAIRS_CASE(2, 64 / PAIR_LANES)
        PAIRS_CASE(3, 64 / PAIR_LANES)
        PAIRS_CASE(4, 64 / PAIR_LANES)
        PAIRS_CASE(1, 128 / PAIR_LANES)
        PAIRS_CASE(2, 128 / PAIR_LANES)
        PAIRS_CASE(3, 128 / PAIR_LANES)
        PAIRS_CASE(4, 128 / PAIR_LANES)
    }
    return 0;
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
            attend_item_pairs((const uint16_t *)qh, q_sh, (const uint16_t *)k, (const uint16_t *)v, at, len,           \
                              (uint16_t *)oh, g, D, scale, group, padded, scores, ahead))                              \
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

/* q [B, H, D] (row strides q_sb, q_sh; D contiguous); k, v [num_blocks, block_size, KVH, D] contiguous;
 * tables [B, table_stride] block ids; lens [B] context lengths (>= 1, at most max_len); out [B, H, D] contiguous.
 * Returns 0, 1 for shapes it does not take, 2 when scratch memory could not be had. */
#define DECODE_ATTENTION(NAME, SUFFIX, T)                                                                              \
    int NAME(const T *q, int64_t q_sb, int64_t q_sh, const T *k, const T *v, const int64_t *tables,                    \
             int64_t table_stride, const int32_t *lens, T *out, int B, int H, int KVH, int D, int BS, float scale,     \
             int max_len, int threads) {                                                                               \
        if (H % KVH || H / KVH > MAX_GROUP || D % LANES || D > MAX_HEAD_DIM) return 1;                                 \
        const int group = H / KVH, padded = (max_len + LANES - 1) / LANES * LANES;                                     \
        int failed = 0;                                                                                                \
        _Pragma("omp parallel num_threads(threads) reduction(|:failed)")                                               \
        {                                                                                                              \
            float *scores = aligned_alloc(64, (sizeof(float) * group + 2 * sizeof(int64_t)) * (size_t)padded);         \
            int64_t *at = (int64_t *)(scores + (size_t)group * padded), *at_next = at + padded;                        \
            failed |= scores == NULL;                                                                                  \
            const int nt = omp_get_num_threads(), me = omp_get_thread_num(), items = B * KVH;                          \
            const int lo = (int)((int64_t)items * me / nt), hi = (int)((int64_t)items * (me + 1) / nt);                \
            for (int item = lo; item < hi && scores != NULL; item++) {                                                 \
                const int b = item / KVH, next = item + 1;                                                             \
                if (item == lo) {                                                                                      \
                    item_offsets(tables + b * table_stride, lens[b], item % KVH, KVH, D, BS, at);                      \
                    prefetch_item(k, v, at, lens[b], (int)sizeof(T), D);                                               \
                }                                                                                                      \
                Ahead ahead = {(const char *)k, (const char *)v, at_next, 0, (int)sizeof(T), D * (int)sizeof(T)};     \
                if (next < hi) {                                                                                       \
                    const int nb = next / KVH;                                                                         \
                    item_offsets(tables + nb * table_stride, lens[nb], next % KVH, KVH, D, BS, at_next);               \
                    ahead.len = lens[nb];                                                                              \
                }                                                                                                      \
                attend_item_##SUFFIX(q + b * q_sb, q_sh, k, v, at, lens[b], out + (int64_t)b * H * D, item % KVH, D,   \
                                     scale, group, padded, scores, next < hi ? &ahead : NULL);                         \
                int64_t *done = at;                                                                                    \
                at = at_next, at_next = done;                                                                          \
            }                                                                                                          \
            free(scores);                                                                                              \
        }                                                                                                              \
        return failed ? 2 : 0;                                                                                         \
    }

DECODE_ATTENTION(decode_attention_f32, f32, float)
DECODE_ATTENTION(decode_attention_bf16, bf16, uint16_t)
