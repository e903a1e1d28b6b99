/* The element-wise steps between a decoder layer's matrix products, one pass each, for bfloat16 on CPU.
 *
 * In eager torch an RMSNorm is seven operators, a rotary embedding five and SiLU-and-multiply three, each reading
 * and writing the whole activation (and, in a decode step of a small model, costing more to dispatch than to
 * compute). Each function here does one pass over rows, parallel over rows with OpenMP. Every bfloat16 rounding
 * the eager code makes is made here too, at the same point, to nearest even, so rotary embeddings are bit for bit
 * the same as eager; RMSNorm's sum of squares and SiLU's exp are computed in fp32 in another order and with
 * another exp, which can move a result by one bfloat16 step, rarely.
 * Built and loaded by kernels/cpu_elementwise.py.
 */
#include <stdint.h>

#include "cpu_math.h"

#define LANES 16
#define PAR_MIN_ELEMS 32768 /* fewer elements than this: one thread (a team costs more than the work) */
/* SiLU's exp and division cost ~4 cycles an element under AVX2, ten times a norm's: a batch of 8 rows of 1536 took
 * 14 us on one thread, against ~1 us to start a team */
#define SILU_PAR_MIN_ELEMS 4096

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* ROW(t) for t in [0, T) on `team` threads; with one, outside any OpenMP region: even a region of one thread cost
 * ~0.25 us, as much as a decode row's norm, and a batch-1 decode step runs four of these a layer. */
#define FOR_ROWS(team, T, ROW)                                                                                         \
    do {                                                                                                               \
        if ((team) > 1) {                                                                                              \
            _Pragma("omp parallel for num_threads(team) schedule(static)") for (int t_ = 0; t_ < (T); t_++) ROW(t_);   \
        } else                                                                                                         \
            for (int t_ = 0; t_ < (T); t_++) ROW(t_);                                                                  \
    } while (0)

static inline void norm_row(const uint16_t *xr, const uint16_t *w, uint16_t *o, int n, float eps) {
    float acc[LANES] = {0};
    for (int i = 0; i < n; i += LANES)
        for (int j = 0; j < LANES; j++) {
            const float v = bf16_to_f32(xr[i + j]);
            acc[j] += v * v;
        }
    float sum = 0.0f;
    for (int j = 0; j < LANES; j++) sum += acc[j];
    const float r = 1.0f / sqrtf(sum / (float)n + eps);
    for (int i = 0; i < n; i++) o[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(xr[i]) * r));
}

/* out[t] = w * bf16(x[t] * rsqrt(mean(x[t]^2) + eps)); x rows at stride x_stride, out contiguous [T, n] */
int rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out, int T, int n, float eps,
                  int threads) {
    if (n % LANES) return 1;
    const int team = (int64_t)T * n >= PAR_MIN_ELEMS ? threads : 1;
#define ROW(t) norm_row(x + (int64_t)(t) * x_stride, w, out + (int64_t)(t) * n, n, eps)
    FOR_ROWS(team, T, ROW);
#undef ROW
    return 0;
}

static inline void silu_row(const uint16_t *g, const uint16_t *u, uint16_t *o, int inter) {
    for (int i = 0; i < inter; i++) {
        const float a = bf16_to_f32(g[i]);
        o[i] = f32_to_bf16(round_bf16(a / (1.0f + exp_f32(-a))) * bf16_to_f32(u[i]));
    }
}

/* out [T, inter] = bf16(bf16(silu(gate)) * up), gate and up the two halves of each row of gu (row stride gu_stride) */
int silu_and_mul_bf16(const uint16_t *gu, int64_t gu_stride, uint16_t *out, int T, int inter, int threads) {
    const int team = T > 1 && (int64_t)T * inter >= SILU_PAR_MIN_ELEMS ? threads : 1;
#define ROW(t)                                                                                                         \
    silu_row(gu + (int64_t)(t) * gu_stride, gu + (int64_t)(t) * gu_stride + inter, out + (int64_t)(t) * inter, inter)
    FOR_ROWS(team, T, ROW);
#undef ROW
    return 0;
}

