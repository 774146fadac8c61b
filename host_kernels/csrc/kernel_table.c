/* The kernel table's rows (kernel_table.h): each GEMM behind one signature, so every caller dispatches through
 * the table instead of a switch of its own. Compiled for the baseline: it only takes the kernels' addresses. */
#include "kernel_table.h"

#include <stddef.h>
#include <string.h>

#include "amx_gemm.h"
#include "avx2_kernels.h"
#include "bf16_gemm.h"
#include "f32_gemm.h"
#include "int4_gemm.h"

/* the GEMM `kernel` behind moe_gemm_fn as `wrapper`: over the rows (and kp's stride), over quantized records
 * (the group is the layout's own), or over int4's records with the layer's group */
#define ROWS_GEMM(wrapper, kernel)                                                                                    \
    static void wrapper(const void *a, int64_t kp, const void *w, int64_t group, float *c, int64_t ldc, int64_t m,   \
                        int64_t n0, int64_t n1) {                                                                     \
        (void)group;                                                                                                  \
        kernel(a, kp, w, kp, c, ldc, m, n0, n1);                                                                      \
    }
#define RECORDS_GEMM(wrapper, kernel)                                                                                 \
    static void wrapper(const void *a, int64_t kp, const void *w, int64_t group, float *c, int64_t ldc, int64_t m,   \
                        int64_t n0, int64_t n1) {                                                                     \
        (void)group;                                                                                                  \
        kernel(a, kp, w, c, ldc, m, n0, n1);                                                                          \
    }
#define GROUPED_GEMM(wrapper, kernel)                                                                                 \
    static void wrapper(const void *a, int64_t kp, const void *w, int64_t group, float *c, int64_t ldc, int64_t m,   \
                        int64_t n0, int64_t n1) {                                                                     \
        kernel(a, kp, w, group, c, ldc, m, n0, n1);                                                                   \
    }
ROWS_GEMM(gemm_f32_avx512, f32_gemm)
ROWS_GEMM(gemm_f32_avx2, f32_gemm_avx2)
ROWS_GEMM(gemm_bf16_amx, amx_gemm)
ROWS_GEMM(gemm_bf16_avx512, bf16_gemm)
ROWS_GEMM(gemm_bf16_avx2, bf16_gemm_avx2)
ROWS_GEMM(gemm_int8_avx512, int8_gemm)
ROWS_GEMM(gemm_int8_amx, int8_gemm_amx)
RECORDS_GEMM(gemm_int8_avx2, int8_gemm_quantized_avx2)
RECORDS_GEMM(gemm_mxfp4_avx512, mxfp4_gemm_quantized)
RECORDS_GEMM(gemm_mxfp4_avx2, mxfp4_gemm_quantized_avx2)
GROUPED_GEMM(gemm_int4_avx512, int4_gemm_quantized)
GROUPED_GEMM(gemm_int4_avx2, int4_gemm_quantized_avx2)
static int64_t int4_records(int64_t kp) { return int4_row_bytes(kp); }

#define MOE_KERNEL_ROW(id, name, isa, format, bits, block, dense, gemm, quantize, record_bytes)                      \
    [MOE_KERNEL_##id] = {name, MOE_ISA_##isa, MOE_FORMAT_##format, bits, block, dense, gemm, quantize, record_bytes},
static const moe_kernel KERNELS[MOE_KERNEL_COUNT] = {MOE_KERNEL_TABLE(MOE_KERNEL_ROW)};
#undef MOE_KERNEL_ROW

const moe_kernel *moe_kernel_get(int64_t code) { return code >= 0 && code < MOE_KERNEL_COUNT ? &KERNELS[code] : NULL; }

int moe_kernel_code(const char *name) {
    for (int code = 0; name && code < MOE_KERNEL_COUNT; code++)
        if (strcmp(KERNELS[code].name, name) == 0) return code;
    return -1;
}

const char *moe_kernel_describe(int code, int *out) {
    const moe_kernel *k = moe_kernel_get(code);
    if (!k) return NULL;
    out[0] = k->isa, out[1] = k->format, out[2] = k->bits, out[3] = k->block, out[4] = k->dense;
    return k->name;
}

int moe_kernel_count(void) { return MOE_KERNEL_COUNT; }
