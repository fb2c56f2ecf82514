/* Paged decode attention on CPU, K/V in float32 or bfloat16: one query token per sequence, or a few at
 * consecutive positions (a drafted step's verifying rows: `row_starts` below), K/V read in place from the
 * head-major block pool ([num_kv_heads, num_slots, head_dim] per layer,
 * engine/executor/attention/torch_backend.py). bfloat16 values are widened to float32 in registers (a bfloat16 is the top half
 * of a float32) and every sum is in float32: the portable path, which the compiler vectorizes.
 * Where the compiler targets AVX-512 (-march=native on such a CPU) and head_dim is a multiple of 32,
 * paged_decode_avx512 (below) runs instead: the same two passes, 16 keys at a time.
 *
 * The pure-torch path first gathers every sequence's blocks into a padded copy and then runs SDPA
 * over it; on a memory-bound CPU that copy costs more than the attention. Here each (sequence, KV
 * head) work item walks its block table once for the scores and once for the values, reading each
 * block's block_size x head_dim values contiguously, with an exact two-pass softmax.
 *
 * q is read and the output written in the caches' dtype, q's rows in place in the q/k/v projection's output
 * (q_stride values apart), so a layer's step needs no conversions or copies around the call; kv_write
 * puts the step's new K/V rows into the pool in one call, where index_copy_ took two.
 *
 * Built by engine/kernels/cpu.py with the system C compiler; no torch headers, called through ctypes
 * (which releases the GIL, so callers split [work_begin, work_end) across threads). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"

/* ask for the next block while this one is read: blocks are scattered, so the hardware prefetcher,
 * which follows streams within a page, would otherwise start each one cold */
static inline void prefetch_row(const char *row, int64_t bytes)
{
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(row + i, 0, 3);
}

/* the rows of the block holding position pos (n of them: fewer in the last block), rows of row_bytes;
 * *next is the following block, NULL in the last one */
static inline const char *block_rows(const char *head, const int64_t *table, int64_t pos, int64_t len,
                                     int64_t block_size, int64_t row_bytes, const char **next, int64_t *n)
{
    const int64_t blk = pos / block_size, stride = block_size * row_bytes;
    *next = pos + block_size < len ? head + table[blk + 1] * stride : NULL;
    *n = len - pos < block_size ? len - pos : block_size;
    return head + table[blk] * stride;
}

/* A sequence's query rows: one (row_starts NULL: row seq), or rows row_starts[seq] .. row_starts[seq + 1] - 1
 * at consecutive positions, the last at context_lens[seq] - 1, each seeing the context up to itself; their
 * K/V blocks are read once for all of them. Sets *first and *rows; -4 where the rows are not within q's
 * num_rows or outnumber the context. */
static inline int seq_rows(const int64_t *row_starts, int64_t num_rows, const int64_t *context_lens,
                           int64_t seq, int64_t *first, int64_t *rows)
{
    *first = row_starts ? row_starts[seq] : seq;
    *rows = row_starts ? row_starts[seq + 1] - *first : 1;
    return *first < 0 || *rows < 1 || *rows > context_lens[seq] || *first + *rows > num_rows ? -4 : 0;
}

/* the longest context and the most query rows of a sequence among work items [work_begin, work_end) (work
 * item = seq * num_kv_heads + kv_head); -4 as seq_rows */
static inline int work_sizes(const int64_t *context_lens, const int64_t *row_starts, int64_t num_rows,
                             int64_t num_kv_heads, int64_t work_begin, int64_t work_end, int64_t *max_len,
                             int64_t *max_rows)
{
    *max_len = 0;
    *max_rows = 1;
    for (int64_t w = work_begin; w < work_end; ++w) {
        int64_t first, rows;
        if (seq_rows(row_starts, num_rows, context_lens, w / num_kv_heads, &first, &rows)) return -4;
        const int64_t len = context_lens[w / num_kv_heads];
        if (len > *max_len) *max_len = len;
        if (rows > *max_rows) *max_rows = rows;
    }
    return 0;
}

