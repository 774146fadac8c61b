/* XLA FFI handler "moe_jax_process_sum": the sum over every process of an expert-parallel generation step of one
 * array each holds (its experts' share of a MoE layer's output, [rows, ...]), over TCP links to the others that
 * Python connected (moe_jax/process_links.py) and handed over with moe_jax_process_links_set. Every process gets
 * the very same bits: each adds the processes' rows in process order, in float32, rounding once. XLA's own CPU
 * collectives (gloo) took milliseconds a call on one machine; a decode step calls this once a MoE layer.
 *
 * Routed: a process sends only the rows its experts computed (the second argument, s32 [rows], says which: a
 * token none of whose top-k experts it holds has a zero row there), each with its index; where that would take
 * more bytes than every row, every row without indices. On the wire, to every other process: a header (the call's
 * sequence number, the rows, a row's bytes, the rows sent), the indices of the rows sent (s32; none when all are),
 * then those rows. Sending and receiving interleave over non-blocking sockets (poll), so two
 * processes sending each other more than a socket buffer holds do not wait on each other. A closed link, a silent
 * peer (the links' timeout) or a peer at another call fails this call and every later one, naming the process.
 * Written against XLA's C API (jaxlib's xla/ffi/api/c_api.h); moe_jax/native/ffi.py registers it.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "ffi_common.h"

#define MAX_PROCESSES 256

typedef struct {
    uint64_t sequence, rows, row_bytes, sent_rows;
} link_header;

typedef struct { /* one peer's transfer in each direction */
    link_header in_header;
    size_t sent, received, in_whole; /* bytes of header + indices + rows so far; the incoming total once known */
    char *in;                        /* where its indices and rows arrive */
} transfer;

static struct {
    pthread_mutex_t lock;
    int rank, count, timeout_ms;
    int fds[MAX_PROCESSES]; /* fds[rank] unused */
    uint64_t sequence, bytes_sent, dense_bytes;
    char *buffer; /* this process's message, then each other process's, one after another */
    size_t capacity;
    char broken[256]; /* why the links are unusable ("" while they are fine) */
} links = {PTHREAD_MUTEX_INITIALIZER, -1, 0, 0, {0}, 0, 0, 0, NULL, 0, ""};

static int fail(const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(links.broken, sizeof links.broken, format, args);
    va_end(args);
    return -1;
}

static void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK); }

/* Takes the links of process `rank` of `count`: fds[p] is the connected socket to process p (fds[rank] ignored),
 * set non-blocking here; `timeout_ms` how long a call waits on a silent peer. Returns 0, or -1 for bad arguments. */
int moe_jax_process_links_set(int rank, int count, const int *fds, int timeout_ms) {
    if (count < 2 || count > MAX_PROCESSES || rank < 0 || rank >= count || timeout_ms < 1) return -1;
    pthread_mutex_lock(&links.lock);
    links.rank = rank;
    links.count = count;
    links.timeout_ms = timeout_ms;
    links.sequence = links.bytes_sent = links.dense_bytes = 0;
    links.broken[0] = 0;
    for (int p = 0; p < count; p++) {
        links.fds[p] = fds[p];
        if (p != rank) set_nonblocking(fds[p]);
    }
    pthread_mutex_unlock(&links.lock);
    return 0;
}

/* Forgets the links (their sockets stay the caller's to close); the counts stay readable. */
void moe_jax_process_links_clear(void) {
    pthread_mutex_lock(&links.lock);
    links.rank = -1;
    links.count = 0;
    free(links.buffer);
    links.buffer = NULL;
    links.capacity = 0;
    pthread_mutex_unlock(&links.lock);
}

/* The sums made over the links so far, the bytes this process sent for them, and the bytes it would have sent
 * had every row gone to every process (bench/distributed.py compares the two). */
uint64_t moe_jax_process_links_calls(void) { return links.sequence; }
uint64_t moe_jax_process_links_bytes_sent(void) { return links.bytes_sent; }
uint64_t moe_jax_process_links_dense_bytes(void) { return links.dense_bytes; }

static int64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* The indices a message's rows carry: none where it holds every row (in order). */
static size_t index_bytes(uint64_t sent_rows, uint64_t rows) { return sent_rows == rows ? 0 : 4 * sent_rows; }

/* Copies the header out of or into a transfer's first bytes, or the message's rest from or to `body`. */
static char *at(char *header, char *body, size_t offset) {
    return offset < sizeof(link_header) ? header + offset : body + (offset - sizeof(link_header));
}

/* Sends `out` (header + its `out_whole - header` bytes of indices and rows) to every other process and receives
 * each one's into t[p].in; 0, or -1 with links.broken saying why. */
