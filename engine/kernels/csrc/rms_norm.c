/* RMSNorm on CPU in one pass per row, float32 or bfloat16: out = x * rsqrt(mean(x^2) + eps) * weight,
 * with every sum and product in float32 and a bfloat16 result rounded once, as F.rms_norm does. With a
 * residual, sum = x + residual (rounded to x's dtype, as torch's add) is written out and normalized: the
 * decoder layer's residual add and the norm after it in one pass over the row.
 *
 * Why not F.rms_norm: on CPU it is a chain of aten ops (pow, mean, add, rsqrt, mul, mul, and two
 * copies for bfloat16), each a parallel region once a tensor passes torch's grain size. On a 2-core VM
 * with OpenMP's idle threads asleep (OMP_WAIT_POLICY=PASSIVE, which the server needs) each region
 * wakes a thread: [256, 576] took 189 us in float32 and 280 us in bfloat16, for 295 KB of data.
 *
 * head_norm: the same per head, in place, for Qwen3's q_norm and k_norm on the q/k/v projection's output,
 * where F.rms_norm on the q and k views was two chains of aten ops (with RoPE's, ~0.55 ms a layer of a
 * 28-row decode step on the Qwen3-250M shape).
 *
 * Built by engine/kernels/cpu.py with the other kernels; callers split [row_begin, row_end). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernel_math.h"

/* the row's mean square, from the values in `row` (float32) */
static inline float mean_square(const float *restrict row, int64_t dim)
{
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16)
        for (int j = 0; j < 16; ++j) part[j] += row[i + j] * row[i + j];
    float sum = 0.0f;
    for (; i < dim; ++i) sum += row[i] * row[i];
    for (int j = 0; j < 16; ++j) sum += part[j];
    return sum / (float)dim;
}

/* dst = the norm of row (dst may be row) */
static inline void norm_row_f32(const float *row, const float *weight, float *dst, int64_t dim, float eps)
{
    const float inv = 1.0f / sqrtf(mean_square(row, dim) + eps);
    for (int64_t i = 0; i < dim; ++i) dst[i] = row[i] * inv * weight[i];
}

/* dst = the norm of row (its values as float32), rounded once to bfloat16 */
static inline void norm_row_bf16(const float *row, const uint16_t *weight, uint16_t *dst, int64_t dim,
                                 float eps)
{
    const float inv = 1.0f / sqrtf(mean_square(row, dim) + eps);
    for (int64_t i = 0; i < dim; ++i) dst[i] = bf16_store(row[i] * inv * bf16_load(weight[i]));
}

/* x, out and (both NULL or neither) residual, sum: [rows, dim] float32; weight [dim] */
int rms_norm_f32(const float *x, const float *residual, const float *weight, float *sum, float *out, int64_t dim,
                 float eps, int64_t row_begin, int64_t row_end)
{
    for (int64_t r = row_begin; r < row_end; ++r) {
        const float *row = x + r * dim;
        if (residual != NULL) {
            const float *add = residual + r * dim;
            float *total = sum + r * dim;
            for (int64_t i = 0; i < dim; ++i) total[i] = row[i] + add[i];
            row = total;
        }
        norm_row_f32(row, weight, out + r * dim, dim, eps);
    }
    return 0;
}

#define MAX_DIM 16384 /* a row's float32 copy lives on the stack */

/* as rms_norm_f32, every tensor bfloat16 */
int rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *sum, uint16_t *out,
                  int64_t dim, float eps, int64_t row_begin, int64_t row_end)
{
    if (dim > MAX_DIM) return -1;
    float row[MAX_DIM];
    for (int64_t r = row_begin; r < row_end; ++r) {
        const uint16_t *src = x + r * dim;
        uint16_t *dst = out + r * dim;
        if (residual != NULL) {
            const uint16_t *add = residual + r * dim;
            uint16_t *total = sum + r * dim;
            for (int64_t i = 0; i < dim; ++i) {
                total[i] = bf16_store(bf16_load(src[i]) + bf16_load(add[i]));
                row[i] = bf16_load(total[i]);
            }
        } else {
            for (int64_t i = 0; i < dim; ++i) row[i] = bf16_load(src[i]);
        }
        norm_row_bf16(row, weight, dst, dim, eps);
    }
    return 0;
}

/* Qwen3's q_norm and k_norm in place on a q/k/v projection's output x [tokens, heads, head_dim]: each
 * token's first num_q heads normed by q_weight, the next num_k by k_weight [head_dim], the rest (v) left */
int head_norm_f32(float *x, const float *q_weight, const float *k_weight, int64_t heads, int64_t num_q,
                  int64_t num_k, int64_t head_dim, float eps, int64_t token_begin, int64_t token_end)
{
    for (int64_t t = token_begin; t < token_end; ++t)
        for (int64_t h = 0; h < num_q + num_k; ++h) {
            float *row = x + (t * heads + h) * head_dim;
            norm_row_f32(row, h < num_q ? q_weight : k_weight, row, head_dim, eps);
        }
    return 0;
}

int head_norm_bf16(uint16_t *x, const uint16_t *q_weight, const uint16_t *k_weight, int64_t heads,
                   int64_t num_q, int64_t num_k, int64_t head_dim, float eps, int64_t token_begin,
                   int64_t token_end)
{
    if (head_dim > MAX_DIM) return -1;
    float row[MAX_DIM];
    for (int64_t t = token_begin; t < token_end; ++t)
        for (int64_t h = 0; h < num_q + num_k; ++h) {
            uint16_t *src = x + (t * heads + h) * head_dim;
            for (int64_t i = 0; i < head_dim; ++i) row[i] = bf16_load(src[i]);
            norm_row_bf16(row, h < num_q ? q_weight : k_weight, src, head_dim, eps);
        }
    return 0;
}