/* what one work item (a sequence and one KV head) reads: its longest context length, block table, the head's
 * K and V pools; its group's query rows (the work item's first head: `head`) and output rows are at
 * (first + r) * q_stride + head * head_dim and ((first + r) * num_heads + head) * head_dim, r < rows; row r
 * sees len - (rows - 1 - r) positions */
struct work_item {
    int64_t first, rows, head, len;
    const int64_t *table;
    const char *kh, *vh;
};

static inline struct work_item work_item(int64_t w, const void *k_cache, const void *v_cache,
                                         const int64_t *block_tables, const int64_t *context_lens,
                                         const int64_t *row_starts, int64_t num_heads, int64_t num_kv_heads,
                                         int64_t num_slots, int64_t max_blocks, int64_t row_bytes)
{
    const int64_t seq = w / num_kv_heads, kv_head = w % num_kv_heads, groups = num_heads / num_kv_heads;
    int64_t first, rows;
    seq_rows(row_starts, INT64_MAX, context_lens, seq, &first, &rows); /* checked by work_sizes */
    return (struct work_item){first, rows, kv_head * groups, context_lens[seq],
                              block_tables + seq * max_blocks,
                              (const char *)k_cache + kv_head * num_slots * row_bytes,
                              (const char *)v_cache + kv_head * num_slots * row_bytes};
}

/* n values at src (float32, or bfloat16 where bf16) as float32 at dst, and back */
static inline void widen(float *restrict dst, const void *restrict src, int64_t n, const int bf16)
{
    if (bf16)
        for (int64_t i = 0; i < n; ++i) dst[i] = bf16_load(((const uint16_t *)src)[i]);
    else
        memcpy(dst, src, sizeof(float) * (size_t)n);
}

static inline void narrow(void *restrict dst, const float *restrict src, int64_t n, const int bf16)
{
    if (bf16)
        for (int64_t i = 0; i < n; ++i) ((uint16_t *)dst)[i] = bf16_store(src[i]);
    else
        memcpy(dst, src, sizeof(float) * (size_t)n);
}

/* a work item's query heads, [rows * groups, head_dim] float32 (row by row), from q (rows q_stride values
 * apart) */
static inline void group_queries(float *restrict dst, const void *q, int64_t q_stride,
                                 const struct work_item *it, int64_t groups, int64_t head_dim, const int bf16)
{
    for (int64_t r = 0; r < it->rows; ++r) {
        const int64_t at = (it->first + r) * q_stride + it->head * head_dim;
        widen(dst + r * groups * head_dim, (const char *)q + at * (bf16 ? 2 : 4), groups * head_dim, bf16);
    }
}

/* out[first + r, head .. head + groups) = src [rows * groups, head_dim]'s row r, in the caches' dtype */
static inline void group_output(void *out, const float *src, const struct work_item *it, int64_t num_heads,
                                int64_t groups, int64_t head_dim, const int bf16)
{
    for (int64_t r = 0; r < it->rows; ++r) {
        const int64_t at = ((it->first + r) * num_heads + it->head) * head_dim;
        narrow((char *)out + at * (bf16 ? 2 : 4), src + r * groups * head_dim, groups * head_dim, bf16);
    }
}

/* The step's new K and V rows into the pool: row t of k_new and v_new ([n, num_kv_heads, head_dim], rows
 * k_stride / v_stride values apart, a head's values contiguous) goes to slot slots[t] of every head's pool
 * ([num_kv_heads, num_slots, head_dim] each), elem_bytes a value. -1 (nothing written) where a slot is out of
 * range. */
