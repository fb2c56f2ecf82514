#define _POSIX_C_SOURCE 200809L
/* One call runs a kernel over [0, work) split into num_threads ranges: the calling thread takes the first,
 * a pool of POSIX threads the rest. The pool lives here, not in Python: a Python thread pool cost ~80 us a
 * call on a 2-core VM (a submit, a future, and the GIL for each worker to start, which the server's event
 * loop may hold), paid per layer and step; this one needs no GIL (ctypes releases it for the whole call).
 *
 * Workers spin a little for the next job (the next layer's call comes soon), then sleep on a condition
 * variable, so that they do not take a core from torch's own threads between calls. One job at a time:
 * concurrent callers (two engines in one process) take turns. A forked child starts without workers.
 *
 * Where torch has loaded libgomp (its CPU build), a job runs on OpenMP's team instead (GOMP_parallel, found
 * with dlsym: no link to any OpenMP runtime; callers on several threads then run at once, each on its own
 * thread's team): the threads torch's own products run on, so that the two pools
 * do not take turns on the cores: after a product torch's worker spins (offline, engine/config.py) where this
 * pool's worker needed the core, and after a kernel call torch's worker had to be woken. A 28-row decode step
 * of the SmolLM-135M shape took 55.5 ms on the pool (22.9 in attention, 5.1 in o_proj), 45 on the team (16.0,
 * 3.1); under the server's passive wait the same within noise. Not in a forked child (libgomp would wait for
 * its parent's threads) nor for draft_part (its parts wait for each other: each needs a thread of its own,
 * which a team may not give). */

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stddef.h>
#include <sched.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#else
#define RELAX() ((void)0)
#endif

#define MAX_THREADS 256
#define DRAFT_PART 17 /* run_kernel's draft_part */
#define WORKER_SPIN_NS 10000 /* how long a worker spins for the next job before it sleeps */

/* the kernels (engine/kernels/csrc/*.c), each over its own [begin, end) */
int paged_decode_f32(const void *, int64_t, const void *, const void *, const int64_t *, const int64_t *,
                     const int64_t *, int64_t, void *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                     float, int64_t, int64_t);
int paged_decode_bf16(const void *, int64_t, const void *, const void *, const int64_t *, const int64_t *,
                      const int64_t *, int64_t, void *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                      float, int64_t, int64_t);
int int8_linear_f32(const float *, const int8_t *, const float *, float *, int64_t, int64_t, int64_t, int64_t,
                    int64_t, int64_t);
int int8_dequantize_f32(const int8_t *, const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t);
int rms_norm_f32(const float *, const float *, const float *, float *, float *, int64_t, float, int64_t, int64_t);
int rms_norm_bf16(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, uint16_t *, int64_t, float,
                  int64_t, int64_t);
int rope_f32(float *, const float *, const float *, int64_t, int64_t, int64_t, int64_t, int64_t);
int rope_bf16(uint16_t *, const uint16_t *, const uint16_t *, int64_t, int64_t, int64_t, int64_t, int64_t);
int silu_mul_f32(const float *, float *, int64_t, int64_t, int64_t);
int silu_mul_bf16(const uint16_t *, uint16_t *, int64_t, int64_t, int64_t);
int quantize_rows_f32(const float *, int8_t *, float *, int64_t, int64_t, int64_t);
int quantize_rows_bf16(const uint16_t *, int8_t *, float *, int64_t, int64_t, int64_t);
int scale_rows_f32(float *, const float *, int64_t, int64_t, int64_t);
int scale_rows_bf16(const float *, const float *, uint16_t *, int64_t, int64_t, int64_t);
int lora_rows_f32(const float *, float *, const int64_t *, const int64_t *, const float *, const float *, int64_t,
                  int64_t, int64_t, int64_t, int64_t);
int lora_rows_bf16(const uint16_t *, uint16_t *, const int64_t *, const int64_t *, const uint16_t *, const uint16_t *,
                   int64_t, int64_t, int64_t, int64_t, int64_t);
int race_scores_f32(float *, const int64_t *, int64_t, int64_t, int64_t);
int head_norm_f32(float *, const float *, const float *, int64_t, int64_t, int64_t, int64_t, float, int64_t,
                  int64_t);
int head_norm_bf16(uint16_t *, const uint16_t *, const uint16_t *, int64_t, int64_t, int64_t, int64_t, float,
                   int64_t, int64_t);
int draft_part(void *, int64_t, int64_t);
int few_rows_f32(const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t);

typedef struct {
    const int64_t *i; /* the kernel's integer and pointer arguments, in order */
    float f;          /* its one float argument (scale, eps), where it has one */
} args_t;

#define P(n) ((void *)(intptr_t)a->i[n])

