/* A whole decode step of a small Llama-family model in float32, in one call: the greedy next token of each
 * sampled row, then each row's next ones, fed back. Speculative decoding's draft model
 * (engine/executor/draft_model.py) runs steps of a row or a few, where a torch forward is all per-op overhead
 * (the shipped 4-layer draft model: 1.2 ms a one-row step, of which the products and kernels are ~0.3 ms);
 * here the step is the arithmetic and the reads of the weights.
 *
 * The model (checked by the caller, engine/executor/draft_model.py's FusedDraftStep): RMSNorm before
 * attention and MLP, q/k/v in one product (bias optional), RoPE over the whole head (HF's rotate-half),
 * grouped-query attention over the paged K/V pool (head-major [num_kv_heads, num_slots, head_dim] per layer,
 * float32), o_proj without bias, SiLU(gate) * up, down without bias, a final RMSNorm and the LM head. The
 * products' weights are read in bfloat16 (half the bytes of a step that reads every weight once:
 * memory-bound), everything else is float32. Every row reads the K/V of its sequence's positions 0..its own
 * through its block table; all rows' K/V are written before any row attends, so rows of one sequence at
 * consecutive positions (a context read a few tokens at a time) see each other, as the torch forward's
 * decode rows do. Sums are in float32 in another order than torch's: a draft token may differ from the
 * torch forward's where two logits nearly tie, which only changes what is proposed, never what is kept.
 *
 * With `threads` > 1 the call runs as one job of csrc/thread_pool.c (one wake-up of its workers a call, not
 * one a product): each part takes its share of the KV heads (their q/k/v rows, RoPE, K/V writes and
 * attention, which read nothing of the other parts') and of every other product's outputs, each part
 * normalizing the rows itself, and the parts meet at a spin barrier where a product reads what all wrote
 * (four a layer). */
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "kernel_math.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* _mm_pause; AVX-512 where the compiler targets it */
#endif

enum { D_LAYERS, D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_VOCAB, D_BLOCK, D_MAX_BLOCKS, D_SLOTS,
       D_ROWS, D_NUM };
enum { W_IN_NORM, W_QKV, W_QKV_BIAS, W_O, W_POST_NORM, W_GATE_UP, W_DOWN, W_NUM };

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
                                                               int64_t count, int64_t ystride, int64_t o0,
                                                               int accumulate, const int NR)
{
    const int64_t last = count - 1;
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
    for (int o = 0; o < 4 && o0 + o < count; ++o)
        for (int r = 0; r < NR; ++r)
            put(y + r * ystride + o0 + o, _mm512_reduce_add_ps(acc[o][r]) + (bias ? bias[o0 + o] : 0.0f),
                accumulate);
}
#endif

/* y[r, o] = w[o, :] . x[r, :] (+ bias[o]) for o < count, or added to y[r, o]; rows of y ystride apart; w in
 * bfloat16 (`w`, `bias` and `y` start at the first output) */
static void linear(const float *x, const uint16_t *w, const float *bias, float *y, int64_t rows, int64_t in,
                   int64_t count, int64_t ystride, int accumulate)
{
    if (count <= 0) return;
#if defined(__AVX512F__)
    if (in % 16 == 0) {
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const float *xr = x + r0 * in;
            float *yr = y + r0 * ystride;
            for (int64_t o0 = 0; o0 < count; o0 += 4) switch (rows - r0 < 4 ? rows - r0 : 4) {
                case 1: linear_tile(xr, w, bias, yr, in, count, ystride, o0, accumulate, 1); break;
                case 2: linear_tile(xr, w, bias, yr, in, count, ystride, o0, accumulate, 2); break;
                case 3: linear_tile(xr, w, bias, yr, in, count, ystride, o0, accumulate, 3); break;
                default: linear_tile(xr, w, bias, yr, in, count, ystride, o0, accumulate, 4); break;
            }
        }
        return;
    }
#endif
    for (int64_t o = 0; o < count; ++o) {
        const uint16_t *wo = w + o * in;
        const float b = bias ? bias[o] : 0.0f;
        for (int64_t r = 0; r < rows; ++r)
            put(y + r * ystride + o, dot_bf16(x + r * in, wo, in) + b, accumulate);
    }
}

