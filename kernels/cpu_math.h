/* Scalar helpers the CPU kernels share: bfloat16 <-> float32 and a vectorizable exp.
 * Included by cpu_paged_attention.c, cpu_elementwise.c and cpu_linear.c (kernels/c_build.py hashes this file with
 * them). */
#ifndef PDSERVE_CPU_MATH_H
#define PDSERVE_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* round to nearest even, as torch does; NaN stays NaN. Both results are computed and one is selected, with no
 * branch, so that loops calling it vectorize without masked stores (AVX2: SiLU-and-mul ran scalar) */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t nan = (u >> 16) | 0x40u, rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* exp(x): x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial for e^r, then 2^n from the exponent bits; within
 * 2 ulp of expf, and written so that gcc vectorizes loops calling it. Above 88 it overflows to infinity as expf
 * does; below -87 it returns exp(-87) where expf goes subnormal (0 next to a softmax row's maximum, and next
 * to 1 in SiLU). */
static inline float exp_f32(float x) {
    float v = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
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
    return x > 88.0f ? INFINITY : e * scale;
}

#endif