static inline void rope_row(uint16_t *x, const uint16_t *c, const uint16_t *s, int heads, int dim) {
    const int half = dim / 2;
    float cf[1024], sf[1024];
    for (int d = 0; d < dim; d++) {
        cf[d] = bf16_to_f32(c[d]);
        sf[d] = bf16_to_f32(s[d]);
    }
    for (int h = 0; h < heads; h++) {
        uint16_t *xr = x + (int64_t)h * dim;
        float lo[512], hi[512];
        for (int d = 0; d < half; d++) {
            lo[d] = bf16_to_f32(xr[d]);
            hi[d] = bf16_to_f32(xr[half + d]);
        }
        for (int d = 0; d < half; d++) {
            xr[d] = f32_to_bf16(round_bf16(lo[d] * cf[d]) + round_bf16(-hi[d] * sf[d]));
            xr[half + d] = f32_to_bf16(round_bf16(hi[d] * cf[half + d]) + round_bf16(lo[d] * sf[half + d]));
        }
    }
}

/* In place on x [T, heads, dim] (row stride x_stride, heads contiguous): x = bf16(bf16(x * cos) + bf16(rot(x) * sin)),
 * rot(x) = (-x[half:], x[:half]); cos, sin [T, dim] (row strides cs_stride). */
int rope_bf16(uint16_t *x, int64_t x_stride, const uint16_t *cos_, const uint16_t *sin_, int64_t cs_stride, int T,
              int heads, int dim, int threads) {
    if (dim % 2 || dim > 1024) return 1;
    const int team = (int64_t)T * heads * dim >= PAR_MIN_ELEMS ? threads : 1;
#define ROW(t)                                                                                                         \
    rope_row(x + (int64_t)(t) * x_stride, cos_ + (int64_t)(t) * cs_stride, sin_ + (int64_t)(t) * cs_stride, heads, dim)
    FOR_ROWS(team, T, ROW);
#undef ROW
    return 0;
}

static inline void argmax_row(const void *x, int64_t ldx, int x_bf16, int t, int n, int64_t *idx, uint8_t *bad) {
    const float *xf = (const float *)x + (int64_t)t * ldx;
    const uint16_t *xh = (const uint16_t *)x + (int64_t)t * ldx;
    float best[LANES];
    int32_t at[LANES], nan[LANES];
    for (int j = 0; j < LANES; j++) best[j] = -INFINITY, at[j] = n, nan[j] = 0;
    const int nl = n / LANES * LANES;
    for (int i = 0; i < nl; i += LANES)
        for (int j = 0; j < LANES; j++) {
            const float v = x_bf16 ? bf16_to_f32(xh[i + j]) : xf[i + j];
            const int more = v > best[j];
            best[j] = more ? v : best[j];
            at[j] = more ? i + j : at[j];
            nan[j] |= v != v;
        }
    float m = -INFINITY;
    int64_t first = n;
    int any_nan = 0;
    for (int i = nl; i < n; i++) {
        const float v = x_bf16 ? bf16_to_f32(xh[i]) : xf[i];
        any_nan |= v != v;
        if (v > m) m = v, first = i;
    }
    for (int j = 0; j < LANES; j++) {
        any_nan |= nan[j];
        if (best[j] > m || (best[j] == m && at[j] < first)) m = best[j], first = at[j];
    }
    bad[t] = any_nan || !(m < INFINITY) || m == -INFINITY;
    idx[t] = first < n ? first : 0;
}

/* Greedy decoding's argmax, row by row: idx[t] = the first index of the largest of row t's n values (fp32, or
 * bfloat16 where x_bf16; rows at stride ldx), as torch.argmax gives it, and bad[t] = 1 where that largest value is
 * not finite (the row holds a NaN or +inf, or no finite value at all). One pass: LANES running maxima, each with
 * the first index where it was reached, merged at the end by value, then by index. Torch's argmax took about 45
 * us a row of 49,152 here; this takes a few. Returns 0. */
int argmax_rows(const void *x, int64_t ldx, int x_bf16, int T, int n, int64_t *idx, uint8_t *bad, int threads) {
    const int team = (int64_t)T * n >= 8 * PAR_MIN_ELEMS ? threads : 1;
#define ROW(t) argmax_row(x, ldx, x_bf16, t, n, idx, bad)
    FOR_ROWS(team, T, ROW);
#undef ROW
    return 0;
}
