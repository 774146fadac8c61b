/* The fused forward's worker threads and buffers (runner.c). A call opens, runs phases of independent tasks on
 * every worker that joins (the caller is worker 0), and closes; see runner.c for how workers meet. */
#ifndef MOE_RUNNER_H
#define MOE_RUNNER_H
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "moe_forward.h"

#define MAX_THREADS 256
#define ALIGN 64 /* every buffer starts on a cache line */

/* what moe_runner_totals reports, in this order (host_kernels/fused_forward.py names them) */
enum {
    CALLS,
    NANOSECONDS,
    SCHEDULED_NANOSECONDS, /* of the calls given a scheduler for helpers: those XLA's FFI handler made */
    BUSY_NANOSECONDS,
    TOKENS,
    PAIRS,
    FLOPS,
    WEIGHT_BYTES,
    BYTES_IN,
    BYTES_OUT,
    TOTALS
};

typedef void (*task_fn)(void *state, int worker, int64_t task);

typedef struct {
    void *data;
    size_t bytes;
} buffer;

typedef struct {
    int threads;
    pthread_t helpers[MAX_THREADS];
    int own_helpers; /* started (on the first call that uses them) */
    pthread_mutex_t mutex;
    pthread_cond_t wake;
    int sleepers;
    _Atomic int stop;
    _Atomic uint64_t call;      /* odd while a call is open */
    _Atomic uint64_t own_call;  /* the open call's value when the runner's own threads are to join it */
    pthread_t caller;
    _Atomic int joined;         /* workers in the open call (the caller is worker 0) */
    _Atomic int scheduled;      /* helpers handed to a scheduler that have not finished: the runner outlives them */
    _Atomic uint64_t work;
    _Atomic int64_t done;
    task_fn fn;
    void *state;
    pthread_mutex_t one_call; /* calls share the buffers */
    buffer rows, act, out, index, rows_q, act_q, scratch[MAX_THREADS]; /* _q: int4 layers' int8 rows */
    buffer dw_parts; /* the fused backward's routing-weight gradient shares (moe_backward.c) */
    uint64_t totals[TOTALS];           /* over calls, read by moe_runner_totals */
    _Atomic uint64_t busy_nanoseconds; /* summed over threads */
} moe_runner;

void *runner_reserve(buffer *b, size_t bytes); /* b's memory, grown to at least `bytes` (NULL if out of memory) */
uint64_t runner_now_ns(void);
void runner_open_call(moe_runner *r, const moe_helpers *helpers); /* helpers NULL: the runner's own threads */
void runner_close_call(moe_runner *r);
/* fn(state, worker, task) for task in [0, tasks) on the call's workers; returns when all are done */
void runner_run_phase(moe_runner *r, task_fn fn, void *state, int64_t tasks);

#endif