int kv_write(const void *k_new, const void *v_new, int64_t k_stride, int64_t v_stride,
             const int64_t *slots, int64_t n, void *k_cache, void *v_cache, int64_t num_kv_heads,
             int64_t head_dim, int64_t num_slots, int64_t elem_bytes)
{
    for (int64_t t = 0; t < n; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    const int64_t row = head_dim * elem_bytes;
    for (int64_t t = 0; t < n; ++t)
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const int64_t to = (h * num_slots + slots[t]) * row;
            const char *k = (const char *)k_new + t * k_stride * elem_bytes + h * row;
            const char *v = (const char *)v_new + t * v_stride * elem_bytes + h * row;
            memcpy((char *)k_cache + to, k, (size_t)row);
            memcpy((char *)v_cache + to, v, (size_t)row);
        }
    return 0;
}

static inline void add_scaled(float *restrict acc, float p, const float *restrict v, int64_t n)
{
    for (int64_t i = 0; i < n; ++i) acc[i] += p * v[i];
}

static inline void add_scaled_bf16(float *restrict acc, float p, const uint16_t *restrict v, int64_t n)
{
    for (int64_t i = 0; i < n; ++i) acc[i] += p * bf16_load(v[i]);
}

/* kv_bf16: the caches hold bfloat16 (uint16) values, else float32; a constant at each call below, so
 * the compiler builds one copy of this function per element type */
static inline int paged_decode(const void *q,               /* [num_rows, num_heads, head_dim] */
                               int64_t q_stride,            /* values from one row of q to the next */
                               const void *k_cache,        /* [num_kv_heads, num_slots, head_dim] */
                               const void *v_cache,        /* same */
                               const int64_t *block_tables, /* [num_seqs, max_blocks] */
                               const int64_t *context_lens, /* [num_seqs], each >= 1 */
                               const int64_t *row_starts,   /* [num_seqs + 1] (seq_rows), or NULL */
                               int64_t num_rows,
                               void *out,                  /* [num_rows, num_heads, head_dim] */
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                               int64_t block_size, int64_t max_blocks, float scale,
                               int64_t work_begin, int64_t work_end, /* work item = seq * num_kv_heads + kv_head */
                               const int kv_bf16)
{
    const int64_t groups = num_heads / num_kv_heads; /* query heads per KV head */
    const int64_t row_bytes = head_dim * (kv_bf16 ? 2 : 4);
    int64_t max_len, max_rows;
    if (work_sizes(context_lens, row_starts, num_rows, num_kv_heads, work_begin, work_end, &max_len,
                   &max_rows))
        return -4;
    /* scratch: scores [groups, max_len], running max and 1/sum [groups], accumulators [groups, head_dim] and
     * queries [max_rows * groups, head_dim] */
    float *scratch = malloc(sizeof(float) * (size_t)(groups * (max_len + 2 + (1 + max_rows) * head_dim)));
    if (scratch == NULL) return -1;
    float *scores = scratch, *mx = scores + groups * max_len, *inv = mx + groups, *acc = inv + groups;
    float *queries = acc + groups * head_dim;

    for (int64_t w = work_begin; w < work_end; ++w) {
        const struct work_item item = work_item(w, k_cache, v_cache, block_tables, context_lens, row_starts,
                                                num_heads, num_kv_heads, num_slots, max_blocks, row_bytes);
        group_queries(queries, q, q_stride, &item, groups, head_dim, kv_bf16);
        /* row by row, each over its own context (this path reads the blocks once a row) */
        for (int64_t r = 0; r < item.rows; ++r) {
            struct work_item it = item;
            it.first += r;
            it.rows = 1;
            it.len -= item.rows - 1 - r;
            const int64_t len = it.len, *table = it.table;
            const char *kh = it.kh, *vh = it.vh;
            const float *qh = queries + r * groups * head_dim;

            for (int64_t g = 0; g < groups; ++g) mx[g] = -INFINITY;
            for (int64_t pos = 0; pos < len; pos += block_size) {
                const char *next;
                int64_t n;
                const char *kb = block_rows(kh, table, pos, len, block_size, row_bytes, &next, &n);
                for (int64_t i = 0; i < n; ++i) {
                    const char *kp = kb + i * row_bytes;
                    if (next) prefetch_row(next + i * row_bytes, row_bytes);
                    for (int64_t g = 0; g < groups; ++g) {
                        const float *qg = qh + g * head_dim;
                        const float s = (kv_bf16 ? dot_bf16(qg, (const uint16_t *)kp, head_dim)
                                                 : dot(qg, (const float *)kp, head_dim)) * scale;
                        scores[g * len + pos + i] = s;
                        if (s > mx[g]) mx[g] = s;
                    }
                }
            }
            for (int64_t g = 0; g < groups; ++g) {
                float *sg = scores + g * len, sum = 0.0f;
                for (int64_t j = 0; j < len; ++j) {
                    sg[j] = expf(sg[j] - mx[g]);
                    sum += sg[j];
                }
                inv[g] = 1.0f / sum;
            }
            for (int64_t j = 0; j < groups * head_dim; ++j) acc[j] = 0.0f;
            for (int64_t pos = 0; pos < len; pos += block_size) {
                const char *next;
                int64_t n;
                const char *vb = block_rows(vh, table, pos, len, block_size, row_bytes, &next, &n);
                for (int64_t i = 0; i < n; ++i) {
                    const char *vp = vb + i * row_bytes;
                    if (next) prefetch_row(next + i * row_bytes, row_bytes);
                    for (int64_t g = 0; g < groups; ++g) {
                        const float p = scores[g * len + pos + i];
                        if (kv_bf16)
                            add_scaled_bf16(acc + g * head_dim, p, (const uint16_t *)vp, head_dim);
                        else
                            add_scaled(acc + g * head_dim, p, (const float *)vp, head_dim);
                    }
                }
            }
            for (int64_t g = 0; g < groups; ++g)
                for (int64_t d = 0; d < head_dim; ++d) acc[g * head_dim + d] *= inv[g];
            group_output(out, acc, &it, num_heads, groups, head_dim, kv_bf16);
        }
    }
    free(scratch);
    return 0;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512 1

/* 16 values at p (float32, or bfloat16 widened) */
static inline __m512 load16(const void *p, const int kv_bf16)
{
    if (!kv_bf16) return _mm512_loadu_ps(p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16));
}

