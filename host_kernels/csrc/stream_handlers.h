/* What the stream-ordered host expert handlers share, on XLA:CPU (xla_stream_experts.c) and on CUDA
 * (xla_cuda_host_experts.c): reading a call frame into its worker and site.
 *
 * "moe_jax_stream_submit": (x [t, d], ids [t, k] s32, weights [t, k], after) -> ticket (s32 scalar: the site);
 *                          a backward's: (dy [t, d] f32, ids, weights f32, its forward's ticket, after)
 * "moe_jax_stream_sync":   (ticket, after) -> (y [t, d] like x, the worker's answered ticket once y is there: a
 *                          keeping forward's names its call, STREAM_TICKET); a backward's: (dx [t, d] f32,
 *                          dweights [t, k] f32, the answered ticket)
 * `after` (an f32 scalar, not read) orders a call after other work: a micro-batch pipeline chains its calls so.
 * Attributes of both: worker (u64: a stream_worker), call (u64: the layer's moe_call; a backward's names the
 * backward layer), layer, slot and kind (s64: STREAM_FORWARD, _FORWARD_KEEPING or _BACKWARD); the sync's also
 * top_k and w_dtype (s64: MOE_FLOAT32 / MOE_BFLOAT16), which with y's shape name the same site as the submit's
 * operands. moe_jax/native/stream_experts.py registers them and builds the calls.
 */
#ifndef MOE_STREAM_HANDLERS_H
#define MOE_STREAM_HANDLERS_H
#include <stdio.h>

#include "ffi_common.h"
#include "stream_worker.h"

/* The call's i-th operand and result buffers */
static inline const XLA_FFI_Buffer *stream_arg(const XLA_FFI_CallFrame *frame, int i) { return frame->args.args[i]; }
static inline const XLA_FFI_Buffer *stream_ret(const XLA_FFI_CallFrame *frame, int i) { return frame->rets.rets[i]; }

static inline int stream_dtype_code(XLA_FFI_DataType dtype) {
    return dtype == XLA_FFI_DataType_F32 ? MOE_FLOAT32 : dtype == XLA_FFI_DataType_BF16 ? MOE_BFLOAT16 : -1;
}

static inline XLA_FFI_Error *stream_error(const XLA_FFI_Api *api, const char *what, const char *message) {
    char full[384];
    snprintf(full, sizeof full, "%s: %s", what, message);
    return ffi_error(api, full);
}

/* The site named by the attributes and (tokens, hidden, top_k, dtypes); NULL with *error set where the frame is
 * malformed or the worker stopped, and for a submit (`refuse_after_failure`) where a call failed before and its
 * error was not taken yet (by layer: a device step that read its NaN results reaches the caller here at the
 * latest). A sync never refuses so: it must wait for its own submit's call, which may be the one that failed. */
static inline stream_site *stream_site_of(XLA_FFI_CallFrame *frame, const char *what, int64_t kind,
                                          int64_t tokens, int64_t hidden, int64_t top_k, int x_dtype, int w_dtype,
                                          int refuse_after_failure, XLA_FFI_Error **error) {
    const XLA_FFI_Api *api = frame->api;
    uint64_t worker_address, call_address;
    int64_t layer, slot;
    if (ffi_u64_attr(frame, "worker", &worker_address) || ffi_u64_attr(frame, "call", &call_address) ||
        ffi_s64_attr(frame, "layer", &layer) || ffi_s64_attr(frame, "slot", &slot) || !worker_address) {
        *error = stream_error(api, what, "attributes worker, call (u64) and layer, slot (s64) expected");
        return NULL;
    }
    stream_worker *worker = (stream_worker *)(uintptr_t)worker_address;
    char message[256];
    int64_t failed_layer;
    if (refuse_after_failure && moe_stream_peek_error(worker, &failed_layer, message, sizeof message)) {
        char full[320];
        snprintf(full, sizeof full, "host experts failed at layer %lld: %s", (long long)failed_layer, message);
        *error = stream_error(api, what, full);
        return NULL;
    }
    const int64_t site = moe_stream_site(worker, (const moe_call *)(uintptr_t)call_address, layer, slot, kind,
                                         tokens, hidden, top_k, x_dtype, w_dtype, message, sizeof message);
    if (site < 0) {
        *error = stream_error(api, what, message);
        return NULL;
    }
    return moe_stream_site_at(worker, site);
}

