/* Worker threads for the fused forward (moe_forward.c), and the buffers its calls reuse.
 *
 * Helpers spin for a while after each phase (the next phase, or the next layer's call, comes within microseconds
 * to a millisecond) and then sleep on a condition variable, so an idle model costs no CPU. Plain C and atomics: no
 * particular instruction set.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include "runner.h"

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define HELPER_NAME "moe-fused-fwd" /* what `top -H` shows */
#define SPIN_NS 1000000             /* how long an idle helper spins before it sleeps */

/* Threads meet in a call through three atomics. `call` is odd while a call is open. `work` describes the current
 * phase in one word: [call tag : 16][tasks : 24][next task : 24]; a worker takes task i by compare-and-swap of
 * that word, so it never takes a task of another call than the one it joined (its worker index, which names its
 * scratch buffers, is only valid there). `done` counts the phase's finished tasks: the caller, having run out of
 * tasks to take, waits for it. So a helper that joins late, or never, delays nothing but its own share, and
 * helpers can come from anywhere: the runner's own threads (ctypes calls) or XLA's thread pool (the FFI handler
 * schedules them; see moe_forward.h). */
#define TASK_BITS 24
#define TASK_MASK ((1ull << TASK_BITS) - 1)
#define CALL_TAG(call) ((call) & 0xFFFF)

void *runner_reserve(buffer *b, size_t bytes) {
    if (!bytes) bytes = 1; /* a call with nothing routed here still gets a (valid) buffer */
    if (b->bytes >= bytes) return b->data;
    free(b->data);
    b->bytes = 0;
    b->data = aligned_alloc(ALIGN, (bytes + ALIGN - 1) / ALIGN * ALIGN);
    if (b->data) b->bytes = bytes;
    return b->data;
}

uint64_t runner_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Takes and runs tasks of the current phase of `call` until none is left; returns whether it ran any. */
static int take_tasks(moe_runner *r, int worker, uint64_t call) {
    int ran = 0;
    uint64_t start = 0;
    for (;;) {
        uint64_t w = atomic_load_explicit(&r->work, memory_order_acquire);
        do {
            if (w >> (2 * TASK_BITS) != CALL_TAG(call) || (w & TASK_MASK) >= ((w >> TASK_BITS) & TASK_MASK)) {
                if (ran) atomic_fetch_add_explicit(&r->busy_nanoseconds, runner_now_ns() - start, memory_order_relaxed);
                return ran;
            }
        } while (!atomic_compare_exchange_weak_explicit(&r->work, &w, w + 1, memory_order_acq_rel,
                                                        memory_order_acquire));
        if (!ran) start = runner_now_ns(), ran = 1;
        r->fn(r->state, worker, (int64_t)(w & TASK_MASK));
        atomic_fetch_add_explicit(&r->done, 1, memory_order_release);
    }
}

/* A helper's part in the open call `call`: tasks of each phase as they come, until the call closes. */
static void help(moe_runner *r, uint64_t call) {
    if (pthread_equal(pthread_self(), r->caller)) return; /* a pool that runs scheduled tasks inline */
    const int worker = atomic_fetch_add(&r->joined, 1);
    if (worker >= r->threads) return; /* enough workers (scratch exists for `threads`) */
    while (atomic_load_explicit(&r->call, memory_order_acquire) == call)
        if (!take_tasks(r, worker, call)) _mm_pause();
}

/* XLA's pool (or any scheduler) runs this; `data` is the runner */
static void scheduled_helper(void *data) {
    moe_runner *r = data;
    const uint64_t call = atomic_load_explicit(&r->call, memory_order_acquire);
    if (call & 1) help(r, call);
    atomic_fetch_sub_explicit(&r->scheduled, 1, memory_order_release);
}

/* The runner's own helper threads: wait for a call they are asked to join (spinning a while, then asleep). */
static void *own_helper_main(void *data) {
    moe_runner *r = data;
    uint64_t last = 0;
    for (;;) {
        const uint64_t spin_until = runner_now_ns() + SPIN_NS;
        uint64_t call;
        int spins = 0;
        while ((call = atomic_load_explicit(&r->own_call, memory_order_acquire)) == last && !r->stop) {
            _mm_pause();
            if (++spins % 64) continue;
            if (runner_now_ns() < spin_until) continue;
            pthread_mutex_lock(&r->mutex);
            while (atomic_load(&r->own_call) == last && !r->stop) {
                r->sleepers++;
                pthread_cond_wait(&r->wake, &r->mutex);
                r->sleepers--;
            }
            pthread_mutex_unlock(&r->mutex);
        }
        if (r->stop) return NULL;
        last = call;
        help(r, call);
    }
}

