/* Rotary position embedding on CPU, in place, float32 or bfloat16: for each token t and each of its
 * first `rotated` heads (q's and k's, side by side in the q/k/v projection's output), halves x1, x2 of
 * the head become x1 * cos - x2 * sin and x2 * cos + x1 * sin, cos and sin [T, head_dim / 2] per token.
 * Every product, difference and sum is rounded as torch rounds it in that dtype (bfloat16: each op's
 * float32 result rounded to bfloat16; float32: no fused multiply-add, -std=c11 keeps them apart), so
 * the result is the one the seven aten ops of engine/executor/models/llama.py's apply_rope give, bit for bit.
 *
 * Why: those seven ops are seven parallel regions once a prefill chunk passes torch's grain size, each
 * waking OpenMP's sleeping thread on a 2-core VM: [256 tokens, 12 heads, 64] took ~400 us.
 *
 * Built by engine/kernels/cpu.py with the other kernels; callers split [token_begin, token_end). */
#include <stdint.h>

#include "kernel_math.h"

/* x [T, heads, head_dim]; the first `rotated` heads of every token */
int rope_f32(float *x, const float *cos, const float *sin, int64_t heads, int64_t rotated, int64_t head_dim,
             int64_t token_begin, int64_t token_end)
{
    const int64_t half = head_dim / 2;
    for (int64_t t = token_begin; t < token_end; ++t) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < rotated; ++h) {
            float *x1 = x + (t * heads + h) * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                const float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
                x1[i] = ac - bs;
                x2[i] = bc + as;
            }
        }
    }
    return 0;
}

int rope_bf16(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t heads, int64_t rotated,
              int64_t head_dim, int64_t token_begin, int64_t token_end)
{
    const int64_t half = head_dim / 2;
    for (int64_t t = token_begin; t < token_end; ++t) {
        const uint16_t *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < rotated; ++h) {
            uint16_t *x1 = x + (t * heads + h) * head_dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; ++i) {
                const float a = bf16_load(x1[i]), b = bf16_load(x2[i]), ci = bf16_load(c[i]), si = bf16_load(s[i]);
                x1[i] = bf16_store(bf16_round(a * ci) - bf16_round(b * si));
                x2[i] = bf16_store(bf16_round(b * ci) + bf16_round(a * si));
            }
        }
    }
    return 0;
}
