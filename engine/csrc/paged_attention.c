/* Paged decode attention on CPU, K/V in float32 or bfloat16: one query token per sequence, K/V read in
 * place from the head-major block pool ([num_kv_heads, num_slots, head_dim] per layer,
 * engine/attention.py). bfloat16 values are widened to float32 in registers (a bfloat16 is the top half
 * of a float32) and every sum is in float32: the portable path, which the compiler vectorizes.
 *
 * The pure-torch path first gathers every sequence's blocks into a padded copy and then runs SDPA
 * over it; on a memory-bound CPU that copy costs more than the attention. Here each (sequence, KV
 * head) work item walks its block table once for the scores and once for the values, reading each
 * block's block_size x head_dim values contiguously, with an exact two-pass softmax.
 *
 * Built by engine/cpu_kernel.py with the system C compiler; no torch headers, called through ctypes
 * (which releases the GIL, so callers split [work_begin, work_end) across threads). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* 8 partial sums: the compiler turns the inner loop into one vector multiply-add per 8 values */
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

static inline float bf16_to_f32(uint16_t v)
{
    union { uint32_t u; float f; } x = {.u = (uint32_t)v << 16};
    return x.f;
}

static inline float dot_bf16(const float *restrict a, const uint16_t *restrict b, int64_t n)
{
    float part[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) part[j] += a[i + j] * bf16_to_f32(b[i + j]);
    float tail = 0.0f;
    for (; i < n; ++i) tail += a[i] * bf16_to_f32(b[i]);
    return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7])) + tail;
}

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

static inline void add_scaled(float *restrict acc, float p, const float *restrict v, int64_t n)
{
    for (int64_t i = 0; i < n; ++i) acc[i] += p * v[i];
}

static inline void add_scaled_bf16(float *restrict acc, float p, const uint16_t *restrict v, int64_t n)
{
    for (int64_t i = 0; i < n; ++i) acc[i] += p * bf16_to_f32(v[i]);
}

/* kv_bf16: the caches hold bfloat16 (uint16) values, else float32; a constant at each call below, so
 * the compiler builds one copy of this function per element type */
static inline int paged_decode(const float *q,             /* [num_seqs, num_heads, head_dim] */
                               const void *k_cache,        /* [num_kv_heads, num_slots, head_dim] */
                               const void *v_cache,        /* same */
                               const int64_t *block_tables, /* [num_seqs, max_blocks] */
                               const int64_t *context_lens, /* [num_seqs], each >= 1 */
                               float *out,                 /* [num_seqs, num_heads, head_dim] */
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                               int64_t block_size, int64_t max_blocks, float scale,
                               int64_t work_begin, int64_t work_end, /* work item = seq * num_kv_heads + kv_head */
                               const int kv_bf16)
{
    const int64_t groups = num_heads / num_kv_heads; /* query heads per KV head */
    const int64_t row_bytes = head_dim * (kv_bf16 ? 2 : 4);
    int64_t max_len = 0;
    for (int64_t w = work_begin; w < work_end; ++w) {
        const int64_t len = context_lens[w / num_kv_heads];
        if (len > max_len) max_len = len;
    }
    /* scratch: scores [groups, max_len], running max and 1/sum [groups], accumulators [groups, head_dim] */
    float *scratch = malloc(sizeof(float) * (size_t)(groups * (max_len + 2 + head_dim)));
    if (scratch == NULL) return -1;
    float *scores = scratch, *mx = scores + groups * max_len, *inv = mx + groups, *acc = inv + groups;

    for (int64_t w = work_begin; w < work_end; ++w) {
        const int64_t seq = w / num_kv_heads, kv_head = w % num_kv_heads, len = context_lens[seq];
        const int64_t *table = block_tables + seq * max_blocks;
        const float *qh = q + (seq * num_heads + kv_head * groups) * head_dim;
        const char *kh = (const char *)k_cache + kv_head * num_slots * row_bytes;
        const char *vh = (const char *)v_cache + kv_head * num_slots * row_bytes;

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
        for (int64_t g = 0; g < groups; ++g) {
            float *o = out + (seq * num_heads + kv_head * groups + g) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[g * head_dim + d] * inv[g];
        }
    }
    free(scratch);
    return 0;
}

#define DECODE_ARGS const float *q, const void *k_cache, const void *v_cache, const int64_t *block_tables, \
    const int64_t *context_lens, float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, \
    int64_t num_slots, int64_t block_size, int64_t max_blocks, float scale, int64_t work_begin, int64_t work_end
#define DECODE_CALL(bf16) paged_decode(q, k_cache, v_cache, block_tables, context_lens, out, num_heads, num_kv_heads, \
    head_dim, num_slots, block_size, max_blocks, scale, work_begin, work_end, bf16)

int paged_decode_f32(DECODE_ARGS) { return DECODE_CALL(0); }
int paged_decode_bf16(DECODE_ARGS) { return DECODE_CALL(1); }
