/* The host worker of stream-ordered host expert calls (stream_worker.h has the protocol).
 *
 * One thread a worker. It is also the first of the fused forward's workers while a call runs (moe_forward with the
 * runner's own helpers), so it polls only between calls: it spins `spin_ns` after each call (the next layer's go
 * comes within a step), then sleeps on a futex that posts and handlers ring, waking every `poll_ns` to look at the
 * flags a stream memory write may have set without ringing. Plain C and atomics: no CUDA, no instruction set.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include "stream_worker.h"

#include "moe_call.h"

#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define WORKER_NAME "moe-stream-host" /* what `top -H` shows */
#define IDLE_BACKOFF_NS 100000000     /* idle this long, the worker looks at the flags ten times less often */
#define WAIT_SPINS 4096               /* a waiter's pauses before it sleeps */
#define WAIT_SLEEP_CAP_NS 10000000    /* a sleeping waiter looks again at least this often */
#define SITE_TABLE (2 * STREAM_MAX_SITES) /* open addressing, at most half full */
#define STAGING_ALIGN 64

typedef struct retired {
    void *memory;
    struct retired *next;
} retired;

struct stream_worker {
    stream_flags *flags; /* [STREAM_SLOTS], in `memory` (a device writes them) */
    stream_memory memory;
    void *slot_buffer[STREAM_SLOTS];
    size_t slot_bytes[STREAM_SLOTS];
    retired *old; /* buffers a larger one replaced: sites made before still point into them */
    stream_site **sites; /* [STREAM_MAX_SITES] */
    int32_t *table;      /* [SITE_TABLE]: site id + 1 by key hash, 0 empty */
    _Atomic int64_t site_count;
    pthread_mutex_t lock; /* making sites, the kept error */
    pthread_t thread;
    int started;
    _Atomic int stop;
    _Atomic uint32_t doorbell, sleeping; /* futex: posts and handlers ring it while the worker sleeps */
    _Atomic uint32_t answers, waiters;   /* futex: bumped at each answer while waiters sleep on it */
    int64_t spin_ns, poll_ns;
    int has_error;
    int64_t error_layer;
    char error[256];
    _Atomic uint64_t counters[STREAM_COUNTERS];
};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *word, uint32_t seen, int64_t timeout_ns) {
    struct timespec ts = {timeout_ns / 1000000000, timeout_ns % 1000000000};
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, seen, &ts, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static void *plain_alloc(void *context, size_t bytes) {
    (void)context;
    return aligned_alloc(STAGING_ALIGN, (bytes + STAGING_ALIGN - 1) / STAGING_ALIGN * STAGING_ALIGN);
}

static void plain_release(void *context, void *memory) {
    (void)context;
    free(memory);
}

static int64_t element_bytes(int dtype) { return dtype == MOE_BFLOAT16 ? 2 : 4; }
static int64_t aligned(int64_t bytes) { return (bytes + STAGING_ALIGN - 1) / STAGING_ALIGN * STAGING_ALIGN; }

/* --- the kept error */

static void keep_error(stream_worker *w, int64_t layer, const char *message) {
    pthread_mutex_lock(&w->lock);
    if (!w->has_error) {
        w->has_error = 1, w->error_layer = layer;
        snprintf(w->error, sizeof w->error, "%s", message);
    }
    pthread_mutex_unlock(&w->lock);
}

static int read_error(stream_worker *w, int64_t *layer, char *message, int64_t len, int take) {
    pthread_mutex_lock(&w->lock);
    const int had = w->has_error;
    if (had) {
        *layer = w->error_layer;
        if (len > 0) snprintf(message, (size_t)len, "%s", w->error);
        if (take) w->has_error = 0;
    }
    pthread_mutex_unlock(&w->lock);
    return had;
}

int moe_stream_take_error(stream_worker *w, int64_t *layer, char *message, int64_t len) {
    return read_error(w, layer, message, len, 1);
}

int moe_stream_peek_error(stream_worker *w, int64_t *layer, char *message, int64_t len) {
    return read_error(w, layer, message, len, 0);
}

/* --- the worker thread */

static void answer(stream_worker *w, int64_t slot, uint64_t value, int status) {
    atomic_store_explicit(&w->flags[slot].status, status, memory_order_relaxed);
    atomic_store_explicit(&w->flags[slot].done, value, memory_order_release);
    atomic_fetch_add(&w->answers, 1);
    if (atomic_load(&w->waiters)) futex_wake_all(&w->answers);
}

/* y (and a backward's dweights) of a failed call: NaN, so that nothing downstream mistakes it for a result */
static void fill_nan(const stream_site *site) {
    const int64_t values = site->tokens * site->hidden;
    if (site->x_dtype == MOE_BFLOAT16)
        for (int64_t i = 0; i < values; i++) ((uint16_t *)site->y)[i] = 0x7fc0;
    else
        for (int64_t i = 0; i < values; i++) ((uint32_t *)site->y)[i] = 0x7fc00000u;
    for (int64_t i = 0; site->dweights && i < site->tokens * site->top_k; i++)
        ((uint32_t *)site->dweights)[i] = 0x7fc00000u;
}

/* A backward: the fused backward over what its forward (named by the staged ticket) kept. */
static int run_backward(stream_worker *w, const stream_site *site, char *message, int64_t len) {
    const int32_t ticket = *(const int32_t *)site->forward_ticket;
    const stream_site *f = ticket < 0 ? NULL : moe_stream_site_at(w, STREAM_TICKET_SITE(ticket));
    if (!f || f->kind != STREAM_FORWARD_KEEPING || f->layer != site->layer || f->tokens != site->tokens ||
        f->top_k != site->top_k) {
        snprintf(message, (size_t)len, "the backward's forward ticket %d names no keeping forward of this layer "
                 "and shape", ticket);
        return 1;
    }
    if ((int32_t)(f->generation & 0x7fff) != STREAM_TICKET_GENERATION(ticket)) {
        snprintf(message, (size_t)len, "the pre-activations its forward kept were overwritten: that forward ran "
                 "again before this backward (call %u, the backward's is %d)", f->generation & 0x7fff,
                 STREAM_TICKET_GENERATION(ticket));
        return 1;
    }
    const moe_call *call = site->call;
    return moe_backward(call->runner, call->layer, site->x, site->ids, site->weights, f->kept, site->tokens,
                        site->hidden, site->top_k, site->y, site->dweights, message, len) != 0;
}

static int run(stream_worker *w, const stream_site *site, char *message, int64_t len) {
    const moe_call *call = site->call;
    if (site->kind == STREAM_BACKWARD) return run_backward(w, site, message, len);
    if (site->kind == STREAM_FORWARD_KEEPING)
        return moe_forward_keeping(call->runner, call->layer, site->x, site->x_dtype, site->ids, site->weights,
                                   site->w_dtype, site->tokens, site->hidden, site->top_k, site->y, site->kept,
                                   message, len) != 0;
    return call->forward(call->runner, call->layer, site->x, site->x_dtype, site->ids, site->weights, site->w_dtype,
                         site->tokens, site->hidden, site->top_k, site->y, NULL, message, len) != 0;
}

static void serve(stream_worker *w, int64_t slot, uint64_t value) {
    stream_site *site = moe_stream_site_at(w, (int64_t)value - 1);
    char message[256] = "";
    int status = 1;
    if (!site || site->slot != slot) {
        snprintf(message, sizeof message, "a go on slot %lld names site %lld, which is not one of that slot's",
                 (long long)slot, (long long)value - 1);
    } else {
        const uint64_t start = now_ns();
        status = run(w, site, message, sizeof message);
        atomic_fetch_add_explicit(&w->counters[STREAM_BUSY_NS], now_ns() - start, memory_order_relaxed);
    }
    const int own = site && site->slot == slot; /* else the site is another slot's: its buffers may be in use */
    if (own) { /* the ticket the sync hands on: a keeping forward's names its call; a failed call's none (-1) */
        if (!status && site->kind == STREAM_FORWARD_KEEPING) site->generation++;
        *(int32_t *)site->answer = status ? -1 : STREAM_TICKET(site->id, site->generation);
    }
    if (status) {
        if (own) fill_nan(site);
        keep_error(w, own ? site->layer : -1, message);
        atomic_fetch_add_explicit(&w->counters[STREAM_FAILED], 1, memory_order_relaxed);
    }
    atomic_fetch_add_explicit(&w->counters[STREAM_CALLS], 1, memory_order_relaxed);
    answer(w, slot, value, status);
}

/* The first slot from `from` on whose go is set (its value in *value), or -1. */
static int64_t find_go(stream_worker *w, int64_t from, uint64_t *value) {
    for (int64_t i = 0; i < STREAM_SLOTS; i++) {
        const int64_t slot = (from + i) % STREAM_SLOTS;
        const uint64_t v = atomic_load_explicit(&w->flags[slot].go, memory_order_acquire);
        if (v) {
            *value = v;
            return slot;
        }
    }
    return -1;
}

/* Answers every pending go with status 2 (the worker is stopping, or stopped before the go came). */
static void answer_pending_as_stopped(stream_worker *w) {
    for (int64_t slot = 0; slot < STREAM_SLOTS; slot++) {
        const uint64_t value = atomic_exchange(&w->flags[slot].go, 0);
        if (value) answer(w, slot, value, 2);
    }
}

static void *worker_main(void *data) {
    stream_worker *w = data;
    int64_t next = 0; /* slots are taken in turn: a program's sites have consecutive ones */
    uint64_t last_call = now_ns();
    for (int spins = 0;;) {
        uint64_t value;
        const int64_t slot = find_go(w, next, &value);
        if (slot >= 0) {
            /* taken by exchange: a post that finds the worker stopped answers its own go (moe_stream_post) */
            if (atomic_exchange(&w->flags[slot].go, 0) == value) serve(w, slot, value);
            next = (slot + 1) % STREAM_SLOTS, last_call = now_ns(), spins = 0;
            continue;
        }
        if (atomic_load(&w->stop)) break;
        if (++spins % 64 || now_ns() - last_call < (uint64_t)w->spin_ns) {
            _mm_pause();
            continue;
        }
        const uint32_t bell = atomic_load(&w->doorbell);
        atomic_store(&w->sleeping, 1);
        if (find_go(w, next, &value) < 0 && !atomic_load(&w->stop)) {
            atomic_fetch_add_explicit(&w->counters[STREAM_SLEEPS], 1, memory_order_relaxed);
            const uint64_t idle = now_ns() - last_call;
            futex_wait(&w->doorbell, bell, idle < IDLE_BACKOFF_NS ? w->poll_ns : 10 * w->poll_ns);
        }
        atomic_store(&w->sleeping, 0);
        if (atomic_load(&w->doorbell) != bell) last_call = now_ns(); /* rung: a call is coming, spin for it */
    }
    answer_pending_as_stopped(w);
    return NULL;
}

stream_worker *moe_stream_worker_new(const stream_memory *memory, int64_t spin_ns, int64_t poll_ns) {
    if (spin_ns < 0 || poll_ns < 1000 || poll_ns > 1000000000) return NULL;
    stream_worker *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->memory = memory ? *memory : (stream_memory){plain_alloc, plain_release, NULL};
    w->spin_ns = spin_ns, w->poll_ns = poll_ns;
    pthread_mutex_init(&w->lock, NULL);
    w->sites = calloc(STREAM_MAX_SITES, sizeof *w->sites);
    w->table = calloc(SITE_TABLE, sizeof *w->table);
    w->flags = w->memory.alloc(w->memory.context, STREAM_SLOTS * sizeof(stream_flags));
    if (w->flags) memset(w->flags, 0, STREAM_SLOTS * sizeof(stream_flags));
    if (!w->sites || !w->table || !w->flags || pthread_create(&w->thread, NULL, worker_main, w)) {
        moe_stream_worker_free(w);
        return NULL;
    }
    w->started = 1;
    pthread_setname_np(w->thread, WORKER_NAME);
    return w;
}

void moe_stream_worker_stop(stream_worker *w) {
    if (!w || !w->started) return;
    atomic_store(&w->stop, 1);
    moe_stream_ring(w);
    pthread_join(w->thread, NULL);
    w->started = 0;
    answer_pending_as_stopped(w); /* a go written after the worker's last look */
}

int moe_stream_worker_stopped(stream_worker *w) { return atomic_load(&w->stop); }

void moe_stream_worker_free(stream_worker *w) {
    if (!w) return;
    moe_stream_worker_stop(w);
    for (int64_t i = 0; i < atomic_load(&w->site_count); i++) {
        free(w->sites[i]->kept);
        free(w->sites[i]);
    }
    for (int slot = 0; slot < STREAM_SLOTS; slot++)
        if (w->slot_buffer[slot]) w->memory.release(w->memory.context, w->slot_buffer[slot]);
    for (retired *r = w->old, *next; r; r = next) {
        next = r->next;
        w->memory.release(w->memory.context, r->memory);
        free(r);
    }
    if (w->flags) w->memory.release(w->memory.context, w->flags);
    free(w->sites), free(w->table);
    pthread_mutex_destroy(&w->lock);
    free(w);
}

/* --- sites */

static uint64_t site_hash(const moe_call *call, int64_t layer, int64_t slot, int64_t kind, int64_t tokens,
                          int64_t hidden, int64_t top_k, int x_dtype, int w_dtype) {
    const uint64_t parts[] = {(uint64_t)(uintptr_t)call, (uint64_t)layer, (uint64_t)slot, (uint64_t)kind,
                              (uint64_t)tokens, (uint64_t)hidden, (uint64_t)top_k, (uint64_t)(x_dtype * 2 + w_dtype)};
    uint64_t h = 0x9e3779b97f4a7c15u;
    for (size_t i = 0; i < sizeof parts / sizeof *parts; i++) h = (h ^ parts[i]) * 0xff51afd7ed558ccdu, h ^= h >> 32;
    return h;
}

static int same_site(const stream_site *s, const moe_call *call, int64_t layer, int64_t slot, int64_t kind,
                     int64_t tokens, int64_t hidden, int64_t top_k, int x_dtype, int w_dtype) {
    return s->call == call && s->layer == layer && s->slot == slot && s->kind == kind && s->tokens == tokens &&
           s->hidden == hidden && s->top_k == top_k && s->x_dtype == x_dtype && s->w_dtype == w_dtype;
}

static int64_t site_error(char *err, int64_t err_len, const char *message, long long a, long long b) {
    if (err_len > 0) snprintf(err, (size_t)err_len, message, a, b);
    return -1;
}

/* The staging memory of `slot`, at least `bytes` of it (a larger buffer replaces a smaller one, which is kept:
 * sites made before point into it). Under w->lock. */
static char *slot_staging(stream_worker *w, int64_t slot, size_t bytes) {
    if (w->slot_bytes[slot] >= bytes) return w->slot_buffer[slot];
    void *buffer = w->memory.alloc(w->memory.context, bytes);
    retired *r = w->slot_buffer[slot] ? malloc(sizeof *r) : NULL;
    if (!buffer || (w->slot_buffer[slot] && !r)) {
        if (buffer) w->memory.release(w->memory.context, buffer);
        free(r);
        return NULL;
    }
    if (r) r->memory = w->slot_buffer[slot], r->next = w->old, w->old = r;
    atomic_fetch_add_explicit(&w->counters[STREAM_STAGING_BYTES], bytes, memory_order_relaxed);
    w->slot_buffer[slot] = buffer, w->slot_bytes[slot] = bytes;
    return buffer;
}

int64_t moe_stream_site(stream_worker *w, const moe_call *call, int64_t layer, int64_t slot, int64_t kind,
                        int64_t tokens, int64_t hidden, int64_t top_k, int x_dtype, int w_dtype, char *err,
                        int64_t err_len) {
    if (!call || !call->forward || !call->runner || !call->layer)
        return site_error(err, err_len, "layer %lld: no moe_call to run", (long long)layer, 0);
    if (slot < 0 || slot >= STREAM_SLOTS)
        return site_error(err, err_len, "slot %lld is not in [0, %lld)", (long long)slot, STREAM_SLOTS);
    if (kind < STREAM_FORWARD || kind > STREAM_BACKWARD)
        return site_error(err, err_len, "layer %lld: call kind %lld is not a forward, keeping forward or backward",
                          (long long)layer, (long long)kind);
    if (tokens < 0 || hidden < 1 || top_k < 1 || tokens > (1ll << 24) || hidden > (1ll << 20) || top_k > 1024)
        return site_error(err, err_len, "layer %lld: %lld tokens of that hidden size and top-k cannot be staged",
                          (long long)layer, (long long)tokens);
    if ((x_dtype != MOE_FLOAT32 && x_dtype != MOE_BFLOAT16) || (w_dtype != MOE_FLOAT32 && w_dtype != MOE_BFLOAT16))
        return site_error(err, err_len, "dtype codes %lld and %lld: activations and routing weights are float32 "
                          "or bfloat16", x_dtype, w_dtype);
    if (kind == STREAM_BACKWARD && (x_dtype != MOE_FLOAT32 || w_dtype != MOE_FLOAT32))
        return site_error(err, err_len, "layer %lld: a backward takes float32 dy and routing weights", (long long)layer,
                          0);
    if (atomic_load(&w->stop))
        return site_error(err, err_len, "layer %lld: the host worker was stopped", (long long)layer, 0);
    pthread_mutex_lock(&w->lock);
    const uint64_t hash = site_hash(call, layer, slot, kind, tokens, hidden, top_k, x_dtype, w_dtype);
    int64_t at = (int64_t)(hash % SITE_TABLE);
    for (; w->table[at]; at = (at + 1) % SITE_TABLE) {
        const stream_site *s = w->sites[w->table[at] - 1];
        if (same_site(s, call, layer, slot, kind, tokens, hidden, top_k, x_dtype, w_dtype)) {
            pthread_mutex_unlock(&w->lock);
            return s->id;
        }
    }
    const int64_t id = atomic_load(&w->site_count);
    const int backward = kind == STREAM_BACKWARD;
    const int64_t x_bytes = tokens * hidden * element_bytes(x_dtype), ids_bytes = tokens * top_k * 4;
    const int64_t weights_bytes = tokens * top_k * element_bytes(w_dtype);
    const int64_t dweights_bytes = backward ? tokens * top_k * 4 : 0, ticket_bytes = backward ? 4 : 0;
    const int64_t bytes = 2 * aligned(x_bytes) + aligned(ids_bytes) + aligned(weights_bytes) +
                          aligned(ticket_bytes) + aligned(dweights_bytes) + aligned(4); /* the answered ticket */
    const int64_t ffn = ((const moe_layer *)call->layer)->ffn;
    stream_site *site = id < STREAM_MAX_SITES ? calloc(1, sizeof *site) : NULL;
    float *kept = site && kind == STREAM_FORWARD_KEEPING ? malloc((size_t)(tokens * top_k * 2 * ffn + 1) * 4) : NULL;
    char *staging = site && (kept || kind != STREAM_FORWARD_KEEPING) ? slot_staging(w, slot, (size_t)bytes) : NULL;
    if (!staging) {
        pthread_mutex_unlock(&w->lock);
        free(site), free(kept);
        return site_error(err, err_len,
                          id < STREAM_MAX_SITES ? "layer %lld: out of staging memory for %lld bytes"
                                                : "layer %lld: more than the %lld call sites a worker keeps",
                          (long long)layer, id < STREAM_MAX_SITES ? bytes : STREAM_MAX_SITES);
    }
    site->worker = w, site->call = call, site->id = id, site->layer = layer, site->slot = slot, site->kind = kind;
    site->tokens = tokens, site->hidden = hidden, site->top_k = top_k, site->x_dtype = x_dtype, site->w_dtype = w_dtype;
    site->x = staging, site->ids = staging + aligned(x_bytes);
    site->weights = (char *)site->ids + aligned(ids_bytes), site->y = (char *)site->weights + aligned(weights_bytes);
    if (backward) {
        site->forward_ticket = (char *)site->y + aligned(x_bytes);
        site->dweights = (char *)site->forward_ticket + aligned(ticket_bytes);
    }
    site->answer = (char *)site->y + aligned(x_bytes) + aligned(ticket_bytes) + aligned(dweights_bytes);
    site->x_bytes = x_bytes, site->ids_bytes = ids_bytes, site->weights_bytes = weights_bytes;
    site->dweights_bytes = dweights_bytes, site->kept = kept;
    w->sites[id] = site;
    w->table[at] = (int32_t)id + 1;
    atomic_store_explicit(&w->site_count, id + 1, memory_order_release);
    atomic_fetch_add_explicit(&w->counters[STREAM_SITES], 1, memory_order_relaxed);
    pthread_mutex_unlock(&w->lock);
    return id;
}

stream_site *moe_stream_site_at(stream_worker *w, int64_t site) {
    if (site < 0 || site >= atomic_load_explicit(&w->site_count, memory_order_acquire)) return NULL;
    return w->sites[site];
}

int moe_stream_site_staging(stream_worker *w, int64_t site, void **buffers) {
    const stream_site *s = moe_stream_site_at(w, site);
    if (!s) return 1;
    buffers[0] = s->x, buffers[1] = s->ids, buffers[2] = s->weights, buffers[3] = s->y;
    buffers[4] = s->forward_ticket, buffers[5] = s->dweights;
    return 0;
}

int moe_stream_answer(stream_worker *w, int64_t site, int32_t *ticket) {
    const stream_site *s = moe_stream_site_at(w, site);
    if (!s) return 1;
    *ticket = *(const int32_t *)s->answer;
    return 0;
}

stream_flags *moe_stream_flags(stream_worker *w, int64_t slot) {
    return slot >= 0 && slot < STREAM_SLOTS ? &w->flags[slot] : NULL;
}

/* --- the device side's signals, as host code */

void moe_stream_ring(stream_worker *w) {
    atomic_fetch_add(&w->doorbell, 1);
    if (atomic_load(&w->sleeping)) futex_wake_all(&w->doorbell);
}

void moe_stream_post(stream_worker *w, int64_t site_id) {
    const stream_site *site = moe_stream_site_at(w, site_id);
    if (!site) return; /* the wait that follows says so (-2) */
    stream_flags *f = &w->flags[site->slot];
    atomic_store(&f->go, (uint64_t)site_id + 1);
    if (atomic_load(&w->stop)) { /* nobody will take it: answer it here, unless the worker's last look did */
        const uint64_t value = atomic_exchange(&f->go, 0);
        if (value) answer(w, site->slot, value, 2);
        return;
    }
    moe_stream_ring(w);
}

int moe_stream_wait(stream_worker *w, int64_t site_id, int64_t timeout_ns) {
    const stream_site *site = moe_stream_site_at(w, site_id);
    if (!site) return -2;
    stream_flags *f = &w->flags[site->slot];
    const uint64_t value = (uint64_t)site_id + 1, start = now_ns();
    for (int spins = 0; atomic_load_explicit(&f->done, memory_order_acquire) != value;) {
        if (++spins < WAIT_SPINS) {
            _mm_pause();
            continue;
        }
        const int64_t waited = (int64_t)(now_ns() - start);
        if (timeout_ns >= 0 && waited >= timeout_ns) return -1;
        const uint32_t seen = atomic_load(&w->answers);
        atomic_fetch_add(&w->waiters, 1);
        if (atomic_load(&f->done) != value) {
            const int64_t left = timeout_ns >= 0 ? timeout_ns - waited : WAIT_SLEEP_CAP_NS;
            futex_wait(&w->answers, seen, left < WAIT_SLEEP_CAP_NS ? left : WAIT_SLEEP_CAP_NS);
        }
        atomic_fetch_sub(&w->waiters, 1);
    }
    const int status = atomic_load_explicit(&f->status, memory_order_relaxed);
    atomic_store_explicit(&f->done, 0, memory_order_release);
    return status;
}

void moe_stream_counters(stream_worker *w, uint64_t *counters) {
    for (int i = 0; i < STREAM_COUNTERS; i++) counters[i] = atomic_load(&w->counters[i]);
}