/* part `part` of `parts`' share of n outputs: [*begin, *end), in multiples of 4 (a tile) */
static inline void share(int64_t n, int part, int parts, int64_t *begin, int64_t *end)
{
    const int64_t tiles = (n + 3) / 4;
    *begin = tiles * part / parts * 4;
    *end = tiles * (part + 1) / parts * 4;
    if (*begin > n) *begin = n;
    if (*end > n) *end = n;
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

/* the parts of one call: a sense-counting spin barrier (the parts run at once, on their own threads) */
struct team {
    atomic_int arrived;
    atomic_int round;
};

static void meet(struct team *t, int parts)
{
    if (parts == 1) return;
    const int round = atomic_load_explicit(&t->round, memory_order_acquire);
    if (atomic_fetch_add_explicit(&t->arrived, 1, memory_order_acq_rel) == parts - 1) {
        atomic_store_explicit(&t->arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&t->round, 1, memory_order_release);
        return;
    }
    for (int spins = 1; atomic_load_explicit(&t->round, memory_order_acquire) == round; ++spins) {
        if ((spins & 4095) == 0) sched_yield(); /* a part the OS took away: let it run */
#if defined(__x86_64__) || defined(__i386__)
        else _mm_pause();
#endif
    }
}

struct call {
    struct model m;
    const int64_t *num_draft;
    int64_t *out;
    float *scratch;
    int64_t rows, steps, threads;
    /* this step's rows (all of them first, then those still drafting) and which row each one is */
    int64_t *tok, *pos, *best, *row_of;
    const int64_t **tab;
    uint8_t *sample;
    int64_t n;
    struct team team;
};

/* One forward over `n` one-token rows (row i: tok[i] at pos[i], its sequence's block table tab[i]), this
 * part's share of it; best[i]: the most likely next token of each row with sample[i] (part 0 writes it) */
static void forward(struct call *c, int part, int parts)
{
    const struct model *m = &c->m;
    const int64_t *dims = m->dims, n = c->n;
    const int64_t layers = dims[D_LAYERS], hidden = dims[D_HIDDEN], heads = dims[D_HEADS];
    const int64_t kv_heads = dims[D_KV_HEADS], head_dim = dims[D_HEAD_DIM], inter = dims[D_INTER];
    const int64_t vocab = dims[D_VOCAB], bs = dims[D_BLOCK], slots = dims[D_SLOTS], rows = c->rows;
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    const int64_t group = heads / kv_heads;
    /* shared: x, qkv, attn, gate_up, act, logits; each part's own: h and the attention scores */
    float *x = c->scratch, *qkv = x + rows * hidden, *attn = qkv + rows * qkv_size;
    float *gate_up = attn + rows * q_size, *act = gate_up + rows * 2 * inter, *logits = act + rows * inter;
    int64_t context = 0;
    for (int64_t r = 0; r < n; ++r)
        if (c->pos[r] + 1 > context) context = c->pos[r] + 1;
    float *h = logits + rows * vocab + part * (rows * hidden + context);
    float *scores = h + rows * hidden;
    const int64_t kh0 = kv_heads * part / parts, kh1 = kv_heads * (part + 1) / parts;
    int64_t hid0, hid1, in0, in1, v0, v1;
    share(hidden, part, parts, &hid0, &hid1);
    share(inter, part, parts, &in0, &in1);
    share(vocab, part, parts, &v0, &v1);

    if (part == 0)
        for (int64_t r = 0; r < n; ++r)
            memcpy(x + r * hidden, m->embed + c->tok[r] * hidden, hidden * sizeof(float));
    meet(&c->team, parts); /* every row embedded */
    for (int64_t l = 0; l < layers; ++l) {
        const void *const *w = m->weights + l * W_NUM;
        const uint16_t *w_qkv = w[W_QKV], *w_o = w[W_O], *w_gate_up = w[W_GATE_UP], *w_down = w[W_DOWN];
        const float *bias = w[W_QKV_BIAS];
        float *k_cache = m->caches[2 * l], *v_cache = m->caches[2 * l + 1];
        rms_norm(x, w[W_IN_NORM], h, n, hidden, m->eps);
        /* this part's KV heads: their q heads, k and v rows of the q/k/v product */
        const int64_t q0 = kh0 * group * head_dim, qn = (kh1 - kh0) * group * head_dim;
        const int64_t k0 = q_size + kh0 * head_dim, kn = (kh1 - kh0) * head_dim, v0w = k0 + kv_size;
        linear(h, w_qkv + q0 * hidden, bias ? bias + q0 : NULL, qkv + q0, n, hidden, qn, qkv_size, 0);
        linear(h, w_qkv + k0 * hidden, bias ? bias + k0 : NULL, qkv + k0, n, hidden, kn, qkv_size, 0);
        linear(h, w_qkv + v0w * hidden, bias ? bias + v0w : NULL, qkv + v0w, n, hidden, kn, qkv_size, 0);
        for (int64_t r = 0; r < n; ++r) { /* RoPE on q and k, then the row's K/V into the pool */
            float *qr = qkv + r * qkv_size;
            const int64_t p = c->pos[r], slot = c->tab[r][p / bs] * bs + p % bs;
            rope(qr + q0, (kh1 - kh0) * group, head_dim, p, m->inv_freq, m->rope_scale);
            rope(qr + k0, kh1 - kh0, head_dim, p, m->inv_freq, m->rope_scale);
            for (int64_t kh = kh0; kh < kh1; ++kh) {
                const int64_t at = (kh * slots + slot) * head_dim, bytes = head_dim * sizeof(float);
                memcpy(k_cache + at, qr + q_size + kh * head_dim, bytes);
                memcpy(v_cache + at, qr + q_size + kv_size + kh * head_dim, bytes);
            }
        }
        for (int64_t r = 0; r < n; ++r)
            for (int64_t hq = kh0 * group; hq < kh1 * group; ++hq) {
                const int64_t kh = hq / group;
                attend(qkv + r * qkv_size + hq * head_dim, k_cache + kh * slots * head_dim,
                       v_cache + kh * slots * head_dim, c->tab[r], bs, c->pos[r] + 1, head_dim, m->scale,
                       scores, attn + r * q_size + hq * head_dim);
            }
        meet(&c->team, parts); /* o_proj reads every head's output */
        linear(attn, w_o + hid0 * q_size, NULL, x + hid0, n, q_size, hid1 - hid0, hidden, 1);
        meet(&c->team, parts); /* the norm reads every column of x */
        rms_norm(x, w[W_POST_NORM], h, n, hidden, m->eps);
        linear(h, w_gate_up + in0 * hidden, NULL, gate_up + in0, n, hidden, in1 - in0, 2 * inter, 0);
        linear(h, w_gate_up + (inter + in0) * hidden, NULL, gate_up + inter + in0, n, hidden, in1 - in0,
               2 * inter, 0);
        for (int64_t r = 0; r < n; ++r)
            for (int64_t i = in0; i < in1; ++i) {
                const float g = gate_up[r * 2 * inter + i];
                act[r * inter + i] = g / (1.0f + expf(-g)) * gate_up[r * 2 * inter + inter + i];
            }
        meet(&c->team, parts); /* down reads every column of act */
        linear(act, w_down + hid0 * inter, NULL, x + hid0, n, inter, hid1 - hid0, hidden, 1);
        meet(&c->team, parts);
    }
    int64_t sampled = 0; /* the sampled rows' final norms side by side, then their logits in one product */
    for (int64_t r = 0; r < n; ++r)
        if (c->sample[r]) rms_norm(x + r * hidden, m->final_norm, h + sampled++ * hidden, 1, hidden, m->eps);
    linear(h, m->lm_head + v0 * hidden, NULL, logits + v0, sampled, hidden, v1 - v0, vocab, 0);
    meet(&c->team, parts);
    if (part != 0) return;
    for (int64_t r = 0, i = 0; r < n; ++r) {
        if (!c->sample[r]) continue;
        const float *row = logits + i++ * vocab;
        int64_t top = 0;
        for (int64_t t = 1; t < vocab; ++t)
            if (row[t] > row[top]) top = t;
        c->best[r] = top;
    }
}

/* every step of the call, this part's share (part 0 also keeps the books between steps) */
static void run(struct call *c, int part, int parts)
{
    for (int64_t s = 0; s < c->steps; ++s) {
        forward(c, part, parts);
        if (part == 0) {
            int64_t next = 0;
            for (int64_t i = 0; i < c->n; ++i) {
                const int64_t r = c->row_of[i];
                if (!c->sample[i]) continue;
                c->out[r * c->steps + s] = c->best[i];
                if (c->num_draft[r] > s + 1) {
                    c->tok[next] = c->best[i], c->pos[next] = c->pos[i] + 1, c->tab[next] = c->tab[i];
                    c->row_of[next] = r, c->sample[next++] = 1;
                }
            }
            c->n = next;
        }
        meet(&c->team, parts); /* the next step's rows */
        if (c->n == 0) break;
    }
}

/* csrc/thread_pool.c's kernel 17: a pool job of `threads` ranges, one a part (a range of more: this thread
 * alone, the pool having no other) */
int draft_part(void *call, int64_t begin, int64_t end)
{
    struct call *c = call;
    if (end - begin >= c->threads) run(c, 0, 1);
    else run(c, (int)begin, (int)c->threads);
    return 0;
}

int pool_run(int kernel, const int64_t *ints, int64_t num_ints, float f, int64_t work, int64_t num_threads);

/* Greedy drafts: one forward over the rows, then each row with num_draft[r] > 1 goes on alone, its last
 * token fed back at the next position, until it has num_draft[r] tokens: out[r * steps + s], steps =
 * max(num_draft). dims: D_NUM sizes (above); weights: W_NUM pointers a layer (the norms and W_QKV_BIAS
 * float32, the bias possibly NULL; the products' bfloat16); caches: K then V a layer, [kv_heads, slots,
 * head_dim] float32 each; tables: [rows, max_blocks], blocks for every position fed; embed float32, lm_head
 * bfloat16; threads: parts of the call; scratch: at least rows * (2 * hidden + (2 *
 * heads + 2 * kv_heads) * head_dim + 3 * inter + vocab) + threads * (rows * hidden + the longest context
 * (the last position fed, plus one)) floats. The caller checks every index (tokens, tables, positions)
 * against the sizes: this reads and writes raw memory. */
int draft_step_f32(const int64_t *dims, float eps, float scale, float rope_scale, const int64_t *tokens,
                   const int64_t *positions, const int64_t *tables, const int64_t *num_draft,
                   const float *inv_freq, const void *const *weights, float *const *caches,
                   const float *embed, const float *final_norm, const uint16_t *lm_head, float *scratch,
                   int64_t *out, int64_t threads)
{
    const int64_t rows = dims[D_ROWS], max_blocks = dims[D_MAX_BLOCKS];
    if (rows <= 0) return 0;
    int64_t steps = 0;
    for (int64_t r = 0; r < rows; ++r)
        if (num_draft[r] > steps) steps = num_draft[r];
    int64_t tok[rows], pos[rows], best[rows], row_of[rows];
    const int64_t *tab[rows];
    uint8_t sample[rows];
    for (int64_t r = 0; r < rows; ++r) {
        tok[r] = tokens[r], pos[r] = positions[r], tab[r] = tables + r * max_blocks, row_of[r] = r;
        sample[r] = num_draft[r] > 0;
    }
    struct call c = {
        {dims, eps, scale, rope_scale, inv_freq, embed, final_norm, weights, caches, lm_head},
        num_draft, out, scratch, rows, steps, threads < 1 ? 1 : threads, tok, pos, best, row_of, tab, sample,
        rows, {0, 0},
    };
    if (c.threads == 1) {
        run(&c, 0, 1);
        return 0;
    }
    const int64_t arg = (int64_t)(intptr_t)&c;
    return pool_run(17, &arg, 1, 0.0f, c.threads, c.threads);
}
