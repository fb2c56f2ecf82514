/* A whole decode step of a small Llama-family model in float32, in one call on the calling thread: the
 * greedy next token of each sampled row. Speculative decoding's draft model (engine/executor/draft_model.py)
 * runs steps of a row or a few, where a torch forward is all per-op overhead (the shipped 4-layer draft
 * model: 1.2 ms a one-row step, of which the products and kernels are ~0.3 ms); here the step is the
 * arithmetic and the reads of the weights.
 *
 * The model (checked by the caller, engine/kernels/cpu.py's DraftStepKernel): RMSNorm before attention
 * and MLP, q/k/v in one product (bias optional), RoPE over the whole head (HF's rotate-half), grouped-query
 * attention over the paged K/V pool (head-major [num_kv_heads, num_slots, head_dim] per layer, float32),
 * o_proj without bias, SiLU(gate) * up, down without bias, a final RMSNorm and the LM head. The products'
 * weights are read in bfloat16 (half the bytes of a step that reads every weight once: memory-bound),
 * everything else is float32. Every row reads
 * the K/V of its sequence's positions 0..its own through its block table; all rows' K/V are written
 * before any row attends, so rows of one sequence at consecutive positions (a context read a few tokens
 * at a time) see each other, as the torch forward's decode rows do. Sums are in float32 in another order
 * than torch's: a draft token may differ from the torch forward's where two logits nearly tie, which only
 * changes what is proposed, never what is kept. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernel_math.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { D_LAYERS, D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_VOCAB, D_BLOCK, D_MAX_BLOCKS, D_SLOTS,
       D_ROWS, D_NUM };
enum { W_IN_NORM, W_QKV, W_QKV_BIAS, W_O, W_POST_NORM, W_GATE_UP, W_DOWN, W_NUM };

static inline float dot(const float *restrict a, const float *restrict b, int64_t n)
{
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) part[j] += a[i + j] * b[i + j];
    float sum = 0.0f;
    for (; i < n; ++i) sum += a[i] * b[i];
    for (int j = 0; j < 16; ++j) sum += part[j];
    return sum;
}

static inline void put(float *y, float v, int accumulate) { *y = accumulate ? *y + v : v; }

#if defined(__AVX512F__)
static inline __m512 load_bf16(const uint16_t *p)
{
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* NR rows (1..4) x 4 outputs at a time: each weight vector loaded once for the rows, each x vector once for
 * the outputs, 4 * NR sums in registers, reduced once each (in a multiple of 16) */
static inline __attribute__((always_inline)) void linear_tile(const float *x, const uint16_t *w,
                                                               const float *bias, float *y, int64_t in,
                                                               int64_t out, int64_t o0, int accumulate,
                                                               const int NR)
{
    const int64_t last = out - 1;
    const uint16_t *wo[4];
    for (int o = 0; o < 4; ++o) /* a tail repeats the last output */
        wo[o] = w + (o0 + o < last ? o0 + o : last) * in;
    __m512 acc[4][4];
    for (int o = 0; o < 4; ++o)
        for (int r = 0; r < NR; ++r) acc[o][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) {
        __m512 xv[4];
        for (int r = 0; r < NR; ++r) xv[r] = _mm512_loadu_ps(x + r * in + i);
        for (int o = 0; o < 4; ++o) {
            const __m512 wv = load_bf16(wo[o] + i);
            for (int r = 0; r < NR; ++r) acc[o][r] = _mm512_fmadd_ps(wv, xv[r], acc[o][r]);
        }
    }
    for (int o = 0; o < 4 && o0 + o < out; ++o)
        for (int r = 0; r < NR; ++r)
            put(y + r * out + o0 + o, _mm512_reduce_add_ps(acc[o][r]) + (bias ? bias[o0 + o] : 0.0f),
                accumulate);
}
#endif

static inline float dot_bf16(const float *restrict x, const uint16_t *restrict w, int64_t n)
{
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) part[j] += x[i + j] * bf16_load(w[i + j]);
    float sum = 0.0f;
    for (; i < n; ++i) sum += x[i] * bf16_load(w[i]);
    for (int j = 0; j < 16; ++j) sum += part[j];
    return sum;
}

/* y[r, o] = w[o, :] . x[r, :] (+ bias[o]), or added to y[r, o]; w in bfloat16 */
static void linear(const float *x, const uint16_t *w, const float *bias, float *y, int64_t rows, int64_t in,
                   int64_t out, int accumulate)
{
#if defined(__AVX512F__)
    if (in % 16 == 0) {
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const float *xr = x + r0 * in;
            float *yr = y + r0 * out;
            for (int64_t o0 = 0; o0 < out; o0 += 4) switch (rows - r0 < 4 ? rows - r0 : 4) {
                case 1: linear_tile(xr, w, bias, yr, in, out, o0, accumulate, 1); break;
                case 2: linear_tile(xr, w, bias, yr, in, out, o0, accumulate, 2); break;
                case 3: linear_tile(xr, w, bias, yr, in, out, o0, accumulate, 3); break;
                default: linear_tile(xr, w, bias, yr, in, out, o0, accumulate, 4); break;
            }
        }
        return;
    }
