/* XLA FFI handler "moe_jax_dense": y = x @ W for the rows of a decode step (at most 64) or of generation's prefill (at
 * most 8192: XLA:CPU's own bfloat16 products of a prefill run at about half its float32 rate on AVX2), W a bfloat16
 * weight kept packed in the AMX tile layout (host_kernels/amx.py's `pack`: [n blocks][k blocks][16 pairs][16 cols][2]),
 * multiplied on AMX tiles or, on CPUs without AMX, by AVX512-BF16 (bf16_gemm.c, which reads the same layout) or,
 * without AVX-512, by AVX2 (avx2_gemm.c, the same layout again); or W int8 with a scale per column
 * (host_kernels/int8_gemm.py's layout: [n blocks, kp * 16 + 64] u8) for `quant="int8"`, whose weights a decode step
 * reads at half the bytes, or int4 with a scale per group of `group` k-rows (host_kernels/int4_gemm.py's layout: [n
 * blocks, kp * 8 + groups * 32] u8) for `quant="int4"`, each on its AVX-512 kernel or its AVX2 one; or, for a float32
 * model, W float32 in column blocks of 32 (host_kernels/f32_gemm.py's layout: [n / 32 blocks, k, 32] f32) times float32
 * rows x. The attributes `kernel` (s64: a code of the kernel table, kernel_table.h, whose row says `dense`) and `group`
 * (s64: int4's k-rows per scale, else 0) say which, as the execution plan chose (moe_jax/planning/plan.py).
 *
 * XLA:CPU's own products at these sizes read their weights well below the memory's rate, and a decode step's dense
 * weights are evicted from cache by the experts between two steps.
 * This reads them as the fused experts do (amx_gemm_4_streams: four column blocks side by side, prefetched), with
 * the work in 64-column groups shared by the calling thread and helpers from XLA's pool.
 *
 * Operands: x [m, k] bf16 (m <= 8192), w [ceil(n / 16), ceil(k / 32), 512] u16. Result:
 * y [m, n] f32, float32 sums of bfloat16 products (XLA's preferred_element_type=f32 product, up to summation
 * order). Rows go 16 at a time (an AMX tile's) through each group's weights, which stay in cache between them.
 * Written against XLA's C API (jaxlib's xla/ffi/api/c_api.h); moe_jax/native/ffi.py registers it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_gemm.h"
#include "ffi_common.h"
#include "kernel_table.h"

#define TILE_ROWS 16 /* an AMX tile's rows: x is copied into a buffer zero-padded to a multiple of them */
#define MAX_ROWS 8192 /* moe_jax/native/dense.py PREFILL_MAX_ROWS: x's padded copy stays within 32 MB at k 2048 */
#define GROUP_BLOCKS 4 /* 16-column blocks per task */
/* One call's operands and the rows it prepared, shared by the calling thread and its helpers. */
typedef struct {
    int64_t m, n, kp, groups;
    int64_t code;        /* the kernel table's code */
    const moe_kernel *k; /* and its row */
    int64_t int4_group;  /* int4: k-rows per scale */
    const void *w;
    float *y;
    uint16_t *x; /* [m rounded up to TILE_ROWS, kp], after this struct (bfloat16 and quantized weights) */
    const float *x_f32; /* float32 weights: XLA's own x [m, k] */
    char *x_q;   /* kernels that read records: x's quantized row records, after x */
} dense_call;

static void run_group(void *call, int64_t g) {
    const dense_call *c = call;
    const int64_t nb0 = g * GROUP_BLOCKS;
    const int64_t n0 = nb0 * 16, n1 = n0 + GROUP_BLOCKS * 16 <= c->n ? n0 + GROUP_BLOCKS * 16 : c->n;
    if (c->code != MOE_KERNEL_BF16_AMX) { /* the table's GEMM over x's rows, float32 rows or records */
        const void *a = c->k->format == MOE_FORMAT_F32 ? (const void *)c->x_f32 : c->k->quantize ? (const void *)c->x_q
                                                                                                  : (const void *)c->x;
        c->k->gemm(a, c->kp, c->w, c->int4_group, c->y + n0, c->n, c->m, n0, n1);
    } else if (n1 - n0 == GROUP_BLOCKS * 16) {
        const uint16_t *b[4] = {amx_block(c->w, c->kp, nb0), amx_block(c->w, c->kp, nb0 + 1),
                                amx_block(c->w, c->kp, nb0 + 2), amx_block(c->w, c->kp, nb0 + 3)};
        for (int64_t r = 0; r < c->m; r += TILE_ROWS) {
            float *y = c->y + r * c->n + n0;
            float *out[4] = {y, y + 16, y + 32, y + 48};
            const int64_t rows = c->m - r < TILE_ROWS ? c->m - r : TILE_ROWS;
            amx_gemm_4_streams(c->x + r * c->kp, c->kp, c->kp, b, out, c->n, rows);
        }
    } else { /* the last, narrower group */
        amx_gemm(c->x, c->kp, c->w, c->kp, c->y + n0, c->n, c->m, n0, n1);
    }
}

