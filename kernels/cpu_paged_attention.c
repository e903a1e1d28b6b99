/* Decode attention over the paged KV cache on CPU, reading each sequence's blocks where they lie.
 *
 * One query token per sequence. The work is split by (sequence, KV head): the query heads that share a KV head
 * (grouped-query attention) are done together, so every K and V row is loaded and widened to fp32 once for the
 * whole group. Scores, softmax and the weighted sum of V accumulate in fp32; the output is rounded once, to
 * nearest even. Every sum has a fixed order, so the result is the same from run to run and from batch to batch.
 *
 * Two builds of the same computation: with AVX-512 (x86 built with -march=native on a machine that has it),
 * scores for 16 tokens at a time, each a 16-lane product reduced by one transpose-and-add tree, and the next
 * K rows and the V rows prefetched while the scores are computed (the cache of a busy batch does not fit any
 * cache level, and waiting on memory cost more than the arithmetic: 0.97 -> 0.35 ms per layer at batch 32,
 * context 256); elsewhere (or with -DCPU_ATTENTION_PORTABLE) plain C loops that gcc -O3 vectorizes without
 * fast-math (independent lanes, no reassociated sums).
 *
 * Parallel with OpenMP: loaded into a process that runs torch, the library binds to the libgomp torch already
 * loaded, so its threads are torch's own pool. Built and loaded by kernels/cpu_paged_attention.py.
 */
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