static void start_own_helpers(moe_runner *r) {
    for (int i = 1; i < r->threads; i++)
        if (pthread_create(&r->helpers[i], NULL, own_helper_main, r)) {
            r->threads = i; /* run with the helpers that started */
            break;
        } else {
            pthread_setname_np(r->helpers[i], HELPER_NAME);
        }
    r->own_helpers = 1;
}

/* Opens a call: helpers from `helpers` (moe_forward.h), or the runner's own threads when it is NULL. */
void runner_open_call(moe_runner *r, const moe_helpers *helpers) {
    r->caller = pthread_self();
    atomic_store(&r->joined, 1);
    const uint64_t call = atomic_fetch_add_explicit(&r->call, 1, memory_order_acq_rel) + 1;
    if (r->threads == 1) return;
    if (helpers) {
        const int count = helpers->count < r->threads - 1 ? helpers->count : r->threads - 1;
        for (int i = 0; i < count; i++) {
            atomic_fetch_add(&r->scheduled, 1);
            if (helpers->schedule(helpers->context, scheduled_helper, r)) atomic_fetch_sub(&r->scheduled, 1);
        }
        return;
    }
    if (!r->own_helpers) start_own_helpers(r);
    pthread_mutex_lock(&r->mutex);
    atomic_store_explicit(&r->own_call, call, memory_order_release);
    if (r->sleepers) pthread_cond_broadcast(&r->wake);
    pthread_mutex_unlock(&r->mutex);
}

void runner_close_call(moe_runner *r) { atomic_fetch_add_explicit(&r->call, 1, memory_order_release); }

/* Runs fn(state, worker, task) for task in [0, tasks) on the call's workers (the caller is worker 0); returns when
 * all are done. */
void runner_run_phase(moe_runner *r, task_fn fn, void *state, int64_t tasks) {
    if (tasks <= 0) return;
    const uint64_t call = atomic_load_explicit(&r->call, memory_order_relaxed);
    r->fn = fn, r->state = state;
    atomic_store_explicit(&r->done, 0, memory_order_relaxed);
    atomic_store_explicit(&r->work, (CALL_TAG(call) << (2 * TASK_BITS)) | ((uint64_t)tasks << TASK_BITS),
                          memory_order_release);
    take_tasks(r, 0, call);
    while (atomic_load_explicit(&r->done, memory_order_acquire) < tasks) _mm_pause();
}

moe_runner *moe_runner_new(int threads) {
    if (threads < 1 || threads > MAX_THREADS) return NULL;
    moe_runner *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->threads = threads;
    pthread_mutex_init(&r->mutex, NULL);
    pthread_mutex_init(&r->one_call, NULL);
    pthread_cond_init(&r->wake, NULL);
    return r;
}

void moe_runner_free(moe_runner *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mutex);
    r->stop = 1;
    pthread_cond_broadcast(&r->wake);
    pthread_mutex_unlock(&r->mutex);
    if (r->own_helpers)
        for (int i = 1; i < r->threads; i++) pthread_join(r->helpers[i], NULL);
    /* a helper XLA has queued but not yet run still reads the runner: wait for it (it returns at once), but not
     * forever (at interpreter exit the pool may be gone with its queue): then the runner is left, not freed */
    for (int waited_ms = 0; atomic_load_explicit(&r->scheduled, memory_order_acquire); waited_ms++) {
        if (waited_ms == 2000) return;
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    free(r->rows.data), free(r->act.data), free(r->out.data), free(r->index.data);
    free(r->rows_q.data), free(r->act_q.data), free(r->dw_parts.data);
    for (int i = 0; i < MAX_THREADS; i++) free(r->scratch[i].data);
    pthread_mutex_destroy(&r->mutex), pthread_mutex_destroy(&r->one_call), pthread_cond_destroy(&r->wake);
    free(r);
}

int moe_runner_threads(const moe_runner *r) { return r->threads; }

/* Since the runner was made, in runner.h's order: calls; their wall time, that of the calls XLA's handler made,
 * and the threads' busy time, in ns; tokens, routed pairs, FLOPs, expert weight bytes read, bytes of inputs
 * (x, ids, weights) and of outputs (y)
 * (host_kernels/fused_forward.py names them). */
void moe_runner_totals(moe_runner *r, uint64_t *totals) {
    pthread_mutex_lock(&r->one_call);
    memcpy(totals, r->totals, sizeof r->totals);
    totals[BUSY_NANOSECONDS] = atomic_load(&r->busy_nanoseconds);
    pthread_mutex_unlock(&r->one_call);
}

