/* XLA FFI handler "moe_jax_process_sum": the sum over every process of an expert-parallel generation step of one
 * array each holds (its experts' share of a MoE layer's output), over TCP links to the others that Python
 * connected (moe_jax/process_links.py) and handed over with moe_jax_process_links_set. Every process gets the very
 * same bits: each adds the processes' arrays in process order, in float32, rounding once. XLA's own CPU collectives
 * (gloo) took milliseconds a call on one machine, a decode step calls this once a MoE layer.
 *
 * On the wire, to every other process: a header (the call's sequence number, the payload's bytes), then the payload.
 * Sending and receiving interleave over non-blocking sockets (poll), so two processes sending each other more than
 * a socket buffer holds do not wait on each other. A closed link, a silent peer (the links' timeout) or a peer at
 * another call fails this call and every later one, naming the process.
 * Written against XLA's C API (jaxlib's xla/ffi/api/c_api.h); moe_jax/native/ffi.py registers it.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "ffi_common.h"

#define MAX_PROCESSES 256

typedef struct {
    uint64_t sequence, bytes;
} link_header;

static struct {
    pthread_mutex_t lock;
    int rank, count, timeout_ms;
    int fds[MAX_PROCESSES]; /* fds[rank] unused */
    uint64_t sequence;
    char *buffer; /* the others' payloads, one after another */
    size_t capacity;
    char broken[256]; /* why the links are unusable ("" while they are fine) */
} links = {PTHREAD_MUTEX_INITIALIZER, -1, 0, 0, {0}, 0, NULL, 0, ""};

static int fail(const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(links.broken, sizeof links.broken, format, args);
    va_end(args);
    return -1;
}

static void fcntl_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK); }

/* Takes the links of process `rank` of `count`: fds[p] is the connected socket to process p (fds[rank] ignored),
 * set non-blocking here; `timeout_ms` how long a call waits on a silent peer. Returns 0, or -1 for bad arguments. */
int moe_jax_process_links_set(int rank, int count, const int *fds, int timeout_ms) {
    if (count < 2 || count > MAX_PROCESSES || rank < 0 || rank >= count || timeout_ms < 1) return -1;
    pthread_mutex_lock(&links.lock);
    links.rank = rank;
    links.count = count;
    links.timeout_ms = timeout_ms;
    links.sequence = 0;
    links.broken[0] = 0;
    for (int p = 0; p < count; p++) {
        links.fds[p] = fds[p];
        if (p != rank) fcntl_nonblocking(fds[p]);
    }
    pthread_mutex_unlock(&links.lock);
    return 0;
}

/* Forgets the links (their sockets stay the caller's to close). */
void moe_jax_process_links_clear(void) {
    pthread_mutex_lock(&links.lock);
    links.rank = -1;
    links.count = 0;
    free(links.buffer);
    links.buffer = NULL;
    links.capacity = 0;
    pthread_mutex_unlock(&links.lock);
}

/* The calls made over the links so far (a test checks every process made the same number). */
uint64_t moe_jax_process_links_calls(void) { return links.sequence; }

typedef struct { /* one peer's transfer in each direction */
    link_header out_header, in_header;
    size_t sent, received; /* bytes of header + payload so far */
} transfer;

static int64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* Sends `mine` (`bytes`) to every other process and receives each one's into links.buffer; 0, or -1 with
 * links.broken saying why. */