XLA_FFI_Error *moe_jax_dense(XLA_FFI_CallFrame *frame) {
    const XLA_FFI_Api *api = frame->api;
    if (ffi_answer_metadata(frame)) return NULL;
    if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return ffi_error(api, "moe_jax_dense: not the execute stage");
    int64_t code, group;
    if (frame->args.size != 2 || frame->rets.size != 1 || frame->args.types[0] != XLA_FFI_ArgType_BUFFER ||
        frame->args.types[1] != XLA_FFI_ArgType_BUFFER || frame->attrs.size != 2 ||
        ffi_s64_attr(frame, "kernel", &code) || ffi_s64_attr(frame, "group", &group))
        return ffi_error(api, "moe_jax_dense takes (x, packed w), returns y, and has s64 attributes kernel, group");
    const moe_kernel *kernel = moe_kernel_get(code);
    if (!kernel || !kernel->dense) return ffi_error(api, "moe_jax_dense: unknown kernel");
    const int is_f32 = kernel->format == MOE_FORMAT_F32, is_int4 = kernel->format == MOE_FORMAT_INT4;
    const int quantized = kernel->format == MOE_FORMAT_INT8 || is_int4;
    if (is_int4 ? group != 32 && group != 64 && group != 128 : group != 0)
        return ffi_error(api, "moe_jax_dense: `group` must be 32, 64 or 128 for int4, 0 otherwise");
    const XLA_FFI_Buffer *x = frame->args.args[0], *w = frame->args.args[1], *y = frame->rets.rets[0];
    const XLA_FFI_DataType x_type = is_f32 ? XLA_FFI_DataType_F32 : XLA_FFI_DataType_BF16;
    if (x->dtype != x_type || x->rank != 2 || y->dtype != XLA_FFI_DataType_F32 || y->rank != 2)
        return ffi_error(api, "moe_jax_dense: x [m, k] (bf16, or f32 for float32 weights) and y [m, n] f32 expected");
    const int64_t m = x->dims[0], k = x->dims[1], n = y->dims[1];
    const int64_t kp = is_f32 ? k : (k + 31) / 32 * 32; /* the bfloat16 and quantized packings pad k so */
    if (m < 1 || m > MAX_ROWS || y->dims[0] != m)
        return ffi_error(api, "moe_jax_dense: x and y of the same 1-8192 rows expected");
    if (quantized) {
        /* int8: [n blocks, kp * 16 + 64] u8, int8 k-pairs then 16 float32 scales; int4: [n blocks, kp * 8 +
         * groups * 32] u8, per group its nibbles then 16 float16 scales */
        const int64_t block_bytes =
            kernel->format == MOE_FORMAT_INT8 ? kp * 16 + 64 : kp * 8 + (kp + group - 1) / group * 32;
        if (w->dtype != XLA_FFI_DataType_U8 || w->rank != 2 || w->dims[0] != (n + 15) / 16 || w->dims[1] != block_bytes)
            return ffi_error(api, "moe_jax_dense: a packed weight of x's k and y's n expected (quantized: "
                                  "[n blocks, block bytes] u8)");
    } else if (is_f32) {
        if (w->dtype != XLA_FFI_DataType_F32 || w->rank != 3 || w->dims[0] != (n + 31) / 32 || w->dims[1] != k ||
            w->dims[2] != 32)
            return ffi_error(api, "moe_jax_dense: a packed weight of x's k and y's n expected ([n / 32 blocks, k, 32] "
                                  "f32)");
    } else if (w->dtype != XLA_FFI_DataType_U16 || w->rank != 3 || w->dims[0] != (n + 15) / 16 ||
               w->dims[1] != kp / 32 || w->dims[2] != 512) {
        return ffi_error(api, "moe_jax_dense: a packed weight of x's k and y's n expected ([n blocks, k blocks, 512] "
                              "u16)");
    }
    const int64_t padded_rows = (m + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    const size_t head = (sizeof(dense_call) + 63) / 64 * 64;
    const size_t x_bytes = is_f32 ? 0 : (size_t)padded_rows * kp * 2; /* float32 rows are read in place */
    const size_t q_bytes = kernel->quantize ? (size_t)(m * kernel->record_bytes(kp)) : 0;
    dense_call *c = aligned_alloc(64, (head + x_bytes + q_bytes + 63) / 64 * 64);
    if (!c) return ffi_error(api, "moe_jax_dense: out of memory");
    const int64_t groups = (n + GROUP_BLOCKS * 16 - 1) / (GROUP_BLOCKS * 16);
    c->x = (uint16_t *)((char *)c + head);
    c->x_q = (char *)c + head + x_bytes;
    c->x_f32 = x->data;
    memset(c->x, 0, x_bytes); /* padding: zeros (they meet zero weights or unstored rows) */
    for (int64_t r = 0; r < m && !is_f32; r++)
        memcpy(c->x + r * kp, (const uint16_t *)x->data + r * k, (size_t)k * 2);
    if (kernel->quantize) kernel->quantize(c->x, kp, m, 0, kp, c->x_q, kp); /* once, for every task */
    c->m = m, c->n = n, c->kp = kp, c->groups = groups, c->w = w->data, c->y = y->data;
    c->code = code, c->k = kernel, c->int4_group = group;
    const int failed = ffi_parallel_for(api, frame->ctx, groups, run_group, c);
    free(c);
    return failed ? ffi_error(api, "moe_jax_dense: out of memory") : NULL;
}
