/* The stream-ordered host expert calls (stream_handlers.h) on CUDA: each handler enqueues its half of the protocol
 * (stream_worker.h) on XLA's stream and returns; no Python, no GIL, no stream synchronisation.
 *
 * "moe_jax_stream_submit" enqueues the copies of x, ids and weights into the site's pinned staging buffers, the
 * ticket, and the go; "moe_jax_stream_sync" the wait for the worker's done, its reset, the copy of y back and the
 * ticket again.
 * Between the two the stream runs whatever XLA put there (the shared expert, the other micro-batch's attention).
 * The go and the wait are either stream memory operations on the flags in mapped pinned memory (attribute
 * `signal` 0: the worker polls them) or host functions that run moe_stream_post / moe_stream_wait on CUDA's
 * callback thread (`signal` 1). Both handlers launch the same operations for the same attributes and shapes, so
 * they are marked command-buffer compatible: XLA may capture them in a CUDA graph, whose replays reuse the sites'
 * staging buffers (they never move). Registered for the initialize stage too, where they make their site (and its
 * pinned staging memory) before any capture.
 *
 * The CUDA driver is opened with dlopen at first use, so the library built here loads and runs where there is no
 * GPU; only cuda.h's types are needed to build it (setup.py finds the header).
 */
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

#include "stream_handlers.h"

typedef struct {
    CUresult (*Init)(unsigned int);
    CUresult (*GetErrorString)(CUresult, const char **);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DeviceGetAttribute)(int *, CUdevice_attribute, CUdevice);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxPushCurrent)(CUcontext);
    CUresult (*CtxPopCurrent)(CUcontext *);
    CUresult (*MemHostAlloc)(void **, size_t, unsigned int);
    CUresult (*MemFreeHost)(void *);
    CUresult (*MemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned int);
    CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*MemsetD32Async)(CUdeviceptr, unsigned int, size_t, CUstream);
    CUresult (*StreamWriteValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
    CUresult (*StreamWaitValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
    CUresult (*LaunchHostFunc)(CUstream, CUhostFn, void *);
} cuda_driver;

static cuda_driver cu;
static char driver_missing[256] = "not loaded yet";
static pthread_once_t driver_once = PTHREAD_ONCE_INIT;
#define DRIVER_API_VERSION 12000 /* the entry points' signatures as CUDA 12 and 13 declare them */

static void load_driver(void) {
    void *library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!library) {
        snprintf(driver_missing, sizeof driver_missing, "cannot load the CUDA driver: %s", dlerror());
        return;
    }
    typedef CUresult (*proc_address_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
    proc_address_fn proc_address = (proc_address_fn)dlsym(library, "cuGetProcAddress_v2");
    if (!proc_address) {
        snprintf(driver_missing, sizeof driver_missing,
                 "the CUDA driver is older than CUDA 12 (no cuGetProcAddress_v2)");
        return;
    }
    const struct {
        const char *name;
        void **function;
    } entries[] = {
        {"cuInit", (void **)&cu.Init}, {"cuGetErrorString", (void **)&cu.GetErrorString},
        {"cuDeviceGet", (void **)&cu.DeviceGet}, {"cuDeviceGetAttribute", (void **)&cu.DeviceGetAttribute},
        {"cuDevicePrimaryCtxRetain", (void **)&cu.DevicePrimaryCtxRetain},
        {"cuCtxGetCurrent", (void **)&cu.CtxGetCurrent}, {"cuCtxPushCurrent", (void **)&cu.CtxPushCurrent},
        {"cuCtxPopCurrent", (void **)&cu.CtxPopCurrent}, {"cuMemHostAlloc", (void **)&cu.MemHostAlloc},
        {"cuMemFreeHost", (void **)&cu.MemFreeHost},
        {"cuMemHostGetDevicePointer", (void **)&cu.MemHostGetDevicePointer},
        {"cuMemcpyDtoHAsync", (void **)&cu.MemcpyDtoHAsync}, {"cuMemcpyHtoDAsync", (void **)&cu.MemcpyHtoDAsync},
        {"cuMemsetD32Async", (void **)&cu.MemsetD32Async}, {"cuStreamWriteValue64", (void **)&cu.StreamWriteValue64},
        {"cuStreamWaitValue64", (void **)&cu.StreamWaitValue64}, {"cuLaunchHostFunc", (void **)&cu.LaunchHostFunc},
    };
    for (size_t i = 0; i < sizeof entries / sizeof *entries; i++) {
        CUdriverProcAddressQueryResult found;
        if (proc_address(entries[i].name, entries[i].function, DRIVER_API_VERSION, CU_GET_PROC_ADDRESS_DEFAULT,
                         &found) != CUDA_SUCCESS ||
            !*entries[i].function) {
            snprintf(driver_missing, sizeof driver_missing, "the CUDA driver has no %s", entries[i].name);
            return;
        }
    }
    const CUresult init = cu.Init(0);
    if (init != CUDA_SUCCESS) {
        const char *text = "unknown error";
        cu.GetErrorString(init, &text);
        snprintf(driver_missing, sizeof driver_missing, "cuInit failed: %s", text);
        return;
    }
    driver_missing[0] = '\0';
}

/* "" when the CUDA driver is loaded and initialised, else why not. */
const char *moe_cuda_stream_status(void) {
    pthread_once(&driver_once, load_driver);
    return driver_missing;
}

/* Whether device `ordinal` runs 64-bit stream memory operations (the `signal` 0 form); 0 also where the driver
 * is missing. */
int moe_cuda_stream_memops(int ordinal) {
    CUdevice device;
    int supported = 0;
    if (moe_cuda_stream_status()[0] || cu.DeviceGet(&device, ordinal) != CUDA_SUCCESS ||
        cu.DeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, device) != CUDA_SUCCESS)
        return 0;
    return supported;
}