static int exchange(const char *mine, size_t bytes) {
    const int count = links.count, rank = links.rank;
    transfer t[MAX_PROCESSES];
    struct pollfd polled[MAX_PROCESSES];
    const size_t whole = sizeof(link_header) + bytes;
    for (int p = 0; p < count; p++) {
        t[p] = (transfer){{links.sequence, bytes}, {0, 0}, p == rank ? whole : 0, p == rank ? whole : 0};
    }
    int64_t last_progress = now_ms();
    for (;;) {
        int n = 0, peers[MAX_PROCESSES];
        for (int p = 0; p < count; p++) {
            short events = (t[p].sent < whole ? POLLOUT : 0) | (t[p].received < whole ? POLLIN : 0);
            if (!events) continue;
            polled[n] = (struct pollfd){links.fds[p], events, 0};
            peers[n++] = p;
        }
        if (!n) return 0;
        const int ready = poll(polled, n, 1000);
        if (ready < 0 && errno != EINTR) return fail("poll on the links failed (errno %d)", errno);
        if (ready <= 0) {
            if (now_ms() - last_progress > links.timeout_ms) {
                for (int i = 0; i < n; i++)
                    if (t[peers[i]].received < whole)
                        return fail("process %d of %d sent nothing for %d s (call %llu)", peers[i], count,
                                    links.timeout_ms / 1000, (unsigned long long)links.sequence);
                return fail("process %d of %d took nothing for %d s (call %llu)", peers[0], count, links.timeout_ms / 1000,
                            (unsigned long long)links.sequence);
            }
            continue;
        }
        for (int i = 0; i < n; i++) {
            const int p = peers[i];
            transfer *x = &t[p];
            if (polled[i].revents & (POLLERR | POLLHUP | POLLNVAL) && !(polled[i].revents & POLLIN))
                return fail("process %d of %d closed its link (it has stopped: see its output)", p, count);
            if (polled[i].revents & POLLOUT && x->sent < whole) {
                const char *from = x->sent < sizeof(link_header) ? (const char *)&x->out_header + x->sent
                                                                  : mine + (x->sent - sizeof(link_header));
                const size_t left = x->sent < sizeof(link_header) ? sizeof(link_header) - x->sent : whole - x->sent;
                const ssize_t w = send(links.fds[p], from, left, MSG_NOSIGNAL);
                if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                    return fail("process %d of %d closed its link (send: errno %d)", p, count, errno);
                if (w > 0) x->sent += (size_t)w, last_progress = now_ms();
            }
            if (polled[i].revents & POLLIN && x->received < whole) {
                const int slot = p < rank ? p : p - 1;
                char *to = x->received < sizeof(link_header)
                               ? (char *)&x->in_header + x->received
                               : links.buffer + (size_t)slot * bytes + (x->received - sizeof(link_header));
                const size_t left =
                    x->received < sizeof(link_header) ? sizeof(link_header) - x->received : whole - x->received;
                const ssize_t r = recv(links.fds[p], to, left, 0);
                if (r == 0) return fail("process %d of %d closed its link (it has stopped: see its output)", p, count);
                if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                    return fail("process %d of %d closed its link (recv: errno %d)", p, count, errno);
                if (r > 0) {
                    x->received += (size_t)r, last_progress = now_ms();
                    if (x->received == sizeof(link_header) &&
                        (x->in_header.sequence != links.sequence || x->in_header.bytes != bytes))
                        return fail("process %d of %d is out of step: its call %llu of %llu bytes, ours %llu of %zu", p,
                                    count, (unsigned long long)x->in_header.sequence,
                                    (unsigned long long)x->in_header.bytes, (unsigned long long)links.sequence, bytes);
                }
            }
        }
    }
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as XLA's convert; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static const char *payload(const void *mine, int p, size_t bytes) {
    return p == links.rank ? (const char *)mine : links.buffer + (size_t)(p < links.rank ? p : p - 1) * bytes;
}

/* out = the processes' arrays added in process order (`mine` is this process's), in float32 chunks of 1024. */
static void add_in_order(const void *mine, void *out, int64_t n, int bf16) {
    const size_t bytes = (size_t)n * (bf16 ? 2 : 4);
    float sum[1024];
    for (int64_t start = 0; start < n; start += 1024) {
        const int64_t m = n - start < 1024 ? n - start : 1024;
        for (int p = 0; p < links.count; p++) {
            const char *from = payload(mine, p, bytes);
            if (bf16) {
                const uint16_t *h = (const uint16_t *)from + start;
                for (int64_t i = 0; i < m; i++) sum[i] = p ? sum[i] + bf16_to_f32(h[i]) : bf16_to_f32(h[i]);
            } else {
                const float *f = (const float *)from + start;
                for (int64_t i = 0; i < m; i++) sum[i] = p ? sum[i] + f[i] : f[i];
            }
        }
        if (bf16)
            for (int64_t i = 0; i < m; i++) ((uint16_t *)out)[start + i] = f32_to_bf16(sum[i]);
        else
            memcpy((float *)out + start, sum, (size_t)m * 4);
    }
}

XLA_FFI_Error *moe_jax_process_sum(XLA_FFI_CallFrame *frame) {
    const XLA_FFI_Api *api = frame->api;
    if (ffi_answer_metadata(frame)) return NULL;
    if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE)
        return ffi_error(api, "moe_jax_process_sum: not the execute stage");
    if (frame->args.size != 1 || frame->rets.size != 1 || frame->args.types[0] != XLA_FFI_ArgType_BUFFER)
        return ffi_error(api, "moe_jax_process_sum takes one array and returns one");
    const XLA_FFI_Buffer *x = frame->args.args[0], *y = frame->rets.rets[0];
    if ((x->dtype != XLA_FFI_DataType_F32 && x->dtype != XLA_FFI_DataType_BF16) || y->dtype != x->dtype ||
        y->rank != x->rank)
        return ffi_error(api, "moe_jax_process_sum: an f32 or bf16 array -> the same expected");
    int64_t n = 1;
    for (int64_t d = 0; d < x->rank; d++) n *= x->dims[d];
    const int bf16 = x->dtype == XLA_FFI_DataType_BF16;
    const size_t bytes = (size_t)n * (bf16 ? 2 : 4);
    char message[320];
    pthread_mutex_lock(&links.lock);
    if (links.count < 2) {
        pthread_mutex_unlock(&links.lock);
        return ffi_error(api, "moe_jax_process_sum: this process has no links to others (moe_jax.process_links)");
    }
    if (!links.broken[0] && links.capacity < bytes * (links.count - 1)) {
        free(links.buffer);
        links.capacity = bytes * (links.count - 1);
        links.buffer = malloc(links.capacity);
        if (!links.buffer) links.capacity = 0, snprintf(links.broken, sizeof links.broken, "out of memory");
    }
    if (!links.broken[0] && exchange(x->data, bytes) == 0) {
        add_in_order(x->data, y->data, n, bf16);
        links.sequence++;
        pthread_mutex_unlock(&links.lock);
        return NULL;
    }
    snprintf(message, sizeof message, "moe_jax_process_sum: %s", links.broken);
    pthread_mutex_unlock(&links.lock);
    return ffi_error(api, message);
}