#endif
    for (int64_t o = 0; o < out; ++o) {
        const uint16_t *wo = w + o * in;
        const float b = bias ? bias[o] : 0.0f;
        for (int64_t r = 0; r < rows; ++r) put(y + r * out + o, dot_bf16(x + r * in, wo, in) + b, accumulate);
    }
}

static void rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t n, float eps)
{
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * n;
        const float inv = 1.0f / sqrtf(dot(xr, xr, n) / (float)n + eps);
        for (int64_t i = 0; i < n; ++i) out[r * n + i] = xr[i] * inv * w[i];
    }
}

/* HF's rotate-half RoPE on `heads` heads of head_dim at position pos, in place */
static void rope(float *x, int64_t heads, int64_t head_dim, int64_t pos, const float *inv_freq, float scale)
{
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float f = (float)pos * inv_freq[i], c = cosf(f) * scale, s = sinf(f) * scale;
        for (int64_t h = 0; h < heads; ++h) {
            float *xh = x + h * head_dim;
            const float a = xh[i], b = xh[i + half];
            xh[i] = a * c - b * s;
            xh[i + half] = b * c + a * s;
        }
    }
}

/* q . k over head_dim */
static inline float head_dot(const float *q, const float *k, int64_t head_dim)
{
#if defined(__AVX512F__)
    if (head_dim % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < head_dim; i += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    return dot(q, k, head_dim);
}

/* softmax(scale * q . K) V over positions 0..context-1 of one KV head (a position at slot * head_dim) */
static void attend(const float *q, const float *k_head, const float *v_head, const int64_t *table, int64_t bs,
                   int64_t context, int64_t head_dim, float scale, float *scores, float *out)
{
    float top = -INFINITY;
    for (int64_t p = 0; p < context; ++p) {
        scores[p] = scale * head_dot(q, k_head + (table[p / bs] * bs + p % bs) * head_dim, head_dim);
        if (scores[p] > top) top = scores[p];
    }
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t p = 0; p < context; ++p) {
        scores[p] = exp_f32(scores[p] - top);
        total += scores[p];
    }
    memset(out, 0, head_dim * sizeof(float));
    for (int64_t p = 0; p < context; ++p) {
        const float *v = v_head + (table[p / bs] * bs + p % bs) * head_dim, weight = scores[p] / total;
        for (int64_t i = 0; i < head_dim; ++i) out[i] += weight * v[i];
    }
}

struct model {
    const int64_t *dims;
    float eps, scale, rope_scale;
    const float *inv_freq, *embed, *final_norm;
    const void *const *weights;
    float *const *caches;
    const uint16_t *lm_head;
};

/* One forward over `rows` one-token rows (row r: tokens[r] at positions[r], its sequence's block table
 * tables[r]); best[r]: the most likely next token of each row with sample[r] */
