/* A product of a few rows with a float32 weight as nn.Linear holds it ([out, in]): out = x @ w^T, each
 * weight row read once for all of x's rows. For the LM head of a drafted step's verifying rows on CPU: aten's
 * F.linear (MKL, on that layout) reads the weight once up to 4 rows and about twice from 5 (the shipped
 * primary's 4096 x 384 head: 104 us at 1 row, 207 at 5 on a 2-core Xeon).
 *
 * Each output element's sum is computed the same way whatever the row count and wherever the threads split
 * the weight's rows: a row's result is bit for bit the same alone or beside others (a drafted step's greedy
 * tokens then match plain decoding's).
 *
 * Built by engine/kernels/cpu.py with the other kernels; callers split the weight's rows [begin, end). */
#include <stdint.h>

#include "kernel_math.h"

#if defined(__AVX512F__)
/* out[r0 + r, j0 + j] for r < NR (<= 4), j < 4 where j0 + j < j_end: 16 sums in registers, one 16-value step
 * of the inputs at a time (the last one masked), each weight row's step loaded once for the NR x rows; the
 * sums reduced together by sum16x16 (lane r * 4 + j). Past j_end a weight row is read again, not stored. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, float *out,
                                                       int64_t n_in, int64_t n_out, int64_t r0, int64_t j0,
                                                       int64_t j_end, const int NR)
{
    const float *wj[4];
    for (int j = 0; j < 4; ++j) wj[j] = w + (j0 + j < j_end ? j0 + j : j_end - 1) * n_in;
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < n_in; k += 16) {
        const __mmask16 m = n_in - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n_in - k)) - 1);
        __m512 wv[4];
        for (int j = 0; j < 4; ++j) wv[j] = _mm512_maskz_loadu_ps(m, wj[j] + k);
        if (r0 == 0) /* the next tile's weight rows (contiguous after these), while these are summed */
            for (int j = 4; j < 8; ++j) _mm_prefetch((const char *)(wj[0] + j * n_in + k), _MM_HINT_T0);
        for (int r = 0; r < NR; ++r) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + (r0 + r) * n_in + k);
            for (int j = 0; j < 4; ++j) acc[r * 4 + j] = _mm512_fmadd_ps(xv, wv[j], acc[r * 4 + j]);
        }
    }
    float sums[16];
    _mm512_storeu_ps(sums, sum16x16(acc));
    for (int r = 0; r < NR; ++r)
        for (int j = 0; j < 4 && j0 + j < j_end; ++j) out[(r0 + r) * n_out + j0 + j] = sums[r * 4 + j];
}
#endif

/* x [rows, n_in], w [n_out, n_in], out [rows, n_out]: out[r, j] = x[r] . w[j] for j in [begin, end) */
int few_rows_f32(const float *x, const float *w, float *out, int64_t rows, int64_t n_in, int64_t n_out,
                 int64_t begin, int64_t end)
{
#if defined(__AVX512F__)
    for (int64_t j0 = begin; j0 < end; j0 += 4)
        for (int64_t r0 = 0; r0 < rows; r0 += 4)
            switch (rows - r0 < 4 ? rows - r0 : 4) { /* a constant count each: the sums stay in registers */
            case 1: tile(x, w, out, n_in, n_out, r0, j0, end, 1); break;
            case 2: tile(x, w, out, n_in, n_out, r0, j0, end, 2); break;
            case 3: tile(x, w, out, n_in, n_out, r0, j0, end, 3); break;
            default: tile(x, w, out, n_in, n_out, r0, j0, end, 4);
            }
#else
    for (int64_t j = begin; j < end; ++j)
        for (int64_t r = 0; r < rows; ++r) out[r * n_out + j] = dot(x + r * n_in, w + j * n_in, n_in);
#endif
    return 0;
}