/* s[0:len] = softmax(s[0:len]), in place, in fp32 */
static void softmax_inplace(float *s, int len) {
    float m = s[0], sum = 0.0f;
    for (int t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
    for (int t = 0; t < len; t++) s[t] = exp_f32(s[t] - m);
    for (int t = 0; t < len; t++) sum += s[t];
    const float inv = 1.0f / sum;
    for (int t = 0; t < len; t++) s[t] *= inv;
}

/* One (sequence, KV head) item: the `group` query heads of sequence b (qh = q + b * q_sb, oh = out + b * H * D)
 * that share KV head g, over its `len` tokens; `scores` is this thread's [group, padded] scratch. */

#if defined(__AVX512F__) && !defined(CPU_ATTENTION_PORTABLE)
#include <immintrin.h>

static inline __m512 loadv_f32(const float *p) { return _mm512_loadu_ps(p); }

static inline __m512 loadv_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void prefetch_row(const void *p, int nbytes, int hint) {
    for (int off = 0; off < nbytes; off += 64) {
        if (hint == _MM_HINT_T0) _mm_prefetch((const char *)p + off, _MM_HINT_T0);
        else _mm_prefetch((const char *)p + off, _MM_HINT_T1);
    }
}

/* lane t of the result = the sum of the 16 lanes of v[t] */
static inline __m512 sum_lanes16(const __m512 *v) {
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

#define CHUNKS (MAX_HEAD_DIM / LANES)
#define ATTEND_ITEM(SUFFIX, T, STORE)                                                                                \
    static void attend_item_##SUFFIX(const T *qh, int64_t q_sh, const T *k, const T *v, const int64_t *table,        \
                                     int len, T *oh, int g, int KVH, int D, int BS, float scale, int group,          \
                                     int padded, float *scores) {                                                    \
        const int nc = D / LANES;                                                                                    \
        __m512 qf[MAX_GROUP][CHUNKS], acc[MAX_GROUP][CHUNKS], part[MAX_GROUP][LANES], row[CHUNKS];                   \
        float res[MAX_HEAD_DIM];                                                                                     \
        const T *rows[LANES];                                                                                        \
        for (int j = 0; j < group; j++) {                                                                            \
            const T *qr = qh + (int64_t)(g * group + j) * q_sh;                                                      \
            for (int c = 0; c < nc; c++) qf[j][c] = _mm512_mul_ps(loadv_##SUFFIX(qr + c * LANES), _mm512_set1_ps(scale)); \
        }                                                                                                            \
        for (int t0 = 0; t0 < len; t0 += LANES) {                                                                    \
            const int n = len - t0 < LANES ? len - t0 : LANES;                                                       \
            for (int t = 0; t < n; t++) rows[t] = k + ((table[(t0 + t) / BS] * BS + (t0 + t) % BS) * KVH + g) * D;   \
            for (int t = t0 + LANES; t < t0 + 2 * LANES && t < len; t++)                                             \
                prefetch_row(k + ((table[t / BS] * BS + t % BS) * KVH + g) * D, D * (int)sizeof(T), _MM_HINT_T0);    \
            for (int t = t0; t < t0 + n; t++)                                                                        \
                prefetch_row(v + ((table[t / BS] * BS + t % BS) * KVH + g) * D, D * (int)sizeof(T), _MM_HINT_T1);    \
            for (int t = 0; t < n; t++) {                                                                            \
                for (int c = 0; c < nc; c++) row[c] = loadv_##SUFFIX(rows[t] + c * LANES);                           \
                for (int j = 0; j < group; j++) {                                                                    \
                    __m512 s = _mm512_mul_ps(qf[j][0], row[0]);                                                      \
                    for (int c = 1; c < nc; c++) s = _mm512_fmadd_ps(qf[j][c], row[c], s);                           \
                    part[j][t] = s;                                                                                  \
                }                                                                                                    \
            }                                                                                                        \
            for (int j = 0; j < group; j++) {                                                                        \
                for (int t = n; t < LANES; t++) part[j][t] = _mm512_setzero_ps();                                    \
                _mm512_store_ps(scores + (size_t)j * padded + t0, sum_lanes16(part[j]));                             \
            }                                                                                                        \
        }                                                                                                            \
        for (int j = 0; j < group; j++) {                                                                            \
            softmax_inplace(scores + (size_t)j * padded, len);                                                       \
            for (int c = 0; c < nc; c++) acc[j][c] = _mm512_setzero_ps();                                            \
        }                                                                                                            \
        for (int t = 0; t < len; t++) {                                                                              \
            const T *vr = v + ((table[t / BS] * BS + t % BS) * KVH + g) * D;                                         \
            for (int c = 0; c < nc; c++) row[c] = loadv_##SUFFIX(vr + c * LANES);                                    \
            for (int j = 0; j < group; j++) {                                                                        \
                const __m512 p = _mm512_set1_ps(scores[(size_t)j * padded + t]);                                     \
                for (int c = 0; c < nc; c++) acc[j][c] = _mm512_fmadd_ps(p, row[c], acc[j][c]);                      \
            }                                                                                                        \
        }                                                                                                            \
        for (int j = 0; j < group; j++) {                                                                            \
            T *o = oh + (int64_t)(g * group + j) * D;                                                                \
            for (int c = 0; c < nc; c++) _mm512_storeu_ps(res + c * LANES, acc[j][c]);                               \
            for (int d = 0; d < D; d++) o[d] = STORE(res[d]);                                                        \
        }                                                                                                            \
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

#define ATTEND_ITEM(SUFFIX, T, STORE)                                                                                \
    static void attend_item_##SUFFIX(const T *qh, int64_t q_sh, const T *k, const T *v, const int64_t *table,        \
                                     int len, T *oh, int g, int KVH, int D, int BS, float scale, int group,          \
                                     int padded, float *scores) {                                                    \
        float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], row[MAX_HEAD_DIM];                          \
        for (int j = 0; j < group; j++) {                                                                            \
            const T *qr = qh + (int64_t)(g * group + j) * q_sh;                                                      \
            for (int d = 0; d < D; d++) qf[j][d] = load_##SUFFIX(qr[d]) * scale;                                     \
        }                                                                                                            \
        for (int t = 0; t < len; t++) {                                                                              \
            const T *kr = k + ((table[t / BS] * BS + t % BS) * KVH + g) * D;                                         \
            for (int d = 0; d < D; d++) row[d] = load_##SUFFIX(kr[d]);                                               \
            for (int j = 0; j < group; j++) scores[(size_t)j * padded + t] = dot(qf[j], row, D);                     \
        }                                                                                                            \
        for (int j = 0; j < group; j++) {                                                                            \
            softmax_inplace(scores + (size_t)j * padded, len);                                                       \
            for (int d = 0; d < D; d++) acc[j][d] = 0.0f;                                                            \
        }                                                                                                            \
        for (int t = 0; t < len; t++) {                                                                              \
            const T *vr = v + ((table[t / BS] * BS + t % BS) * KVH + g) * D;                                         \
            for (int d = 0; d < D; d++) row[d] = load_##SUFFIX(vr[d]);                                               \
            for (int j = 0; j < group; j++) {                                                                        \
                const float p = scores[(size_t)j * padded + t];                                                      \
                for (int d = 0; d < D; d++) acc[j][d] += p * row[d];                                                 \
            }                                                                                                        \
        }                                                                                                            \
        for (int j = 0; j < group; j++) {                                                                            \
            T *o = oh + (int64_t)(g * group + j) * D;                                                                \
            for (int d = 0; d < D; d++) o[d] = STORE(acc[j][d]);                                                     \
        }                                                                                                            \
    }

#endif

ATTEND_ITEM(f32, float, store_f32)
ATTEND_ITEM(bf16, uint16_t, store_bf16)

/* q [B, H, D] (row strides q_sb, q_sh; D contiguous); k, v [num_blocks, block_size, KVH, D] contiguous;
 * tables [B, table_stride] block ids; lens [B] context lengths (>= 1, at most max_len); out [B, H, D] contiguous.
 * Returns 0, 1 for shapes it does not take, 2 when scratch memory could not be had. */
#define DECODE_ATTENTION(NAME, SUFFIX, T)                                                                            \
    int NAME(const T *q, int64_t q_sb, int64_t q_sh, const T *k, const T *v, const int64_t *tables,                  \
             int64_t table_stride, const int32_t *lens, T *out, int B, int H, int KVH, int D, int BS, float scale,   \
             int max_len, int threads) {                                                                             \
        if (H % KVH || H / KVH > MAX_GROUP || D % LANES || D > MAX_HEAD_DIM) return 1;                               \
        const int group = H / KVH, padded = (max_len + LANES - 1) / LANES * LANES;                                   \
        int failed = 0;                                                                                              \
        _Pragma("omp parallel num_threads(threads) reduction(|:failed)")                                             \
        {                                                                                                            \
            float *scores = aligned_alloc(64, sizeof(float) * (size_t)group * (size_t)padded);                       \
            failed |= scores == NULL;                                                                                \
            _Pragma("omp for schedule(static)")                                                                      \
            for (int item = 0; item < B * KVH; item++) {                                                             \
                if (scores == NULL) continue;                                                                        \
                const int b = item / KVH;                                                                            \
                attend_item_##SUFFIX(q + b * q_sb, q_sh, k, v, tables + b * table_stride, lens[b],                   \
                                     out + (int64_t)b * H * D, item % KVH, KVH, D, BS, scale, group, padded, scores); \
            }                                                                                                        \
            free(scores);                                                                                            \
        }                                                                                                            \
        return failed ? 2 : 0;                                                                                       \
    }

DECODE_ATTENTION(decode_attention_f32, f32, float)
DECODE_ATTENTION(decode_attention_bf16, bf16, uint16_t)
