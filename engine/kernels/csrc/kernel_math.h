/* Helpers the CPU kernels share (engine/kernels/csrc/*.c): bfloat16 <-> float32 as torch converts them, dot
 * products, and a float32 e^x in plain C that the compiler vectorizes. */
#ifndef PAGEDSERVE_KERNEL_MATH_H
#define PAGEDSERVE_KERNEL_MATH_H

#include <stdint.h>

/* a bfloat16 is the top half of a float32 */
static inline float bf16_load(uint16_t v)
{
    union { uint32_t u; float f; } x = {.u = (uint32_t)v << 16};
    return x.f;
}

/* round to nearest even, as torch rounds float32 to bfloat16; a NaN stays a (quiet) NaN */
static inline uint16_t bf16_store(float f)
{
    union { float f; uint32_t u; } x = {.f = f};
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

/* f rounded to bfloat16, as a float32: what a bfloat16 aten op's result reads back as */
static inline float bf16_round(float f) { return bf16_load(bf16_store(f)); }

/* a . b over n values (b in bfloat16 for dot_bf16), 8 partial sums: the compiler turns the inner loop into
 * one vector multiply-add per 8 values */
static inline float dot(const float *restrict a, const float *restrict b, int64_t n)
{
    float part[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) part[j] += a[i + j] * b[i + j];
    float tail = 0.0f;
    for (; i < n; ++i) tail += a[i] * b[i];
    return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7])) + tail;
}

static inline float dot_bf16(const float *restrict a, const uint16_t *restrict b, int64_t n)
{
    float part[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) part[j] += a[i + j] * bf16_load(b[i + j]);
    float tail = 0.0f;
    for (; i < n; ++i) tail += a[i] * bf16_load(b[i]);
    return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7])) + tail;
}

/* e^x to within a few ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial for e^r, 2^n put in the
 * exponent bits), x clamped to [-87.33, 88.37] so 2^n stays a normal float: e^-inf gives about 1e-38,
 * e^inf about 2.6e38, a NaN gives a number (callers keep NaN through their own arithmetic). Branch-free
 * float and integer arithmetic, so a `#pragma omp simd` loop over it vectorizes. */
static inline float exp_f32(float x)
{
    x = x < -87.33f ? -87.33f : (x > 88.37f ? 88.37f : x);
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to the nearest integer, in the low bits */
    const float t = x * 1.44269504088896341f + shifter;
    union { float f; int32_t i; } n_bits = {.f = t};
    const float n = t - shifter;
    float r = x - n * 0.693359375f; /* ln 2 in two parts, the first exact in a few bits */
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    union { int32_t i; float f; } scale = {.i = (n_bits.i - 0x4b400000 + 127) << 23};
    return (p * r * r + r + 1.0f) * scale.f;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* lane i of the result = the sum of v[i]'s 16 lanes: a transposing tree (45 shuffles and adds for 16
 * sums, where a reduction per vector takes about 8 each) */
static inline __m512 sum16x16(__m512 v[16])
{
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; ++i) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of v[2i], v[2i+1] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) { /* per 128-bit lane: one partial sum of each of 4 vectors */
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* 128-bit lanes paired across vectors: [u0 L0+L1, u0 L2+L3, u1 L0+L1, u1 L2+L3] */
    for (int i = 0; i < 2; ++i)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}
#endif

#endif