/* --- staging memory: pinned, mapped into every context (a stream_memory, stream_worker.h) */

/* The current context, or device 0's primary context pushed for the call (*pushed then set). */
static int enter_context(int *pushed) {
    CUcontext current = NULL;
    *pushed = 0;
    if (cu.CtxGetCurrent(&current) == CUDA_SUCCESS && current) return 0;
    CUdevice device;
    CUcontext primary;
    if (cu.DeviceGet(&device, 0) != CUDA_SUCCESS || cu.DevicePrimaryCtxRetain(&primary, device) != CUDA_SUCCESS ||
        cu.CtxPushCurrent(primary) != CUDA_SUCCESS)
        return 1;
    *pushed = 1;
    return 0;
}

static void leave_context(int pushed) {
    CUcontext popped;
    if (pushed) cu.CtxPopCurrent(&popped);
}

static void *pinned_alloc(void *context, size_t bytes) {
    (void)context;
    int pushed;
    void *memory = NULL;
    if (moe_cuda_stream_status()[0] || enter_context(&pushed)) return NULL;
    if (cu.MemHostAlloc(&memory, bytes ? bytes : 1, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP) !=
        CUDA_SUCCESS)
        memory = NULL;
    leave_context(pushed);
    return memory;
}

static void pinned_release(void *context, void *memory) {
    (void)context;
    if (!moe_cuda_stream_status()[0]) cu.MemFreeHost(memory);
}

static const stream_memory pinned_memory = {pinned_alloc, pinned_release, NULL};

const stream_memory *moe_cuda_pinned_memory(void) { return &pinned_memory; }

/* --- the handlers */

static XLA_FFI_Error *cuda_error(const XLA_FFI_Api *api, const char *what, const char *step, CUresult result) {
    const char *text = "unknown error";
    cu.GetErrorString(result, &text);
    char message[256];
    snprintf(message, sizeof message, "%s failed: %s", step, text);
    return stream_error(api, what, message);
}

