/* LoRA adapters' deltas on CPU for a step's adapter rows, float32 or bfloat16, in one call per projection:
 * for each adapter row i, out[rows[i]] += (x[rows[i]] @ A[slots[i]]) @ B[slots[i]], where A [slots, in,
 * rank] and B [slots, rank, n] are every resident adapter's stacked A^T and B^T (the scale folded into B;
 * engine/executor/lora.py). Each row reads its own adapter's matrices: no padding to the widest adapter
 * and no gather or scatter of rows around two batched products.
 *
 * Rounded where torch's path rounds: in bfloat16 the rank-sized product is rounded to bfloat16, then the
 * delta, then the sum (torch.bmm twice, then add_); float32 sums in another order (a few ulp).
 *
 * Why: torch's path is five ops a projection (index_select, bmm, bmm, index_select, add_), each a parallel
 * region that wakes OpenMP's sleeping thread on a 2-core VM: ~375 us a projection for 8 rank-16 adapters x
 * 32 decode rows of the shipped primary, the whole of the adapters' cost (0.60x the base's tok/s). Built by
 * engine/kernels/cpu.py with the other kernels; callers split [begin, end) of the adapter rows. */
#include <stdint.h>

#include "kernel_math.h"

#define MAX_RANK 256
#define TILE 512 /* delta columns summed at a time */

int lora_rows_f32(const float *x, float *out, const int64_t *rows, const int64_t *slots, const float *a,
                  const float *b, int64_t in, int64_t rank, int64_t n, int64_t begin, int64_t end)
{
    if (rank > MAX_RANK) return -1;
    float t[MAX_RANK], d[TILE];
    for (int64_t i = begin; i < end; ++i) {
        const float *xr = x + rows[i] * in, *A = a + slots[i] * in * rank, *B = b + slots[i] * rank * n;
        for (int64_t r = 0; r < rank; ++r) t[r] = 0.0f;
        for (int64_t k = 0; k < in; ++k) {
            const float xv = xr[k];
            const float *ak = A + k * rank;
#pragma omp simd
            for (int64_t r = 0; r < rank; ++r) t[r] += xv * ak[r];
        }
        float *o = out + rows[i] * n;
        for (int64_t j0 = 0; j0 < n; j0 += TILE) {
            const int64_t width = n - j0 < TILE ? n - j0 : TILE;
            for (int64_t j = 0; j < width; ++j) d[j] = 0.0f;
            for (int64_t r = 0; r < rank; ++r) {
                const float tr = t[r];
                const float *br = B + r * n + j0;
#pragma omp simd
                for (int64_t j = 0; j < width; ++j) d[j] += tr * br[j];
            }
#pragma omp simd
            for (int64_t j = 0; j < width; ++j) o[j0 + j] += d[j];
        }
    }
    return 0;
}

int lora_rows_bf16(const uint16_t *x, uint16_t *out, const int64_t *rows, const int64_t *slots, const uint16_t *a,
                   const uint16_t *b, int64_t in, int64_t rank, int64_t n, int64_t begin, int64_t end)
{
    if (rank > MAX_RANK) return -1;
    float t[MAX_RANK], d[TILE];
    for (int64_t i = begin; i < end; ++i) {
        const uint16_t *xr = x + rows[i] * in, *A = a + slots[i] * in * rank, *B = b + slots[i] * rank * n;
        for (int64_t r = 0; r < rank; ++r) t[r] = 0.0f;
        for (int64_t k = 0; k < in; ++k) {
            const float xv = bf16_load(xr[k]);
            const uint16_t *ak = A + k * rank;
#pragma omp simd
            for (int64_t r = 0; r < rank; ++r) t[r] += xv * bf16_load(ak[r]);
        }
        for (int64_t r = 0; r < rank; ++r) t[r] = bf16_round(t[r]);
        uint16_t *o = out + rows[i] * n;
        for (int64_t j0 = 0; j0 < n; j0 += TILE) {
            const int64_t width = n - j0 < TILE ? n - j0 : TILE;
            for (int64_t j = 0; j < width; ++j) d[j] = 0.0f;
            for (int64_t r = 0; r < rank; ++r) {
                const float tr = t[r];
                const uint16_t *br = B + r * n + j0;
#pragma omp simd
                for (int64_t j = 0; j < width; ++j) d[j] += tr * bf16_load(br[j]);
            }
#pragma omp simd
            for (int64_t j = 0; j < width; ++j) o[j0 + j] = bf16_store(bf16_load(o[j0 + j]) + bf16_round(d[j]));
        }
    }
    return 0;
}
