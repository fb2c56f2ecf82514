/* w8a8's activations on CPU, float32 or bfloat16, one pass a row each way:
 *
 * quantize_rows: each row of x [rows, k] rounded to int8 with its own scale, scale = max |x| / 127 and
 *   q = round-half-even(x / scale) clamped to +-127, as engine/executor/layers/quantization.py's torch
 *   expression computes them, but for rows whose max |x| is under 127 * FLT_MIN (zeros: q zeros, scale
 *   FLT_MIN, where torch's is a denormal this kernel's flushed arithmetic would make 0) and NaNs (q 0,
 *   left out of the max);
 * scale_rows: an int8 product's float32 result y [rows, n] times each row's scale, written in float32 or
 *   rounded to bfloat16 (y in place for float32).
 *
 * Why: in torch each is five to seven ops (abs, amax, clamp, div, round, the int8 cast; the multiply and
 * the cast back), each a parallel region over memory: ~140 ms of a 128-token prefill on the Qwen2-1.5B
 * shape whose int8 products took 134 ms. Built by engine/kernels/cpu.py with the other kernels; callers
 * split [row_begin, row_end). */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "kernel_math.h"

/* max(top, |v|), a NaN v left out (a ternary, not fmaxf: the compiler vectorizes it) */
static inline float biggest(float top, float v)
{
    const float a = fabsf(v);
    return a > top ? a : top;
}

/* round(v / scale) half to even, clamped to +-127 (a NaN to 0): branch-free, so the loops vectorize. Adding
 * and taking away 1.5 * 2^23 leaves v rounded to an integer in the default rounding mode (|v| < 2^22). */
static inline int8_t to_int8(float v, float scale)
{
    float t = v / scale;
    t = t > 127.0f ? 127.0f : t;
    t = t < -127.0f ? -127.0f : t;
    t = t == t ? t : 0.0f;
    return (int8_t)(int32_t)((t + 12582912.0f) - 12582912.0f);
}

int quantize_rows_f32(const float *x, int8_t *q, float *scale, int64_t k, int64_t row_begin, int64_t row_end)
{
    for (int64_t r = row_begin; r < row_end; ++r) {
        const float *src = x + r * k;
        float top = 0.0f;
#pragma omp simd reduction(max : top)
        for (int64_t i = 0; i < k; ++i) top = biggest(top, src[i]);
        const float s = fmaxf(top / 127.0f, FLT_MIN);
        int8_t *dst = q + r * k;
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) dst[i] = to_int8(src[i], s);
        scale[r] = s;
    }
    return 0;
}

int quantize_rows_bf16(const uint16_t *x, int8_t *q, float *scale, int64_t k, int64_t row_begin, int64_t row_end)
{
    for (int64_t r = row_begin; r < row_end; ++r) {
        const uint16_t *src = x + r * k;
        float top = 0.0f;
#pragma omp simd reduction(max : top)
        for (int64_t i = 0; i < k; ++i) top = biggest(top, bf16_load(src[i]));
        const float s = fmaxf(top / 127.0f, FLT_MIN);
        int8_t *dst = q + r * k;
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) dst[i] = to_int8(bf16_load(src[i]), s);
        scale[r] = s;
    }
    return 0;
}

int scale_rows_f32(float *y, const float *scale, int64_t n, int64_t row_begin, int64_t row_end)
{
    for (int64_t r = row_begin; r < row_end; ++r) {
        float *row = y + r * n;
        const float s = scale[r];
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) row[i] *= s;
    }
    return 0;
}

int scale_rows_bf16(const float *y, const float *scale, uint16_t *out, int64_t n, int64_t row_begin, int64_t row_end)
{
    for (int64_t r = row_begin; r < row_end; ++r) {
        const float *row = y + r * n;
        uint16_t *dst = out + r * n;
        const float s = scale[r];
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) dst[i] = bf16_store(row[i] * s);
    }
    return 0;
}
