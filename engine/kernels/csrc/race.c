/* Sampling's exponential race on CPU: p[r][i] /= E(seed[r], i) in place, E = -ln U, U uniform in (0, 1)
 * from a hash of the draw's seed and the token id (splitmix64's finalizer over seed + i * 2^64 / phi);
 * the caller takes each row's argmax, a draw from p. Each token's noise depends on its seed and its id
 * only: a draw does not depend on the batch, the vocabulary's order of evaluation or the thread split,
 * and a p that moves in its last bits (another batch shape's rounding) keeps its token unless two
 * scores were within that much (an inverse CDF would flip at every boundary the sums moved across).
 *
 * Why: torch's exponential_ from a seeded generator drew each number in turn (mt19937): ~1 ms a row of
 * 49,152 tokens, 55 ms a 64-row sampled step on 2 cores. Built by engine/kernels/cpu.py with the other
 * kernels; callers split [row_begin, row_end). */
#include <stdint.h>

static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* ln x for a normal x > 0 (Cephes' logf: x = m 2^e, m in [sqrt(1/2), sqrt(2)), a degree-9 polynomial in
 * m - 1), within a few ulp; branch-free, so the loop below vectorizes. */
static inline float log_f32(float x)
{
    union { float f; int32_t i; } v = {.f = x};
    int32_t e = ((v.i >> 23) & 0xff) - 126;
    v.i = (v.i & 0x007fffff) | 0x3f000000; /* m in [0.5, 1) */
    float m = v.f;
    const int32_t small = m < 0.707106781186547524f;
    e -= small;
    m = small ? m + m - 1.0f : m - 1.0f;
    const float z = m * m;
    float y = 7.0376836292e-2f;
    y = y * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z;
    const float fe = (float)e;
    y += -2.12194440e-4f * fe;
    y += -0.5f * z;
    return m + y + 0.693359375f * fe;
}

int race_scores_f32(float *p, const int64_t *seeds, int64_t vocab, int64_t row_begin, int64_t row_end)
{
    for (int64_t r = row_begin; r < row_end; ++r) {
        const uint64_t seed = (uint64_t)seeds[r];
        float *row = p + r * vocab;
#pragma omp simd
        for (int64_t i = 0; i < vocab; ++i) {
            const uint64_t h = mix64(seed + (uint64_t)i * 0x9e3779b97f4a7c15ULL);
            const float u = ((float)(int32_t)(h >> 40) + 0.5f) * 0x1p-24f; /* in (0, 1), never 0 or 1 */
            row[i] = row[i] / -log_f32(u);
        }
    }
    return 0;
}
