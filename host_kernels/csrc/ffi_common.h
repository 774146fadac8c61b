/* What every XLA FFI handler here shares: its errors, XLA's thread pool, and its answer to XLA's registration-time
 * question. */
#ifndef MOE_JAX_FFI_COMMON_H
#define MOE_JAX_FFI_COMMON_H

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "xla/ffi/api/c_api.h"

static inline XLA_FFI_Error *ffi_error(const XLA_FFI_Api *api, const char *message) {
    XLA_FFI_Error_Create_Args args = {XLA_FFI_Error_Create_Args_STRUCT_SIZE, NULL, message,
                                      XLA_FFI_Error_Code_INVALID_ARGUMENT};
    return api->XLA_FFI_Error_Create(&args);
}

/* Frees an error XLA returned that the caller has dealt with. */
static inline void ffi_drop_error(const XLA_FFI_Api *api, XLA_FFI_Error *err) {
    XLA_FFI_Error_Destroy_Args destroy = {XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, NULL, err};
    api->XLA_FFI_Error_Destroy(&destroy);
}

/* The threads of XLA's intra-op pool that runs this call (0 where there is none). */
static inline int ffi_pool_threads(const XLA_FFI_Api *api, XLA_FFI_ExecutionContext *ctx) {
    int64_t threads = 0;
    XLA_FFI_ThreadPool_NumThreads_Args args = {XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE, NULL, ctx, &threads};
    XLA_FFI_Error *err = api->XLA_FFI_ThreadPool_NumThreads(&args);
    if (!err) return (int)threads;
    ffi_drop_error(api, err);
    return 0;
}

/* Has task(data) run on that pool; non-zero if it cannot (the caller then does the work itself). */
static inline int ffi_pool_schedule(const XLA_FFI_Api *api, XLA_FFI_ExecutionContext *ctx, void (*task)(void *),
                                    void *data) {
    XLA_FFI_ThreadPool_Schedule_Args args = {XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE, NULL, ctx, task, data};
    XLA_FFI_Error *err = api->XLA_FFI_ThreadPool_Schedule(&args);
    if (!err) return 0;
    ffi_drop_error(api, err);
    return 1;
}

/* A parallel loop's shared counters, on the heap: a helper XLA starts after the loop has ended still reads `next`
 * (and finds nothing left), so the last of the caller and its helpers to let go frees them. */
typedef struct {
    _Atomic int64_t next, done;
    _Atomic int refs;
    int64_t count;
    void (*body)(void *, int64_t);
    void *data;
} ffi_parallel_loop;

static inline void ffi_parallel_take(ffi_parallel_loop *loop) {
    for (int64_t i; (i = atomic_fetch_add_explicit(&loop->next, 1, memory_order_relaxed)) < loop->count;) {
        loop->body(loop->data, i);
        atomic_fetch_add_explicit(&loop->done, 1, memory_order_release);
    }
}

static inline void ffi_parallel_let_go(ffi_parallel_loop *loop) {
    if (atomic_fetch_sub_explicit(&loop->refs, 1, memory_order_acq_rel) == 1) free(loop);
}

static inline void ffi_parallel_helper(void *loop) {
    ffi_parallel_take(loop);
    ffi_parallel_let_go(loop);
}

/* Runs body(data, i) for every i in [0, count), shared by the calling thread and up to `threads - 1` helpers from
 * XLA's pool (all of it on the caller where there is no pool), each taking the next i as it comes free; returns
 * when every body has returned. Non-zero only where the counters cannot be allocated (nothing has run then). */
static inline int ffi_parallel_for(const XLA_FFI_Api *api, XLA_FFI_ExecutionContext *ctx, int64_t count,
                                   void (*body)(void *, int64_t), void *data) {
    ffi_parallel_loop *loop = malloc(sizeof *loop);
    if (!loop) return 1;
    loop->count = count, loop->body = body, loop->data = data;
    atomic_init(&loop->next, 0), atomic_init(&loop->done, 0), atomic_init(&loop->refs, 1);
    const int64_t threads = ffi_pool_threads(api, ctx), helpers = count - 1 < threads - 1 ? count - 1 : threads - 1;
    for (int64_t i = 0; i < helpers; i++) {
        atomic_fetch_add(&loop->refs, 1);
        if (ffi_pool_schedule(api, ctx, ffi_parallel_helper, loop)) { /* no pool: the caller does the rest */
            atomic_fetch_sub(&loop->refs, 1);
            break;
        }
    }
    ffi_parallel_take(loop);
    while (atomic_load_explicit(&loop->done, memory_order_acquire) < count) __builtin_ia32_pause();
    ffi_parallel_let_go(loop);
    return 0;
}

/* The scalar attribute `name` of `dtype`, or NULL where the call has none of that name and type. */
static inline const XLA_FFI_Scalar *ffi_scalar_attr(const XLA_FFI_CallFrame *frame, const char *name,
                                                    XLA_FFI_DataType dtype) {
    const size_t length = strlen(name);
    for (int64_t i = 0; i < frame->attrs.size; i++) {
        const XLA_FFI_ByteSpan *attr_name = frame->attrs.names[i];
        if (attr_name->len != length || memcmp(attr_name->ptr, name, length)) continue;
        const XLA_FFI_Scalar *scalar = frame->attrs.attrs[i];
        return frame->attrs.types[i] == XLA_FFI_AttrType_SCALAR && scalar->dtype == dtype ? scalar : NULL;
    }
    return NULL;
}

/* The s64 scalar attribute `name` into *value; non-zero where the call has none of that name and type. */
static inline int ffi_s64_attr(const XLA_FFI_CallFrame *frame, const char *name, int64_t *value) {
    const XLA_FFI_Scalar *scalar = ffi_scalar_attr(frame, name, XLA_FFI_DataType_S64);
    if (scalar) *value = *(const int64_t *)scalar->value;
    return !scalar;
}

/* The same for a u64 attribute (an address). */
static inline int ffi_u64_attr(const XLA_FFI_CallFrame *frame, const char *name, uint64_t *value) {
    const XLA_FFI_Scalar *scalar = ffi_scalar_attr(frame, name, XLA_FFI_DataType_U64);
    if (scalar) *value = *(const uint64_t *)scalar->value;
    return !scalar;
}

/* At registration XLA calls the handler with a metadata extension, asking which FFI version it was built
 * against and its traits (XLA_FFI_HANDLER_TRAITS_*): answers and returns 1 for that call, 0 for a real one. */
static inline int ffi_answer_metadata_traits(XLA_FFI_CallFrame *frame, XLA_FFI_Handler_Traits traits) {
    if (!frame->extension_start || frame->extension_start->type != XLA_FFI_Extension_Metadata) return 0;
    XLA_FFI_Metadata *metadata = ((XLA_FFI_Metadata_Extension *)frame->extension_start)->metadata;
    metadata->api_version = (XLA_FFI_Api_Version){XLA_FFI_Api_Version_STRUCT_SIZE, NULL, XLA_FFI_API_MAJOR,
                                                  XLA_FFI_API_MINOR};
    metadata->traits = traits;
    metadata->state_type_id = (XLA_FFI_TypeId){0};
    return 1;
}

static inline int ffi_answer_metadata(XLA_FFI_CallFrame *frame) { return ffi_answer_metadata_traits(frame, 0); }

#endif