static int run_kernel_as_is(int kernel, const args_t *a, int64_t b, int64_t e)
{
    const int64_t *i = a->i;
    switch (kernel) {
    case 0:
        return paged_decode_f32(P(0), i[1], P(2), P(3), P(4), P(5), P(6), i[7], P(8), i[9], i[10], i[11],
                                i[12], i[13], i[14], a->f, b, e);
    case 1:
        return paged_decode_bf16(P(0), i[1], P(2), P(3), P(4), P(5), P(6), i[7], P(8), i[9], i[10], i[11],
                                 i[12], i[13], i[14], a->f, b, e);
    case 2: return int8_linear_f32(P(0), P(1), P(2), P(3), i[4], i[5], i[6], i[7], b, e);
    case 3: return int8_dequantize_f32(P(0), P(1), P(2), i[3], i[4], i[5], b, e);
    case 4: return rms_norm_f32(P(0), P(1), P(2), P(3), P(4), i[5], a->f, b, e);
    case 5: return rms_norm_bf16(P(0), P(1), P(2), P(3), P(4), i[5], a->f, b, e);
    case 6: return rope_f32(P(0), P(1), P(2), i[3], i[4], i[5], b, e);
    case 7: return rope_bf16(P(0), P(1), P(2), i[3], i[4], i[5], b, e);
    case 8: return silu_mul_f32(P(0), P(1), i[2], b, e);
    case 9: return silu_mul_bf16(P(0), P(1), i[2], b, e);
    case 10: return quantize_rows_f32(P(0), P(1), P(2), i[3], b, e);
    case 11: return quantize_rows_bf16(P(0), P(1), P(2), i[3], b, e);
    case 12: return scale_rows_f32(P(0), P(1), i[2], b, e);
    case 13: return scale_rows_bf16(P(0), P(1), P(2), i[3], b, e);
    case 14: return lora_rows_f32(P(0), P(1), P(2), P(3), P(4), P(5), i[6], i[7], i[8], b, e);
    case 15: return lora_rows_bf16(P(0), P(1), P(2), P(3), P(4), P(5), i[6], i[7], i[8], b, e);
    case 16: return race_scores_f32(P(0), P(1), i[2], b, e);
    case DRAFT_PART: return draft_part(P(0), b, e); /* its parts meet at barriers: one range a thread */
    case 18: return head_norm_f32(P(0), P(1), P(2), i[3], i[4], i[5], i[6], a->f, b, e);
    case 19: return head_norm_bf16(P(0), P(1), P(2), i[3], i[4], i[5], i[6], a->f, b, e);
    case 20: return few_rows_f32(P(0), P(1), P(2), i[3], i[4], i[5], b, e);
    default: return -2;
    }
}

/* A kernel's range with denormal floats flushed to zero, in and out (FTZ and DAZ in this thread's MXCSR,
 * restored after). Without, one denormal operand costs a microcode assist of ~100 cycles: softmax weights
 * that underflow (scores more than ~87 below the row's top) times values under 1 are denormal, and
 * activations blown up by a bad LoRA adapter made paged_decode 7x slower (1.77 s against 0.24 s a run). */
static int run_kernel(int kernel, const args_t *a, int64_t b, int64_t e)
{
#if defined(__SSE2__)
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* FTZ (bit 15) and DAZ (bit 6) */
    const int code = run_kernel_as_is(kernel, a, b, e);
    _mm_setcsr(csr);
    return code;
#else
    return run_kernel_as_is(kernel, a, b, e);
#endif
}