/* e^x for x <= 0 (scores minus their max), to about 1 ulp: Cephes' expf polynomial on x - n ln2, then
 * scaled by 2^n (scalef); x is clamped at -88, so -inf gives e^-88 (about 6e-39), not 0 */
static inline __m512 exp512(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* out[g, :dims] (g < GT, rows head_dim apart; dims 16, 32, 48 or 64) = inv[g] * the sum over the context of
 * p[g, pos] * V[pos, :dims]: each value row (its dims dimensions at vh) loaded once for the GT query heads,
 * GT x 4 sums in registers */
static inline __attribute__((always_inline)) void values_tile(
    const float *p, int64_t stride, const char *vh, const int64_t *table, int64_t len, int64_t block_size,
    int64_t row_bytes, const int kv_bf16, const float *inv, float *out, int64_t head_dim, int64_t dims,
    const int GT)
{
    const int64_t elem = kv_bf16 ? 2 : 4;
    const int nv = (int)(dims / 16);
    __m512 acc[4][4];
    for (int g = 0; g < GT; ++g)
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t pos = 0; pos < len; pos += block_size) {
        const char *next;
        int64_t n;
        const char *vb = block_rows(vh, table, pos, len, block_size, row_bytes, &next, &n);
        if (next) prefetch_row(next, n * row_bytes);
        for (int64_t i = 0; i < n; ++i) {
            const char *vp = vb + i * row_bytes;
            __m512 v[4];
            for (int c = 0; c < 4; ++c)
                v[c] = c < nv ? load16(vp + c * 16 * elem, kv_bf16) : _mm512_setzero_ps();
            for (int g = 0; g < GT; ++g) {
                const __m512 w = _mm512_set1_ps(p[g * stride + pos + i]);
                for (int c = 0; c < 4; ++c)
                    if (c < nv) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
            }
        }
    }
    for (int g = 0; g < GT; ++g)
        for (int c = 0; c < nv; ++c)
            _mm512_storeu_ps(out + g * head_dim + c * 16, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
}

/* paged_decode for head_dim % 32 == 0 on AVX-512: scores 16 keys at a time (their dot products summed
 * by sum16x16; in bf16 on vdpbf16ps where the CPU has AVX512-BF16, q rounded to bf16 once per work
 * item, which is exact when the engine runs in bf16), softmax with a vector exp, values accumulated in
 * registers 64 dimensions and up to 4 query heads at a time (values_tile: a value row is read once for all
 * of its group's heads; reading it once per head cost a 28-sequence, 500-token step of the SmolLM-135M
 * shape 0.73 ms a layer on two threads, against 0.63). A sequence's rows at consecutive positions
 * (seq_rows) are its group's heads, row by row: each key and value row read once for all of them, a row's
 * scores past its own position never summed and its weights there exactly 0 in pass 2, so each row's result
 * is bit for bit the one it gets alone. */
static int paged_decode_avx512(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                               const int64_t *block_tables, const int64_t *context_lens,
                               const int64_t *row_starts, int64_t num_rows, void *out,
                               int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t num_slots, int64_t block_size, int64_t max_blocks,
                               float scale, int64_t work_begin, int64_t work_end, const int kv_bf16)
{
    const int64_t groups = num_heads / num_kv_heads, elem = kv_bf16 ? 2 : 4, row_bytes = head_dim * elem;
    int64_t max_len, max_rows;
    if (work_sizes(context_lens, row_starts, num_rows, num_kv_heads, work_begin, work_end, &max_len,
                   &max_rows))
        return -4;
    /* scratch, for max_rows * groups query heads: scores [heads, max_len rounded up to 16], 1/sum [heads],
     * the queries and the output [heads, head_dim] each, q as bf16 [heads, head_dim] (half a float each) */
    const int64_t stride = (max_len + 15) / 16 * 16, max_heads = max_rows * groups;
    float *scores = malloc(sizeof(float) * (size_t)(max_heads * (stride + 1 + 2 * head_dim + head_dim / 2)));
    if (scores == NULL) return -1;
    float *inv = scores + max_heads * stride, *qh = inv + max_heads, *o = qh + max_heads * head_dim;
    uint16_t *q16 = (uint16_t *)(o + max_heads * head_dim);
#if defined(__AVX512BF16__)
    const int use_dp = kv_bf16;
#else
    const int use_dp = 0;
#endif
    for (int64_t w = work_begin; w < work_end; ++w) {
        const struct work_item it = work_item(w, k_cache, v_cache, block_tables, context_lens, row_starts,
                                              num_heads, num_kv_heads, num_slots, max_blocks, row_bytes);
        const int64_t len = it.len, *table = it.table, heads = it.rows * groups;
        const char *kh = it.kh, *vh = it.vh;
        group_queries(qh, q, q_stride, &it, groups, head_dim, kv_bf16);
        if (use_dp)
            for (int64_t j = 0; j < heads * head_dim; j += 16)
                _mm256_storeu_si256((__m256i *)(q16 + j), _mm512_cvtepi32_epi16(_mm512_srli_epi32(
                    _mm512_castps_si512(_mm512_loadu_ps(qh + j)), 16))); /* exact: q was bf16 */
        /* pass 1: scores; keys in runs of up to 16 within a block */
        for (int64_t pos = 0; pos < len; pos += block_size) {
            const char *next;
            int64_t n;
            const char *kb = block_rows(kh, table, pos, len, block_size, row_bytes, &next, &n);
            if (next) prefetch_row(next, n * row_bytes);
            for (int64_t i0 = 0; i0 < n; i0 += 16) {
                const int m = n - i0 < 16 ? (int)(n - i0) : 16;
                for (int64_t g = 0; g < heads; ++g) {
                    __m512 acc[16];
                    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
                    for (int i = 0; i < m; ++i) {
                        const char *kp = kb + (i0 + i) * row_bytes;
#if defined(__AVX512BF16__)
                        if (use_dp) {
                            for (int64_t d = 0; d < head_dim; d += 32)
                                acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(q16 + g * head_dim + d),
                                                          (__m512bh)_mm512_loadu_si512(kp + d * 2));
                            continue;
                        }
#endif
                        for (int64_t d = 0; d < head_dim; d += 16)
                            acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + g * head_dim + d),
                                                     load16(kp + d * elem, kv_bf16), acc[i]);
                    }
                    _mm512_mask_storeu_ps(scores + g * stride + pos + i0, (__mmask16)((1u << m) - 1),
                                          _mm512_mul_ps(sum16x16(acc), _mm512_set1_ps(scale)));
                }
            }
        }
        for (int64_t g = 0; g < heads; ++g) {
            float *sg = scores + g * stride;
            const int64_t own = len - (it.rows - 1 - g / groups); /* the positions this head's row sees */
            /* the padding up to 16: e^-88 each after exp512, nothing beside the max's 1 (and pass 2 skips it) */
            for (int64_t j = own; j < (own + 15) / 16 * 16; ++j) sg[j] = -INFINITY;
            __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < own; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + j));
            const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            for (int64_t j = 0; j < own; j += 16) {
                const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + j), top));
                _mm512_storeu_ps(sg + j, e);
                sum = _mm512_add_ps(sum, e);
            }
            inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
            for (int64_t j = own; j < len; ++j) sg[j] = 0.0f; /* pass 2 runs to the last row's position */
        }
        /* pass 2: values, 64 dimensions at a time, each row read once for up to 4 query heads */
        for (int64_t d0 = 0; d0 < head_dim; d0 += 64)
            for (int64_t g0 = 0; g0 < heads; g0 += 4) {
                const int gt = heads - g0 < 4 ? (int)(heads - g0) : 4;
                const int64_t dims = head_dim - d0 < 64 ? head_dim - d0 : 64;
                const float *sg = scores + g0 * stride;
                float *og = o + g0 * head_dim + d0;
                const char *vh0 = vh + d0 * elem;
#define VALUES(GT) \
    values_tile(sg, stride, vh0, table, len, block_size, row_bytes, kv_bf16, inv + g0, og, head_dim, dims, GT)
                switch (gt) { /* a constant count each, so the accumulators stay in registers */
                case 1: VALUES(1); break;
                case 2: VALUES(2); break;
                case 3: VALUES(3); break;
                default: VALUES(4);
                }
#undef VALUES
            }
        group_output(out, o, &it, num_heads, groups, head_dim, kv_bf16);
    }
    free(scores);
    return 0;
}
#else
#define HAVE_AVX512 0
#endif

