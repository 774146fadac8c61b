/* The one entry point of the fused host expert forward (moe_forward.c) that other libraries call: XLA's FFI
 * handler (host_kernels/csrc/xla_host_experts.c) receives the address of a `moe_call` and calls through it, so it
 * needs neither this library's symbols nor its private structs.
 */
#ifndef MOE_FORWARD_H
#define MOE_FORWARD_H
#include <stdint.h>

enum { MOE_FLOAT32 = 0, MOE_BFLOAT16 = 1 }; /* activations' and routing weights' dtypes */
/* a layer's GEMM kernel: a code of the kernel table (kernel_table.h) */

/* Where a call's helper threads come from: `schedule(context, task, data)` has task(data) run on another thread
 * (XLA's thread pool, for the FFI handler), at most `count` times; it returns non-zero if it cannot. A forward
 * given NULL uses the runner's own threads. A scheduled helper that starts late or never only costs its share of
 * the work. */
typedef struct {
    int (*schedule)(void *context, void (*task)(void *), void *data);
    void *context;
    int count;
} moe_helpers;

/* y[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for one layer. x and y: [tokens, hidden] in `x_dtype`
 * (hidden must be the layer's);
 * ids: int32 [tokens, top_k], -1 for a pair computed elsewhere (it adds nothing here); weights: [tokens, top_k] in `w_dtype`. Returns 0, or non-zero with a message of at
 * most err_len bytes (NUL included) in err. */
typedef int (*moe_forward_fn)(void *runner, const void *layer, const void *x, int x_dtype, const int32_t *ids,
                              const void *weights, int w_dtype, int64_t tokens, int64_t hidden, int64_t top_k, void *y,
                              const moe_helpers *helpers, char *err, int64_t err_len);

typedef struct {
    moe_forward_fn forward;
    void *runner; /* a moe_runner: threads and buffers */
    const void *layer; /* a moe_layer: one layer's packed weights */
} moe_call;

#endif
