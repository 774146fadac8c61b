/* What every XLA FFI handler here shares: its errors, XLA's thread pool, and its answer to XLA's registration-time
 * question. */
#ifndef MOE_JAX_FFI_COMMON_H
#define MOE_JAX_FFI_COMMON_H

#include <stdint.h>
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

/* The s64 scalar attribute `name` into *value; non-zero where the call has none of that name and type. */
static inline int ffi_s64_attr(const XLA_FFI_CallFrame *frame, const char *name, int64_t *value) {
    const size_t length = strlen(name);
    for (int64_t i = 0; i < frame->attrs.size; i++) {
        const XLA_FFI_ByteSpan *attr_name = frame->attrs.names[i];
        if (attr_name->len != length || memcmp(attr_name->ptr, name, length)) continue;
        const XLA_FFI_Scalar *scalar = frame->attrs.attrs[i];
        if (frame->attrs.types[i] != XLA_FFI_AttrType_SCALAR || scalar->dtype != XLA_FFI_DataType_S64) return 1;
        *value = *(const int64_t *)scalar->value;
        return 0;
    }
    return 1;
}

/* At registration XLA calls the handler with a metadata extension, asking which FFI version it was built
 * against: answers and returns 1 for that call, 0 for a real one. */
static inline int ffi_answer_metadata(XLA_FFI_CallFrame *frame) {
    if (!frame->extension_start || frame->extension_start->type != XLA_FFI_Extension_Metadata) return 0;
    XLA_FFI_Metadata *metadata = ((XLA_FFI_Metadata_Extension *)frame->extension_start)->metadata;
    metadata->api_version = (XLA_FFI_Api_Version){XLA_FFI_Api_Version_STRUCT_SIZE, NULL, XLA_FFI_API_MAJOR,
                                                  XLA_FFI_API_MINOR};
    metadata->traits = 0;
    metadata->state_type_id = (XLA_FFI_TypeId){0};
    return 1;
}

#endif
