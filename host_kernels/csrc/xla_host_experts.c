/* XLA FFI handler "moe_jax_host_experts": a jitted model calls the host's fused expert forward
 * (host_kernels/csrc/moe_forward.c) directly on its buffers, with no Python callback (whose overhead exceeds
 * what the experts of a decode step take to compute) and no GIL.
 *
 * Operands: x [tokens, hidden] (f32 or bf16), ids [tokens, top_k] (s32), weights [tokens, top_k] (f32 or bf16);
 * result y like x; attribute `call` (u64): the address of a moe_call (moe_forward.h) that names the runner and
 * the layer. moe_jax/native/ffi.py registers the handler and builds the calls.
 * Written against XLA's C API (jaxlib's xla/ffi/api/c_api.h), so it needs no C++.
 */
#include <stdio.h>
#include <string.h>

#include "moe_forward.h"
#include "ffi_common.h"

/* Helpers for the fused forward come from XLA's own thread pool (the threads that run the rest of the step), so
 * no second set of threads competes with XLA's for the cores. */
typedef struct {
    const XLA_FFI_Api *api;
    XLA_FFI_ExecutionContext *ctx;
} xla_pool;

static int schedule_on_xla_pool(void *context, void (*task)(void *), void *data) {
    const xla_pool *pool = context;
    return ffi_pool_schedule(pool->api, pool->ctx, task, data);
}

static int dtype_code(XLA_FFI_DataType dtype) {
    return dtype == XLA_FFI_DataType_F32 ? MOE_FLOAT32 : dtype == XLA_FFI_DataType_BF16 ? MOE_BFLOAT16 : -1;
}

XLA_FFI_Error *moe_jax_host_experts(XLA_FFI_CallFrame *frame) {
    const XLA_FFI_Api *api = frame->api;
    if (ffi_answer_metadata(frame)) return NULL;
    if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return ffi_error(api, "moe_jax_host_experts: not the execute stage");
    if (frame->args.size != 3 || frame->rets.size != 1 || frame->attrs.size != 1 ||
        frame->attrs.types[0] != XLA_FFI_AttrType_SCALAR)
        return ffi_error(api, "moe_jax_host_experts takes (x, ids, weights), returns y, and has one attribute `call`");
    for (int i = 0; i < 3; i++)
        if (frame->args.types[i] != XLA_FFI_ArgType_BUFFER) return ffi_error(api, "moe_jax_host_experts: operands are arrays");
    const XLA_FFI_Scalar *call_attr = frame->attrs.attrs[0];
    const XLA_FFI_Buffer *x = frame->args.args[0], *ids = frame->args.args[1], *weights = frame->args.args[2];
    const XLA_FFI_Buffer *y = frame->rets.rets[0];
    if (call_attr->dtype != XLA_FFI_DataType_U64) return ffi_error(api, "moe_jax_host_experts: `call` must be a u64 address");
    const int x_code = dtype_code(x->dtype), w_code = dtype_code(weights->dtype);
    if (x_code < 0 || w_code < 0 || ids->dtype != XLA_FFI_DataType_S32 || y->dtype != x->dtype || x->rank != 2 ||
        ids->rank != 2 || weights->rank != 2 || y->rank != 2 || ids->dims[0] != x->dims[0] ||
        weights->dims[0] != ids->dims[0] || weights->dims[1] != ids->dims[1] || y->dims[0] != x->dims[0] ||
        y->dims[1] != x->dims[1])
        return ffi_error(api, "moe_jax_host_experts: x [t, d] f32/bf16, ids [t, k] s32, weights [t, k] f32/bf16, y like x");
    const moe_call *call = (const moe_call *)(uintptr_t)(*(const uint64_t *)call_attr->value);
    xla_pool pool = {api, frame->ctx};
    const moe_helpers helpers = {schedule_on_xla_pool, &pool, ffi_pool_threads(api, frame->ctx)};
    char message[256] = "";
    char full[320];
    if (call->forward(call->runner, call->layer, x->data, x_code, ids->data, weights->data, w_code, x->dims[0],
                      x->dims[1], ids->dims[1], y->data, &helpers, message, sizeof message)) {
        snprintf(full, sizeof full, "host experts: %s", message);
        return ffi_error(api, full);
    }
    return NULL;
}
