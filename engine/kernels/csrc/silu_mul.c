/* SwiGLU's activation on CPU in one pass, float32 or bfloat16: for each row of the fused gate/up
 * projection's output [rows, 2n], out = silu(gate) * up, silu(g) = g / (1 + e^-g), every operation in
 * float32. In bfloat16 silu(g) is rounded to bfloat16 before the product and the product once more, as
 * aten's two ops round their results (F.silu, then the multiply).
 *
 * Why: those two aten ops (and the chunk's strided reads) are two parallel regions, each waking
 * OpenMP's sleeping thread on a 2-core VM (OMP_WAIT_POLICY=PASSIVE): a decode step's [32, 1536] took
 * ~110 us, this pass ~30 us. Float32 results within a few ulp of aten's (its exp is another
 * polynomial); bfloat16 results have matched aten's on every element tested.
 *
 * Built by engine/kernels/cpu.py with the other kernels; callers split [row_begin, row_end). */
#include <stdint.h>

#include "kernel_math.h"

static inline float silu(float g)
{
    return g / (1.0f + exp_f32(-g));
}

/* x [rows, 2n]: gate, then up; out [rows, n] */
int silu_mul_f32(const float *x, float *out, int64_t n, int64_t row_begin, int64_t row_end)
{
    for (int64_t r = row_begin; r < row_end; ++r) {
        const float *gate = x + r * 2 * n, *up = gate + n;
        float *dst = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) dst[i] = silu(gate[i]) * up[i];
    }
    return 0;
}

int silu_mul_bf16(const uint16_t *x, uint16_t *out, int64_t n, int64_t row_begin, int64_t row_end)
{
    for (int64_t r = row_begin; r < row_end; ++r) {
        const uint16_t *gate = x + r * 2 * n, *up = gate + n;
        uint16_t *dst = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) dst[i] = bf16_store(bf16_round(silu(bf16_load(gate[i]))) * bf16_load(up[i]));
    }
    return 0;
}