#define CU_CHECK(call, what)                                                       \
    do {                                                                           \
        const CUresult result_ = (call);                                           \
        if (result_ != CUDA_SUCCESS) return cuda_error(api, what, #call, result_); \
    } while (0)

/* The site, the signal form, (memory operations) the flags' device addresses and, at the execute stage, XLA's
 * stream. At the initialize stage (before XLA captures a command buffer) this is all a call does: the site's
 * staging memory is allocated then, not while a graph is being captured. */
static stream_site *prepare(XLA_FFI_CallFrame *frame, int submit, CUstream *stream, int64_t *signal,
                            XLA_FFI_Error **error) {
    const XLA_FFI_Api *api = frame->api;
    const char *what = submit ? "moe_jax_stream_submit" : "moe_jax_stream_sync";
    if (moe_cuda_stream_status()[0]) {
        *error = stream_error(api, what, driver_missing);
        return NULL;
    }
    if (ffi_s64_attr(frame, "signal", signal) || (*signal != 0 && *signal != 1)) {
        *error = stream_error(api, what, "s64 attribute signal expected: 0 (stream memory operations) or 1 (host "
                                         "functions)");
        return NULL;
    }
    stream_site *site = submit ? stream_submit_site(frame, error) : stream_sync_site(frame, error);
    if (!site) return NULL;
    if (frame->stage == XLA_FFI_ExecutionStage_EXECUTE) {
        XLA_FFI_Stream_Get_Args args = {XLA_FFI_Stream_Get_Args_STRUCT_SIZE, NULL, frame->ctx, NULL};
        if ((*error = api->XLA_FFI_Stream_Get(&args))) return NULL;
        *stream = (CUstream)args.stream;
    }
    if (*signal == 0 && !site->device_done) { /* the same values for every call of a site: set once */
        stream_flags *flags = moe_stream_flags(site->worker, site->slot);
        CUdeviceptr go, done;
        CUresult result = cu.MemHostGetDevicePointer(&go, (void *)&flags->go, 0);
        if (result == CUDA_SUCCESS) result = cu.MemHostGetDevicePointer(&done, (void *)&flags->done, 0);
        if (result != CUDA_SUCCESS) {
            *error = cuda_error(api, what, "cuMemHostGetDevicePointer (is the worker's memory pinned?)", result);
            return NULL;
        }
        site->device_go = go, site->device_done = done;
    }
    return site;
}

static void CUDA_CB host_post(void *site) {
    const stream_site *s = site;
    moe_stream_post(s->worker, s->id);
}

static void CUDA_CB host_wait(void *site) {
    const stream_site *s = site;
    moe_stream_wait(s->worker, s->id, -1); /* a stopped worker answers every go: this returns */
}

/* The submit's operations: the copies in, the ticket, the go. */
static XLA_FFI_Error *enqueue_submit(XLA_FFI_CallFrame *frame, stream_site *site, CUstream stream, int64_t signal) {
    const XLA_FFI_Api *api = frame->api;
    const char *what = "moe_jax_stream_submit";
    const struct {
        void *to;
        int operand;
        int64_t bytes;
    } copies[] = {{site->x, 0, site->x_bytes},
                  {site->ids, 1, site->ids_bytes},
                  {site->weights, 2, site->weights_bytes},
                  {site->forward_ticket, 3, 4}}; /* a backward's: the forward whose kept pre-activations it reads */
    for (int i = 0; i < 4 && copies[i].to; i++)
        CU_CHECK(cu.MemcpyDtoHAsync(copies[i].to, (CUdeviceptr)stream_arg(frame, copies[i].operand)->data,
                                    (size_t)copies[i].bytes, stream),
                 what);
    CU_CHECK(cu.MemsetD32Async((CUdeviceptr)stream_ret(frame, 0)->data, (unsigned int)site->id, 1, stream), what);
    if (signal == 0)
        CU_CHECK(cu.StreamWriteValue64(stream, site->device_go, (cuuint64_t)site->id + 1, 0), what);
    else
        CU_CHECK(cu.LaunchHostFunc(stream, host_post, site), what);
    moe_stream_ring(site->worker); /* the go follows soon: have the worker spinning for it */
    return NULL;
}

/* The sync's operations: the wait for the done and its reset, the copies back, the answered ticket. */
static XLA_FFI_Error *enqueue_sync(XLA_FFI_CallFrame *frame, stream_site *site, CUstream stream, int64_t signal) {
    const XLA_FFI_Api *api = frame->api;
    const char *what = "moe_jax_stream_sync";
    if (signal == 0) {
        CU_CHECK(cu.StreamWaitValue64(stream, site->device_done, (cuuint64_t)site->id + 1, CU_STREAM_WAIT_VALUE_EQ),
                 what);
        CU_CHECK(cu.StreamWriteValue64(stream, site->device_done, 0, 0), what);
    } else {
        CU_CHECK(cu.LaunchHostFunc(stream, host_wait, site), what);
    }
    CU_CHECK(cu.MemcpyHtoDAsync((CUdeviceptr)stream_ret(frame, 0)->data, site->y, (size_t)site->x_bytes, stream),
             what);
    if (site->dweights)
        CU_CHECK(cu.MemcpyHtoDAsync((CUdeviceptr)stream_ret(frame, 1)->data, site->dweights,
                                    (size_t)site->dweights_bytes, stream),
                 what);
    const XLA_FFI_Buffer *ticket = stream_ret(frame, frame->rets.size - 1); /* the worker's answered ticket */
    CU_CHECK(cu.MemcpyHtoDAsync((CUdeviceptr)ticket->data, site->answer, 4, stream), what);
    return NULL;
}

/* A handler: registration's question, the site (made at the initialize stage), then at execution its operations. */
static XLA_FFI_Error *handle(XLA_FFI_CallFrame *frame, int submit) {
    if (ffi_answer_metadata_traits(frame, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE)) return NULL;
    XLA_FFI_Error *error = NULL;
    CUstream stream = NULL;
    int64_t signal;
    stream_site *site = prepare(frame, submit, &stream, &signal, &error);
    if (!site || frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return error;
    return submit ? enqueue_submit(frame, site, stream, signal) : enqueue_sync(frame, site, stream, signal);
}

XLA_FFI_Error *moe_jax_cuda_stream_submit(XLA_FFI_CallFrame *frame) { return handle(frame, 1); }

XLA_FFI_Error *moe_jax_cuda_stream_sync(XLA_FFI_CallFrame *frame) { return handle(frame, 0); }