#define DECODE_ARGS const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, \
    const int64_t *block_tables, const int64_t *context_lens, const int64_t *row_starts, int64_t num_rows, \
    void *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, \
    int64_t block_size, int64_t max_blocks, float scale, int64_t work_begin, int64_t work_end
#define DECODE_PARAMS q, q_stride, k_cache, v_cache, block_tables, context_lens, row_starts, num_rows, out, \
    num_heads, num_kv_heads, head_dim, num_slots, block_size, max_blocks, scale, work_begin, work_end
#define DECODE_CALL(bf16) paged_decode(DECODE_PARAMS, bf16)

#if HAVE_AVX512
#define DECODE(bf16) (head_dim % 32 == 0 ? paged_decode_avx512(DECODE_PARAMS, bf16) : DECODE_CALL(bf16))
#else
#define DECODE(bf16) DECODE_CALL(bf16)
#endif

int paged_decode_f32(DECODE_ARGS) { return DECODE(0); }
int paged_decode_bf16(DECODE_ARGS) { return DECODE(1); }

/* which paths this build has: 1 = the AVX-512 kernel, 2 = its scores on AVX512-BF16 (tests, logs) */
int paged_decode_features(void)
{
#if HAVE_AVX512 && defined(__AVX512BF16__)
    return 3;
#else
    return HAVE_AVX512;
#endif
}