static void forward(const struct model *m, int64_t rows, const int64_t *tokens, const int64_t *positions,
                    const int64_t *const *tables, const uint8_t *sample, float *scratch, int64_t *best)
{
    const int64_t *dims = m->dims;
    const int64_t layers = dims[D_LAYERS], hidden = dims[D_HIDDEN], heads = dims[D_HEADS];
    const int64_t kv_heads = dims[D_KV_HEADS], head_dim = dims[D_HEAD_DIM], inter = dims[D_INTER];
    const int64_t vocab = dims[D_VOCAB], bs = dims[D_BLOCK], slots = dims[D_SLOTS];
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    const int64_t group = heads / kv_heads;
    float *x = scratch, *h = x + rows * hidden, *qkv = h + rows * hidden, *attn = qkv + rows * qkv_size;
    float *gate_up = attn + rows * q_size, *act = gate_up + rows * 2 * inter, *scores = act + rows * inter;
    int64_t context = 0;
    for (int64_t r = 0; r < rows; ++r)
        if (positions[r] + 1 > context) context = positions[r] + 1;
    float *logits = scores + context;

    for (int64_t r = 0; r < rows; ++r)
        memcpy(x + r * hidden, m->embed + tokens[r] * hidden, hidden * sizeof(float));
    for (int64_t l = 0; l < layers; ++l) {
        const void *const *w = m->weights + l * W_NUM;
        float *k_cache = m->caches[2 * l], *v_cache = m->caches[2 * l + 1];
        rms_norm(x, w[W_IN_NORM], h, rows, hidden, m->eps);
        linear(h, w[W_QKV], (const float *)w[W_QKV_BIAS], qkv, rows, hidden, qkv_size, 0);
        for (int64_t r = 0; r < rows; ++r) { /* RoPE on q and k, then the row's K/V into the pool */
            float *qr = qkv + r * qkv_size;
            const int64_t pos = positions[r], slot = tables[r][pos / bs] * bs + pos % bs;
            rope(qr, heads + kv_heads, head_dim, pos, m->inv_freq, m->rope_scale);
            for (int64_t kh = 0; kh < kv_heads; ++kh) {
                const int64_t at = (kh * slots + slot) * head_dim, bytes = head_dim * sizeof(float);
                memcpy(k_cache + at, qr + q_size + kh * head_dim, bytes);
                memcpy(v_cache + at, qr + q_size + kv_size + kh * head_dim, bytes);
            }
        }
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t hq = 0; hq < heads; ++hq) {
                const int64_t kh = hq / group;
                attend(qkv + r * qkv_size + hq * head_dim, k_cache + kh * slots * head_dim,
                       v_cache + kh * slots * head_dim, tables[r], bs, positions[r] + 1, head_dim, m->scale,
                       scores, attn + r * q_size + hq * head_dim);
            }
        linear(attn, w[W_O], NULL, x, rows, q_size, hidden, 1);
        rms_norm(x, w[W_POST_NORM], h, rows, hidden, m->eps);
        linear(h, w[W_GATE_UP], NULL, gate_up, rows, hidden, 2 * inter, 0);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t i = 0; i < inter; ++i) {
                const float g = gate_up[r * 2 * inter + i];
                act[r * inter + i] = g / (1.0f + expf(-g)) * gate_up[r * 2 * inter + inter + i];
            }
        linear(act, w[W_DOWN], NULL, x, rows, inter, hidden, 1);
    }
    int64_t sampled = 0; /* the sampled rows' final norms side by side, then their logits in one product */
    for (int64_t r = 0; r < rows; ++r)
        if (sample[r]) rms_norm(x + r * hidden, m->final_norm, h + sampled++ * hidden, 1, hidden, m->eps);
    linear(h, m->lm_head, NULL, logits, sampled, hidden, vocab, 0);
    for (int64_t r = 0, i = 0; r < rows; ++r) {
        if (!sample[r]) continue;
        const float *row = logits + i++ * vocab;
        int64_t top = 0;
        for (int64_t t = 1; t < vocab; ++t)
            if (row[t] > row[top]) top = t;
        best[r] = top;
    }
}

/* Greedy drafts: one forward over the rows, then each row with num_draft[r] > 1 goes on alone, its last
 * token fed back at the next position, until it has num_draft[r] tokens: out[r * steps + s], steps =
 * max(num_draft). dims: D_NUM sizes (above); weights: W_NUM pointers a layer (the norms and W_QKV_BIAS
 * float32, the bias possibly NULL; the products' bfloat16); caches: K then V a layer, [kv_heads, slots,
 * head_dim] float32 each; tables: [rows, max_blocks], blocks for every position fed; embed float32, lm_head
 * bfloat16; scratch: at least rows * (2 * hidden + (2 * heads + 2 * kv_heads) * head_dim + 3 * inter +
 * vocab) + the longest context (the last position fed, plus one) floats. The caller checks every index
 * (tokens, tables, positions) against the sizes: this reads and writes raw memory. */
int draft_step_f32(const int64_t *dims, float eps, float scale, float rope_scale, const int64_t *tokens,
                   const int64_t *positions, const int64_t *tables, const int64_t *num_draft,
                   const float *inv_freq, const void *const *weights, float *const *caches,
                   const float *embed, const float *final_norm, const uint16_t *lm_head, float *scratch,
                   int64_t *out)
{
    const struct model m = {dims, eps, scale, rope_scale, inv_freq, embed, final_norm, weights, caches, lm_head};
    const int64_t rows = dims[D_ROWS], max_blocks = dims[D_MAX_BLOCKS];
    if (rows <= 0) return 0;
    int64_t steps = 0;
    for (int64_t r = 0; r < rows; ++r)
        if (num_draft[r] > steps) steps = num_draft[r];
    /* this step's rows: all of them first, then those still drafting (compacted); row_of: their row */
    int64_t tok[rows], pos[rows], best[rows], row_of[rows];
    const int64_t *tab[rows];
    uint8_t sample[rows];
    for (int64_t r = 0; r < rows; ++r) {
        tok[r] = tokens[r], pos[r] = positions[r], tab[r] = tables + r * max_blocks, row_of[r] = r;
        sample[r] = num_draft[r] > 0;
    }
    int64_t n = rows;
    for (int64_t s = 0; s < steps; ++s) {
        forward(&m, n, tok, pos, tab, sample, scratch, best);
        int64_t next = 0;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t r = row_of[i];
            if (!sample[i]) continue;
            out[r * steps + s] = best[i];
            if (num_draft[r] > s + 1) {
                tok[next] = best[i], pos[next] = pos[i] + 1, tab[next] = tab[i], row_of[next] = r;
                sample[next++] = 1;
            }
        }
        n = next;
    }
    return 0;
}
