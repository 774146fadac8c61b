/* The stream-ordered host expert calls (stream_handlers.h) on XLA:CPU: the device side of the protocol as host
 * code. Submit copies the operands into the site's staging buffers and posts the go; sync waits for the worker's
 * answer and copies y out. XLA:CPU's own handler (xla_host_experts.c) is the faster way to the same forward
 * there; these exist so that the protocol, the split into two calls and their ordering run inside jitted steps on
 * machines without a GPU, against the same worker the CUDA handlers (xla_cuda_host_experts.c) drive.
 */
#include <string.h>

#include "stream_handlers.h"

XLA_FFI_Error *moe_jax_stream_submit(XLA_FFI_CallFrame *frame) {
    if (ffi_answer_metadata(frame)) return NULL;
    XLA_FFI_Error *error = NULL;
    stream_site *site = stream_submit_site(frame, &error);
    if (!site) return error;
    memcpy(site->x, stream_arg(frame, 0)->data, (size_t)site->x_bytes);
    memcpy(site->ids, stream_arg(frame, 1)->data, (size_t)site->ids_bytes);
    memcpy(site->weights, stream_arg(frame, 2)->data, (size_t)site->weights_bytes);
    if (site->forward_ticket) memcpy(site->forward_ticket, stream_arg(frame, 3)->data, 4);
    *(int32_t *)stream_ret(frame, 0)->data = (int32_t)site->id;
    moe_stream_post(site->worker, site->id);
    return NULL;
}

XLA_FFI_Error *moe_jax_stream_sync(XLA_FFI_CallFrame *frame) {
    if (ffi_answer_metadata(frame)) return NULL;
    XLA_FFI_Error *error = NULL;
    stream_site *site = stream_sync_site(frame, &error);
    if (!site) return error;
    if (*(const int32_t *)stream_arg(frame, 0)->data != site->id)
        return stream_error(frame->api, "moe_jax_stream_sync", "the ticket names another site than this sync's");
    const int status = moe_stream_wait(site->worker, site->id, -1);
    if (status) {
        char detail[256] = "its error was taken by another call", message[320] = "the host worker was stopped";
        int64_t layer = site->layer;
        if (status == 1) {
            moe_stream_take_error(site->worker, &layer, detail, sizeof detail);
            snprintf(message, sizeof message, "host experts failed at layer %lld: %s", (long long)layer, detail);
        }
        return stream_error(frame->api, "moe_jax_stream_sync", message);
    }
    memcpy(stream_ret(frame, 0)->data, site->y, (size_t)site->x_bytes);
    if (site->dweights) memcpy(stream_ret(frame, 1)->data, site->dweights, (size_t)site->dweights_bytes);
    memcpy(stream_ret(frame, frame->rets.size - 1)->data, site->answer, 4);
    return NULL;
}