/* The call's kind attribute; -1 (with *error set) where it has none. */
static inline int64_t stream_kind(XLA_FFI_CallFrame *frame, const char *what, XLA_FFI_Error **error) {
    int64_t kind;
    if (ffi_s64_attr(frame, "kind", &kind)) {
        *error = stream_error(frame->api, what, "s64 attribute kind expected");
        return -1;
    }
    return kind;
}

/* A submit's operands and result, checked; its site. */
static inline stream_site *stream_submit_site(XLA_FFI_CallFrame *frame, XLA_FFI_Error **error) {
    const char *what = "moe_jax_stream_submit";
    const int64_t kind = stream_kind(frame, what, error);
    if (kind < 0) return NULL;
    const int64_t operands = kind == STREAM_BACKWARD ? 5 : 4;
    if (frame->args.size != operands || frame->rets.size != 1) {
        *error = stream_error(frame->api, what, "takes (x, ids, weights, after) (a backward: (dy, ids, weights, "
                                                "forward ticket, after)) and returns a ticket");
        return NULL;
    }
    for (int i = 0; i < operands; i++)
        if (frame->args.types[i] != XLA_FFI_ArgType_BUFFER) {
            *error = stream_error(frame->api, what, "operands are arrays");
            return NULL;
        }
    const XLA_FFI_Buffer *x = frame->args.args[0], *ids = frame->args.args[1], *weights = frame->args.args[2];
    const XLA_FFI_Buffer *ticket = frame->rets.rets[0];
    const int x_code = stream_dtype_code(x->dtype), w_code = stream_dtype_code(weights->dtype);
    if (x_code < 0 || w_code < 0 || ids->dtype != XLA_FFI_DataType_S32 || x->rank != 2 || ids->rank != 2 ||
        weights->rank != 2 || ids->dims[0] != x->dims[0] || weights->dims[0] != ids->dims[0] ||
        weights->dims[1] != ids->dims[1] || ticket->dtype != XLA_FFI_DataType_S32 || ticket->rank != 0 ||
        (kind == STREAM_BACKWARD &&
         (stream_arg(frame, 3)->dtype != XLA_FFI_DataType_S32 || stream_arg(frame, 3)->rank != 0))) {
        *error = stream_error(frame->api, what, "x [t, d] f32/bf16, ids [t, k] s32, weights [t, k] f32/bf16; "
                                                "the tickets s32 scalars");
        return NULL;
    }
    return stream_site_of(frame, what, kind, x->dims[0], x->dims[1], ids->dims[1], x_code, w_code, 1, error);
}

/* A sync's operands and result, checked; its site (the submit's). */
static inline stream_site *stream_sync_site(XLA_FFI_CallFrame *frame, XLA_FFI_Error **error) {
    const char *what = "moe_jax_stream_sync";
    int64_t top_k, w_dtype;
    const int64_t kind = stream_kind(frame, what, error);
    if (kind < 0) return NULL;
    const int64_t results = kind == STREAM_BACKWARD ? 3 : 2;
    if (frame->args.size != 2 || frame->rets.size != results || frame->args.types[0] != XLA_FFI_ArgType_BUFFER ||
        ffi_s64_attr(frame, "top_k", &top_k) || ffi_s64_attr(frame, "w_dtype", &w_dtype)) {
        *error = stream_error(frame->api, what, "takes (ticket, after), returns (y, ticket) (a backward: (dx, "
                                                "dweights, ticket)), and has top_k and w_dtype");
        return NULL;
    }
    const XLA_FFI_Buffer *ticket = stream_arg(frame, 0), *y = stream_ret(frame, 0);
    const XLA_FFI_Buffer *done = stream_ret(frame, results - 1);
    const int y_code = stream_dtype_code(y->dtype);
    if (ticket->dtype != XLA_FFI_DataType_S32 || ticket->rank != 0 || done->dtype != XLA_FFI_DataType_S32 ||
        done->rank != 0 || y_code < 0 || y->rank != 2 ||
        (kind == STREAM_BACKWARD && (stream_ret(frame, 1)->dtype != XLA_FFI_DataType_F32 ||
                                     stream_ret(frame, 1)->rank != 2 || stream_ret(frame, 1)->dims[0] != y->dims[0] ||
                                     stream_ret(frame, 1)->dims[1] != top_k))) {
        *error = stream_error(frame->api, what, "the tickets s32 scalars, y [t, d] f32/bf16 (a backward's dweights "
                                                "[t, k] f32)");
        return NULL;
    }
    return stream_site_of(frame, what, kind, y->dims[0], y->dims[1], top_k, y_code, (int)w_dtype, 0, error);
}

#endif
