/* Decode attention over the paged KV cache on CPU, reading each sequence's blocks where they lie.
 *
 * One query token per sequence. The work is split by (sequence, KV head): the query heads that share a KV head
 * (grouped-query attention) are done together, so every K and V row is loaded and widened to fp32 once for the
 * whole group. Scores, softmax and the weighted sum of V accumulate in fp32; the output is rounded once, to
 * nearest even. Loops are written so that gcc -O3 vectorizes them without fast-math (independent lanes, no
 * reassociated sums), which keeps the result the same from run to run and from batch to batch.
 *
 * Parallel with OpenMP: loaded into a process that runs torch, the library binds to the libgomp torch already
 * loaded, so its threads are torch's own pool. Built and loaded by kernels/cpu_paged_attention.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define LANES 16

static inline float load_f32(float x) { return x; }
static inline float store_f32(float x) { return x; }

static inline float load_bf16(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t store_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even (attention outputs are finite) */
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0, in place: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial for e^r, then 2^n from the
 * exponent bits. Within 2 ulp of expf; below -87 it returns exp(-87), which is 0 next to the row's maximum. */
static void exp_inplace(float *x, int n) {
    for (int i = 0; i < n; i++) {
        float v = x[i] < -87.0f ? -87.0f : x[i];
        float k = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(v / ln2) */
        float r = v - k * 0.693359375f + k * 2.12194440e-4f;
        float p = 1.9875691500e-4f;
        p = p * r + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        float e = p * r * r + r + 1.0f;
        int32_t bits = ((int32_t)k + 127) << 23;
        float scale;
        memcpy(&scale, &bits, sizeof scale);
        x[i] = e * scale;
    }
}

/* dim is a multiple of LANES: LANES independent partial sums, added up at the end */
static inline float dot(const float *a, const float *b, int dim) {
    float acc[LANES] = {0};
    for (int i = 0; i < dim; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
}

/* q [B, H, D] (row strides q_sb, q_sh; D contiguous); k, v [num_blocks, block_size, KVH, D] contiguous;
 * tables [B, table_stride] block ids; lens [B] context lengths (>= 1); out [B, H, D] contiguous. */
#define DECODE_ATTENTION(NAME, T, LOAD, STORE)                                                                    \
    int NAME(const T *q, int64_t q_sb, int64_t q_sh, const T *k, const T *v, const int64_t *tables,                \
             int64_t table_stride, const int32_t *lens, T *out, int B, int H, int KVH, int D, int BS, float scale,  \
             int max_len, int threads) {                                                                           \
        if (H % KVH || H / KVH > MAX_GROUP || D % LANES || D > MAX_HEAD_DIM) return 1;                              \
        const int group = H / KVH;                                                                                 \
        int failed = 0;                                                                                            \
        _Pragma("omp parallel num_threads(threads) reduction(|:failed)")                                           \
        {                                                                                                          \
            float *scores = malloc(sizeof(float) * (size_t)group * (size_t)max_len);                               \
            float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], row[MAX_HEAD_DIM];                    \
            failed |= scores == NULL;                                                                              \
            _Pragma("omp for schedule(static)")                                                                   \
            for (int item = 0; item < B * KVH; item++) {                                                           \
                if (scores == NULL) continue;                                                                      \
                const int b = item / KVH, g = item % KVH, len = lens[b];                                           \
                const int64_t *table = tables + b * table_stride;                                                  \
                for (int j = 0; j < group; j++) {                                                                  \
                    const T *qr = q + b * q_sb + (int64_t)(g * group + j) * q_sh;                                  \
                    for (int d = 0; d < D; d++) qf[j][d] = LOAD(qr[d]) * scale;                                    \
                }                                                                                                  \
                for (int t = 0; t < len; t++) {                                                                    \
                    const T *kr = k + ((table[t / BS] * BS + t % BS) * KVH + g) * D;                               \
                    for (int d = 0; d < D; d++) row[d] = LOAD(kr[d]);                                              \
                    for (int j = 0; j < group; j++) scores[j * max_len + t] = dot(qf[j], row, D);                  \
                }                                                                                                  \
                for (int j = 0; j < group; j++) {                                                                  \
                    float *s = scores + j * max_len, m = s[0], sum = 0.0f;                                         \
                    for (int t = 1; t < len; t++) m = s[t] > m ? s[t] : m;                                         \
                    for (int t = 0; t < len; t++) s[t] -= m;                                                       \
                    exp_inplace(s, len);                                                                           \
                    for (int t = 0; t < len; t++) sum += s[t];                                                     \
                    const float inv = 1.0f / sum;                                                                  \
                    for (int t = 0; t < len; t++) s[t] *= inv;                                                     \
                    for (int d = 0; d < D; d++) acc[j][d] = 0.0f;                                                  \
                }                                                                                                  \
                for (int t = 0; t < len; t++) {                                                                    \
                    const T *vr = v + ((table[t / BS] * BS + t % BS) * KVH + g) * D;                               \
                    for (int d = 0; d < D; d++) row[d] = LOAD(vr[d]);                                              \
                    for (int j = 0; j < group; j++) {                                                              \
                        const float p = scores[j * max_len + t];                                                   \
                        for (int d = 0; d < D; d++) acc[j][d] += p * row[d];                                       \
                    }                                                                                              \
                }                                                                                                  \
                for (int j = 0; j < group; j++) {                                                                  \
                    T *o = out + ((int64_t)b * H + g * group + j) * D;                                             \
                    for (int d = 0; d < D; d++) o[d] = STORE(acc[j][d]);                                           \
                }                                                                                                  \
            }                                                                                                      \
            free(scores);                                                                                          \
        }                                                                                                          \
        return failed ? 2 : 0;                                                                                     \
    }

DECODE_ATTENTION(decode_attention_f32, float, load_f32, store_f32)
DECODE_ATTENTION(decode_attention_bf16, uint16_t, load_bf16, store_bf16)
