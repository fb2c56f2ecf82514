/* Weight-only int8 linear layer on CPU: y = x @ (q * scale)^T.
 *
 * q is int8 [n, k], row-major as torch's Linear weight; scale is float32 [n, k / group_size] (one
 * scale per output row and group of group_size inputs; group_size = k is per-channel).
 *
 * int8_linear_f32 is for a few rows of x (decode): a step reads every weight once, so its cost is the
 * weight bytes, and int8 reads a quarter of what float32 reads. Each output row's int8 values are
 * widened to float in registers (no float copy of the weights is written) and each widened vector
 * feeds up to TILE rows of x. int8_dequantize_f32 writes float32 weights for many rows of x (prefill),
 * where a GEMM library's compute, not the weight bytes, sets the pace.
 *
 * Built by engine/kernels/cpu.py with the same flags as paged_attention.c; called through ctypes,
 * which releases the GIL, so callers split [row_begin, row_end) of the n output rows across threads. */
#include <stdint.h>

#define TILE 4 /* rows of x per pass over a weight row */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 8 int8 -> 8 float */
static inline __m256 widen8(const int8_t *w)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}
#endif

/* out[i] = sum_g scale[g] * sum_{j in group g} x[i * k + j] * w[j], for i < rows (rows <= TILE) */
static inline void dot_rows(const float *x, int64_t k, const int8_t *w, const float *scale, int64_t group_size,
                            int rows, float *out)
{
#if defined(__AVX2__) && defined(__FMA__)
    if (group_size % 16 == 0 && rows == 1) { /* decode of one sequence: every accumulator in a register */
        /* 8 independent sums over 64 weights: a multiply-add waits for its sum's last one (4 cycles), so
         * with 2 sums the chain, not the bytes, set the pace (per-channel weights at 30-35 GB/s here) */
        __m256 total = _mm256_setzero_ps();
        for (int64_t g = 0; g < k; g += group_size) {
            __m256 a[8];
            for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
            int64_t j = g;
            for (; j + 64 <= g + group_size; j += 64)
                for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 8 * i), widen8(w + j + 8 * i), a[i]);
            for (; j < g + group_size; j += 16) {
                a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), widen8(w + j), a[0]);
                a[1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 8), widen8(w + j + 8), a[1]);
            }
            const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])),
                                             _mm256_add_ps(_mm256_add_ps(a[4], a[5]), _mm256_add_ps(a[6], a[7])));
            total = _mm256_fmadd_ps(sum, _mm256_set1_ps(scale[g / group_size]), total);
        }
        out[0] = hsum(total);
        return;
    }
    if (group_size % 16 == 0) {
        __m256 total[TILE];
        for (int i = 0; i < TILE; ++i) total[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < k; g += group_size) {
            __m256 acc[TILE][2];
            for (int i = 0; i < TILE; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
            for (int64_t j = g; j < g + group_size; j += 16) {
                const __m256 w0 = widen8(w + j), w1 = widen8(w + j + 8);
                for (int i = 0; i < rows; ++i) {
                    acc[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * k + j), w0, acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * k + j + 8), w1, acc[i][1]);
                }
            }
            const __m256 s = _mm256_set1_ps(scale[g / group_size]);
            for (int i = 0; i < rows; ++i) total[i] = _mm256_fmadd_ps(_mm256_add_ps(acc[i][0], acc[i][1]), s, total[i]);
        }
        for (int i = 0; i < rows; ++i) out[i] = hsum(total[i]);
        return;
    }