static struct {
    pthread_mutex_t job_mu;  /* one job at a time */
    pthread_mutex_t wake_mu; /* with wake: sleeping workers */
    pthread_cond_t wake;
    int num_workers;
    atomic_long generation; /* bumped once per job */
    atomic_int pending;     /* workers that have not finished the current job */
    atomic_int error;
    int kernel, num_parts;
    const args_t *args;
    int64_t work;
    long born[MAX_THREADS]; /* a worker's generation when it was started */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void run_part(int part)
{
    const int64_t lo = pool.work * part / pool.num_parts, hi = pool.work * (part + 1) / pool.num_parts;
    if (hi > lo) {
        const int code = run_kernel(pool.kernel, pool.args, lo, hi);
        int none = 0;
        if (code != 0) atomic_compare_exchange_strong(&pool.error, &none, code); /* the first error stands */
    }
}

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *worker(void *arg)
{
    const int part = (int)(intptr_t)arg;
    long seen = pool.born[part]; /* not the generation now: the job it was started for may be out already */
    for (;;) {
        long now;
        const int64_t sleep_at = now_ns() + WORKER_SPIN_NS;
        for (int spins = 0; (now = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen; ++spins) {
            if ((spins & 63) != 0 || now_ns() < sleep_at) {
                RELAX();
                continue;
            }
            pthread_mutex_lock(&pool.wake_mu);
            while ((now = atomic_load(&pool.generation)) == seen) pthread_cond_wait(&pool.wake, &pool.wake_mu);
            pthread_mutex_unlock(&pool.wake_mu);
            break;
        }
        seen = now;
        if (part < pool.num_parts) run_part(part);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_acq_rel);
    }
    return NULL;
}

static void grow(int wanted)
{
    while (pool.num_workers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pool.born[pool.num_workers + 1] = atomic_load(&pool.generation);
        const int ok = pthread_create(&thread, &attr, worker, (void *)(intptr_t)(pool.num_workers + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) return;
        ++pool.num_workers;
    }
}

/* OpenMP's entry points where torch loaded libgomp (all or none); GOMP_parallel: GCC's ABI since 4.9 */
static struct {
    void (*parallel)(void (*)(void *), void *, unsigned, unsigned);
    int (*thread_num)(void), (*num_threads)(void);
    int forked; /* this process is a fork: its team's threads are its parent's */
} omp;

static void after_fork_in_child(void)
{
    pthread_mutex_t fresh_mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cond = PTHREAD_COND_INITIALIZER;
    pool.job_mu = fresh_mu;
    pool.wake_mu = fresh_mu;
    pool.wake = fresh_cond;
    pool.num_workers = 0; /* the parent's threads do not exist here */
    omp.forked = 1;
}

typedef struct {
    int kernel;
    const args_t *args;
    int64_t work;
    atomic_int error;
} omp_job_t;

static void omp_part(void *data) /* one thread of the team: its share of the work, by the team's size */
{
    omp_job_t *job = data;
    const int64_t n = omp.num_threads(), t = omp.thread_num();
    const int64_t lo = job->work * t / n, hi = job->work * (t + 1) / n;
    if (hi > lo) {
        const int code = run_kernel(job->kernel, job->args, lo, hi);
        int none = 0;
        if (code != 0) atomic_compare_exchange_strong(&job->error, &none, code);
    }
}

static void find_openmp(void)
{
    void *lib = dlopen("libgomp.so.1", RTLD_LAZY | RTLD_NOLOAD); /* loaded already, or not at all */
    if (lib == NULL) return;
    omp.thread_num = (int (*)(void))dlsym(lib, "omp_get_thread_num");
    omp.num_threads = (int (*)(void))dlsym(lib, "omp_get_num_threads");
    if (omp.thread_num && omp.num_threads)
        omp.parallel = (void (*)(void (*)(void *), void *, unsigned, unsigned))dlsym(lib, "GOMP_parallel");
}

/* at load, not at the first job: a child forked before that job (its parent's torch having run threads) must
 * not start OpenMP's team either */
__attribute__((constructor)) static void on_load(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

static pthread_once_t once = PTHREAD_ONCE_INIT;

static void init(void) { find_openmp(); }

/* whether jobs run on OpenMP's team here (1) or on this file's pool (0) */
int pool_openmp(void)
{
    pthread_once(&once, init);
    return omp.parallel != NULL && !omp.forked;
}

/* kernel: run_kernel's index; ints: its integer and pointer arguments (num_ints of them, as it takes); 0,
 * the first error a range returned, or -2 / -3 for an unknown kernel / a wrong argument count */
int pool_run(int kernel, const int64_t *ints, int64_t num_ints, float f, int64_t work, int64_t num_threads)
{
    /* run_kernel's */
    static const int64_t arity[] = {15, 15, 8, 6, 6, 6, 6, 6, 3, 3, 4, 4, 3, 4, 9, 9, 3, 1, 7, 7, 6};
    if (kernel < 0 || kernel >= (int)(sizeof arity / sizeof arity[0])) return -2;
    if (num_ints != arity[kernel]) return -3;
    const args_t args = {ints, f};
    int64_t parts = num_threads < work ? num_threads : work;
    if (parts > MAX_THREADS) parts = MAX_THREADS;
    if (parts <= 1) return work > 0 ? run_kernel(kernel, &args, 0, work) : 0;
    if (pool_openmp() && kernel != DRAFT_PART) {
        omp_job_t job = {kernel, &args, work, 0};
        omp.parallel(omp_part, &job, (unsigned)parts, 0);
        return atomic_load(&job.error);
    }
    pthread_mutex_lock(&pool.job_mu);
    grow((int)parts - 1);
    if (pool.num_workers == 0) { /* no thread could be started: all of it here */
        pthread_mutex_unlock(&pool.job_mu);
        return run_kernel(kernel, &args, 0, work);
    }
    if (parts > pool.num_workers + 1) parts = pool.num_workers + 1;
    pool.kernel = kernel;
    pool.args = &args;
    pool.work = work;
    pool.num_parts = (int)parts;
    atomic_store(&pool.error, 0);
    atomic_store(&pool.pending, pool.num_workers);
    pthread_mutex_lock(&pool.wake_mu);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.wake_mu);
    run_part(0);
    /* the parts are alike: the workers' are about done; past a while (a busy machine) give the core away */
    const int64_t yield_at = now_ns() + WORKER_SPIN_NS;
    for (int spins = 0; atomic_load_explicit(&pool.pending, memory_order_acquire) > 0; ++spins) {
        if ((spins & 63) == 0 && now_ns() > yield_at) sched_yield();
        else RELAX();
    }
    const int code = atomic_load(&pool.error);
    pthread_mutex_unlock(&pool.job_mu);
    return code;
}
