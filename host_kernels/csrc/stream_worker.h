/* The host side of a stream-ordered host expert call: a device stream hands a layer's activations to a host
 * worker thread and takes the result back, with no Python, no GIL and no stream synchronisation.
 *
 * The protocol, per call (a "site": one custom call in a compiled program, with its layer, shapes and slot):
 *   device side, submit:  copy x, ids, weights into the site's staging buffers; write go[slot] = site + 1
 *   host worker:          sees go, clears it, runs the layer's fused forward (moe_forward.h) on the staging
 *                         buffers, writes y there, then done[slot] = site + 1
 *   device side, sync:    wait until done[slot] == site + 1; write done[slot] = 0; copy y back
 * On a GPU (xla_cuda_host_experts.c) the device side is enqueued on XLA's stream: copies, then either stream
 * memory operations on the mapped flags (the worker polls them) or host functions that run moe_stream_post /
 * moe_stream_wait on CUDA's callback thread. On XLA:CPU (xla_stream_experts.c) and in the tests the device side
 * is host code calling the same two functions.
 *
 * Sites share STREAM_SLOTS slots (flags and staging memory); a compiled program gives its sites consecutive slots,
 * so calls in flight at once (a micro-batch pipeline's) use different ones. A site's staging pointers never change
 * once made (a captured CUDA graph replays them): a slot that needs more memory gets a new buffer and keeps the old
 * one until the worker is freed.
 *
 * Three kinds of call: a forward; a training forward that also keeps the layer's gate/up pre-activations in
 * its site (host memory, until the site's next call); and a backward (dy, ids, routing weights and the keeping
 * forward's ticket in, dx and the routing weights' gradients out, float32), which reads the pre-activations its
 * forward kept and runs the fused backward (moe_backward.c) on the backward layer its call names. A keeping
 * forward's answered ticket carries which of its site's calls it was (STREAM_TICKET): a backward whose forward's
 * site has run again since (its pre-activations overwritten) is refused, not computed from the wrong ones.
 *
 * A failed call fills y with NaN, marks its slot's status and keeps the first error (layer and message) for
 * moe_stream_take_error; the device side never waits forever: a stopped worker answers every pending go with an
 * error, and moe_stream_wait can time out.
 */
#ifndef MOE_STREAM_WORKER_H
#define MOE_STREAM_WORKER_H
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "moe_forward.h"

#define STREAM_SLOTS 8
#define STREAM_MAX_SITES 65536

enum { STREAM_FORWARD = 0, STREAM_FORWARD_KEEPING = 1, STREAM_BACKWARD = 2 }; /* a site's kind of call */
/* an answered ticket: the site, and for a keeping forward the generation of its kept pre-activations (mod 2^15) */
#define STREAM_TICKET(site, generation) ((int32_t)((site) | (((generation) & 0x7fff) << 16)))
#define STREAM_TICKET_SITE(ticket) ((ticket) & 0xffff)
#define STREAM_TICKET_GENERATION(ticket) (((ticket) >> 16) & 0x7fff)

/* One slot's flags: each on its own cache line (the device writes go and done, the worker reads them). */
typedef struct {
    _Atomic uint64_t go;   /* site + 1, written by the device side; the worker sets it back to 0 when it takes it */
    char pad0[56];
    _Atomic uint64_t done; /* the go value the worker answered; the device side resets it after its wait */
    char pad1[56];
    _Atomic int32_t status; /* of the last answered call: 0 ok, 1 failed (y is NaN), 2 the worker was stopped */
    char pad2[60];
} stream_flags;

/* Where staging memory comes from: plain host memory (NULL), or a device's mapped pinned memory. `alloc` returns
 * NULL where it cannot. */
typedef struct {
    void *(*alloc)(void *context, size_t bytes);
    void (*release)(void *context, void *memory);
    void *context;
} stream_memory;

typedef struct stream_worker stream_worker;