#endif
    /* portable (and groups of other sizes): the compiler vectorizes what it can */
    for (int i = 0; i < rows; ++i) {
        float sum = 0.0f;
        for (int64_t g = 0; g < k; g += group_size) {
            float part = 0.0f;
            for (int64_t j = g; j < g + group_size; ++j) part += x[i * k + j] * (float)w[j];
            sum += scale[g / group_size] * part;
        }
        out[i] = sum;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#define WROWS 8 /* weight rows per pass over one row of x, when it is longer than X_IN_L1_BYTES */
/* Below, one weight row at a time streams faster (a single sequential read for the prefetcher: 4 rows at
 * once ran [17920, 1536] at 28 GB/s against 41); above, x no longer stays in L1 between weight rows */
#define X_IN_L1_BYTES (16 << 10)

/* out[i] = dot_rows's out[0] for weight row i of WROWS (w, w + k, ...; scales `groups` apart): one row of x
 * (decode of one sequence) read once for WROWS weight rows, not once for each: a row of x longer than L1
 * (down_proj's 8960 floats) was reloaded from L2 for every weight row, 4 bytes of x per byte of weight
 * ([1536, 8960] 710-780 -> 444-452 us; 4 rows: 523-541) */
static inline void dot_wrows(const float *x, int64_t k, const int8_t *w, const float *scale, int64_t groups,
                             int64_t group_size, float *out)
{
    __m256 total[WROWS];
    for (int i = 0; i < WROWS; ++i) total[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < k; g += group_size) {
        __m256 acc[WROWS]; /* one sum per weight row: WROWS independent chains (see dot_rows) */
        for (int i = 0; i < WROWS; ++i) acc[i] = _mm256_setzero_ps();
        for (int64_t j = g; j < g + group_size; j += 16) {
            const __m256 x0 = _mm256_loadu_ps(x + j), x1 = _mm256_loadu_ps(x + j + 8);
            for (int i = 0; i < WROWS; ++i) {
                acc[i] = _mm256_fmadd_ps(x0, widen8(w + i * k + j), acc[i]);
                acc[i] = _mm256_fmadd_ps(x1, widen8(w + i * k + j + 8), acc[i]);
            }
        }
        for (int i = 0; i < WROWS; ++i)
            total[i] = _mm256_fmadd_ps(acc[i], _mm256_set1_ps(scale[i * groups + g / group_size]), total[i]);
    }
    for (int i = 0; i < WROWS; ++i) out[i] = hsum(total[i]);
}
#endif

/* y [m, n] = x [m, k] @ (q [n, k] * scale [n, k / group_size])^T, output rows [row_begin, row_end) */
int int8_linear_f32(const float *x, const int8_t *q, const float *scale, float *y,
                    int64_t m, int64_t n, int64_t k, int64_t group_size, int64_t row_begin, int64_t row_end)
{
    if (group_size <= 0 || k % group_size != 0) return -1;
    const int64_t groups = k / group_size;
    int64_t r = row_begin;
#if defined(__AVX2__) && defined(__FMA__)
    if (m == 1 && group_size % 16 == 0 && k * (int64_t)sizeof(float) > X_IN_L1_BYTES)
        for (; r + WROWS <= row_end; r += WROWS) dot_wrows(x, k, q + r * k, scale + r * groups, groups, group_size, y + r);
#endif
    for (; r < row_end; ++r)
        for (int64_t t = 0; t < m; t += TILE) {
            float out[TILE];
            const int rows = m - t < TILE ? (int)(m - t) : TILE;
            dot_rows(x + t * k, k, q + r * k, scale + r * groups, group_size, rows, out);
            for (int i = 0; i < rows; ++i) y[(t + i) * n + r] = out[i];
        }
    return 0;
}

/* w [n, k] float32 = q * scale, rows [row_begin, row_end) */
int int8_dequantize_f32(const int8_t *q, const float *scale, float *w, int64_t n, int64_t k, int64_t group_size,
                        int64_t row_begin, int64_t row_end)
{
    (void)n;
    if (group_size <= 0 || k % group_size != 0) return -1;
    const int64_t groups = k / group_size;
    for (int64_t r = row_begin; r < row_end; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            const float s = scale[r * groups + g];
            const int8_t *src = q + r * k + g * group_size;
            float *dst = w + r * k + g * group_size;
            int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
            for (; i + 8 <= group_size; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_set1_ps(s), widen8(src + i)));
#endif
            for (; i < group_size; ++i) dst[i] = s * (float)src[i];
        }
    return 0;
}