static int exchange(link_header *out_header, const char *out_body, size_t out_whole, transfer *t, uint64_t rows,
                    uint64_t row_bytes) {
    const int count = links.count, rank = links.rank;
    struct pollfd polled[MAX_PROCESSES];
    int peers[MAX_PROCESSES];
    int64_t last_progress = now_ms();
    for (;;) {
        int n = 0;
        for (int p = 0; p < count; p++) {
            if (p == rank) continue;
            const short events = (t[p].sent < out_whole ? POLLOUT : 0) | (t[p].received < t[p].in_whole ? POLLIN : 0);
            if (!events) continue;
            polled[n] = (struct pollfd){links.fds[p], events, 0};
            peers[n++] = p;
        }
        if (!n) return 0;
        const int ready = poll(polled, n, 1000);
        if (ready < 0 && errno != EINTR) return fail("poll on the links failed (errno %d)", errno);
        if (ready <= 0) {
            if (now_ms() - last_progress > links.timeout_ms)
                return fail("process %d of %d did not answer for %d s (call %llu)", peers[0], count,
                            links.timeout_ms / 1000, (unsigned long long)links.sequence);
            continue;
        }
        for (int i = 0; i < n; i++) {
            const int p = peers[i];
            transfer *x = &t[p];
            if (polled[i].revents & (POLLERR | POLLHUP | POLLNVAL) && !(polled[i].revents & POLLIN))
                return fail("process %d of %d closed its link (it has stopped: see its output)", p, count);
            if (polled[i].revents & POLLOUT && x->sent < out_whole) {
                const size_t left = (x->sent < sizeof(link_header) ? sizeof(link_header) : out_whole) - x->sent;
                const ssize_t w =
                    send(links.fds[p], at((char *)out_header, (char *)out_body, x->sent), left, MSG_NOSIGNAL);
                if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                    return fail("process %d of %d closed its link (send: errno %d)", p, count, errno);
                if (w > 0) x->sent += (size_t)w, last_progress = now_ms();
            }
            if (polled[i].revents & POLLIN && x->received < x->in_whole) {
                const size_t left = (x->received < sizeof(link_header) ? sizeof(link_header) : x->in_whole) - x->received;
                const ssize_t r = recv(links.fds[p], at((char *)&x->in_header, x->in, x->received), left, 0);
                if (r == 0) return fail("process %d of %d closed its link (it has stopped: see its output)", p, count);
                if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                    return fail("process %d of %d closed its link (recv: errno %d)", p, count, errno);
                if (r <= 0) continue;
                x->received += (size_t)r, last_progress = now_ms();
                if (x->received == sizeof(link_header)) {
                    const link_header *h = &x->in_header;
                    if (h->sequence != links.sequence || h->rows != rows || h->row_bytes != row_bytes ||
                        h->sent_rows > rows)
                        return fail("process %d of %d is out of step: its call %llu of %llu rows, ours %llu of %llu", p,
                                    count, (unsigned long long)h->sequence, (unsigned long long)h->rows,
                                    (unsigned long long)links.sequence, (unsigned long long)rows);
                    x->in_whole = sizeof(link_header) + index_bytes(h->sent_rows, rows) + h->sent_rows * row_bytes;
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

/* sum[0..m) += (or =, when `first`) a row of m values */
static void accumulate(float *sum, const char *row, int64_t m, int bf16, int first) {
    if (bf16) {
        const uint16_t *h = (const uint16_t *)row;
        for (int64_t i = 0; i < m; i++) sum[i] = first ? bf16_to_f32(h[i]) : sum[i] + bf16_to_f32(h[i]);
    } else {
        const float *f = (const float *)row;
        for (int64_t i = 0; i < m; i++) sum[i] = first ? f[i] : sum[i] + f[i];
    }
}

/* y = the processes' rows added in process order, each process's message (indices, then rows) in t[p].in
 * (this process's own rows are read from x); a row no process sent is zero. */
static void add_in_order(const char *x, char *y, const transfer *t, uint64_t rows, int64_t width, int bf16,
                         float *sum) {
    const size_t row_bytes = (size_t)width * (bf16 ? 2 : 4);
    memset(y, 0, rows * row_bytes);
    int64_t next[MAX_PROCESSES] = {0}; /* each process's next row sent (rows are sent in order) */
    for (uint64_t r = 0; r < rows; r++) {
        int first = 1;
        for (int p = 0; p < links.count; p++) {
            const uint64_t sent = t[p].in_header.sent_rows;
            const int32_t *indices = (const int32_t *)t[p].in;
            const int every = sent == rows;
            if (next[p] >= (int64_t)sent || (!every && (uint64_t)indices[next[p]] != r)) continue;
            const char *row =
                p == links.rank ? x + r * row_bytes : t[p].in + index_bytes(sent, rows) + next[p] * row_bytes;
            accumulate(sum, row, width, bf16, first);
            first = 0;
            next[p]++;
        }
        if (first) continue; /* no process's experts computed this row */
        if (bf16)
            for (int64_t i = 0; i < width; i++) ((uint16_t *)(y + r * row_bytes))[i] = f32_to_bf16(sum[i]);
        else
            memcpy(y + r * row_bytes, sum, row_bytes);
    }
}

/* The call's work under the links' lock: 0, or -1 with links.broken saying why. */
static int sum_over_links(const char *x, const int32_t *touched, char *y, uint64_t rows, int64_t width, int bf16) {
    const uint64_t row_bytes = (uint64_t)width * (bf16 ? 2 : 4);
    const size_t message = rows * (4 + row_bytes);
    const size_t need = (size_t)links.count * message + (size_t)width * sizeof(float);
    if (links.capacity < need) {
        free(links.buffer);
        links.buffer = malloc(need);
        links.capacity = links.buffer ? need : 0;
        if (!links.buffer) return fail("out of memory for %zu bytes of the processes' rows", need);
    }
    transfer t[MAX_PROCESSES];
    for (int p = 0; p < links.count; p++)
        t[p] = (transfer){{0, 0, 0, 0}, 0, 0, sizeof(link_header), links.buffer + (size_t)p * message};
    /* this process's message: the indices of the rows its experts computed, then those rows */
    char *mine = t[links.rank].in;
    uint64_t sent_rows = 0;
    for (uint64_t r = 0; r < rows; r++)
        if (touched[r]) ((int32_t *)mine)[sent_rows++] = (int32_t)r;
    if (sent_rows * (4 + row_bytes) >= rows * row_bytes) { /* nearly every row: all of them, without indices */
        sent_rows = rows;
        memcpy(mine, x, rows * row_bytes);
    } else {
        for (uint64_t i = 0; i < sent_rows; i++)
            memcpy(mine + 4 * sent_rows + i * row_bytes, x + (size_t)((int32_t *)mine)[i] * row_bytes, row_bytes);
    }
    link_header header = {links.sequence, rows, row_bytes, sent_rows};
    t[links.rank].in_header = header;
    const size_t whole = sizeof(link_header) + index_bytes(sent_rows, rows) + sent_rows * row_bytes;
    if (exchange(&header, mine, whole, t, rows, row_bytes)) return -1;
    add_in_order(x, y, t, rows, width, bf16, (float *)(links.buffer + (size_t)links.count * message));
    links.bytes_sent += (uint64_t)(links.count - 1) * whole;
    links.dense_bytes += (uint64_t)(links.count - 1) * (sizeof(link_header) + rows * row_bytes);
    links.sequence++;
    return 0;
}

XLA_FFI_Error *moe_jax_process_sum(XLA_FFI_CallFrame *frame) {
    const XLA_FFI_Api *api = frame->api;
    if (ffi_answer_metadata(frame)) return NULL;
    if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE)
        return ffi_error(api, "moe_jax_process_sum: not the execute stage");
    if (frame->args.size != 2 || frame->rets.size != 1 || frame->args.types[0] != XLA_FFI_ArgType_BUFFER ||
        frame->args.types[1] != XLA_FFI_ArgType_BUFFER)
        return ffi_error(api, "moe_jax_process_sum takes an array and its rows' s32 flags and returns one array");
    const XLA_FFI_Buffer *x = frame->args.args[0], *touched = frame->args.args[1], *y = frame->rets.rets[0];
    if ((x->dtype != XLA_FFI_DataType_F32 && x->dtype != XLA_FFI_DataType_BF16) || y->dtype != x->dtype ||
        y->rank != x->rank || x->rank < 1 || touched->dtype != XLA_FFI_DataType_S32 || touched->rank != 1 ||
        touched->dims[0] != x->dims[0])
        return ffi_error(api, "moe_jax_process_sum: f32 or bf16 [rows, ...] and s32 [rows] -> the first's kind");
    int64_t width = 1;
    for (int64_t d = 1; d < x->rank; d++) width *= x->dims[d];
    char message[320];
    pthread_mutex_lock(&links.lock);
    if (links.count < 2) {
        pthread_mutex_unlock(&links.lock);
        return ffi_error(api, "moe_jax_process_sum: this process has no links to others (moe_jax.process_links)");
    }
    if (!links.broken[0] && sum_over_links(x->data, touched->data, y->data, (uint64_t)x->dims[0], width,
                                           x->dtype == XLA_FFI_DataType_BF16) == 0) {
        pthread_mutex_unlock(&links.lock);
        return NULL;
    }
    snprintf(message, sizeof message, "moe_jax_process_sum: %s", links.broken);
    pthread_mutex_unlock(&links.lock);
    return ffi_error(api, message);
}