typedef struct {
    stream_worker *worker;
    const moe_call *call; /* a backward's: its runner and the backward layer (FusedForward's) */
    int64_t id, layer, slot, kind, tokens, hidden, top_k;
    int x_dtype, w_dtype; /* MOE_FLOAT32 or MOE_BFLOAT16 (a backward's dy and weights: float32) */
    /* staging buffers in the worker's memory: x (a backward's dy), ids, weights, y (a backward's dx); a backward's
     * also its forward's ticket (s32) and the routing weights' gradients (float32 [tokens, top_k]); every site's
     * answered ticket (s32, the sync's last result) */
    void *x, *ids, *weights, *y, *forward_ticket, *dweights, *answer;
    int64_t x_bytes, ids_bytes, weights_bytes, dweights_bytes; /* y has x_bytes */
    float *kept; /* a keeping forward's pre-activations: [tokens * top_k, 2 * ffn] at most, in host memory */
    uint32_t generation; /* a keeping forward's calls answered (the worker's) */
    uint64_t device_go, device_done; /* the flags' device addresses (set by a device handler; 0 until then) */
} stream_site;

/* A worker over `memory` (NULL: plain host memory) that spins `spin_ns` after each call before it sleeps, and
 * while asleep looks at the flags every `poll_ns` (a stream memory write cannot wake it). NULL where it cannot
 * start its thread. */
stream_worker *moe_stream_worker_new(const stream_memory *memory, int64_t spin_ns, int64_t poll_ns);
/* Stops the worker: the call it is running finishes, every other pending go is answered with status 2, and later
 * posts are answered at once with status 2. Waits for its thread. */
void moe_stream_worker_stop(stream_worker *w);
/* Stops it if running and frees it and every buffer it made; nothing may wait on it any more. */
void moe_stream_worker_free(stream_worker *w);
int moe_stream_worker_stopped(stream_worker *w);

/* The site of (call, layer, slot, kind, shapes, dtypes), made on first use: its id (>= 0), or -1 with a message. */
int64_t moe_stream_site(stream_worker *w, const moe_call *call, int64_t layer, int64_t slot, int64_t kind,
                        int64_t tokens, int64_t hidden, int64_t top_k, int x_dtype, int w_dtype, char *err,
                        int64_t err_len);
stream_site *moe_stream_site_at(stream_worker *w, int64_t site); /* NULL for an unknown id */
/* The site's staging buffers (x, ids, weights, y, forward_ticket, dweights; the last two NULL but for a backward)
 * into buffers[6]; non-zero for an unknown id. */
int moe_stream_site_staging(stream_worker *w, int64_t site, void **buffers);
stream_flags *moe_stream_flags(stream_worker *w, int64_t slot);
/* The ticket the worker answered the site's last call with (what its sync hands on; -1 for a failed call) into
 * *ticket; non-zero for an unknown id. */
int moe_stream_answer(stream_worker *w, int64_t site, int32_t *ticket);

/* The device side's two signals as host code (host functions, the XLA:CPU handlers, the tests):
 * post writes go for `site` (staging filled) and wakes the worker; wait waits until the worker answered it (at
 * most timeout_ns; < 0: until answered), resets done and returns the slot's status; -1 on a time-out, -2 for an
 * unknown site. */
void moe_stream_post(stream_worker *w, int64_t site);
int moe_stream_wait(stream_worker *w, int64_t site, int64_t timeout_ns);
/* Wakes a sleeping worker: a handler rings at enqueue time, so the worker is spinning when the go comes. */
void moe_stream_ring(stream_worker *w);

/* 1 with the layer (-1: a go that named no site of its slot) and message of the first failed call since the last
 * take, or 0 where none failed. Peek leaves it for the next take. */
int moe_stream_take_error(stream_worker *w, int64_t *layer, char *message, int64_t len);
int moe_stream_peek_error(stream_worker *w, int64_t *layer, char *message, int64_t len);

/* calls answered, failed, nanoseconds computing, sleeps (futex waits), sites made, staging bytes held */
enum {
    STREAM_CALLS,
    STREAM_FAILED,
    STREAM_BUSY_NS,
    STREAM_SLEEPS,
    STREAM_SITES,
    STREAM_STAGING_BYTES,
    STREAM_COUNTERS
};
void moe_stream_counters(stream_worker *w, uint64_t *counters);

#endif
