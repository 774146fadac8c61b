/* The one table of the GEMM kernels over packed weights, read by the fused expert forward (moe_forward.c), its
 * backward, the dense products' FFI handler (xla_dense.c) and, through moe_kernel_code / moe_kernel_describe,
 * Python (host_kernels/fused_forward.py's KERNELS takes its codes from here by name, and a test checks the two
 * agree). Adding a kernel or a weight format is a row here, its GEMM, and its test.
 *
 * Columns: the enum's suffix, the name Python knows it by, the instruction set, the weight format, bits per packed
 * weight (scales aside), columns per packed block, whether the dense handler runs it (MXFP4 quantizes only experts),
 * the GEMM (kernel_table.c's uniform wrapper) and, for kernels whose GEMM reads quantized row records rather than
 * the rows, the quantizer and a record's bytes (NULL otherwise). The AVX2 kernels read the AVX-512 ones' layouts;
 * int4's group (k-rows per scale) is the layer's, so one row serves every group. */
#ifndef KERNEL_TABLE_H
#define KERNEL_TABLE_H
#include <stdint.h>

enum { MOE_ISA_AVX512 = 0, MOE_ISA_AMX = 1, MOE_ISA_AVX2 = 2 };
enum { MOE_FORMAT_F32 = 0, MOE_FORMAT_BF16 = 1, MOE_FORMAT_INT8 = 2, MOE_FORMAT_INT4 = 3, MOE_FORMAT_MXFP4 = 4 };

/* X(id, name, isa, format, bits, block, dense, gemm, quantize, record_bytes) */
#define MOE_KERNEL_TABLE(X)                                                                                           \
    X(F32_AVX512, "avx512-f32", AVX512, F32, 32, 32, 1, gemm_f32_avx512, NULL, NULL)                                 \
    X(BF16_AMX, "amx-bf16", AMX, BF16, 16, 16, 1, gemm_bf16_amx, NULL, NULL)                                         \
    X(BF16_AVX512, "avx512-bf16", AVX512, BF16, 16, 16, 1, gemm_bf16_avx512, NULL, NULL)                             \
    X(INT8_AVX512, "avx512-int8", AVX512, INT8, 8, 16, 1, gemm_int8_avx512, NULL, NULL)                              \
    X(INT4_AVX512, "avx512-int4", AVX512, INT4, 4, 16, 1, gemm_int4_avx512, int4_quantize_rows, int4_records)        \
    X(F32_AVX2, "avx2-f32", AVX2, F32, 32, 32, 1, gemm_f32_avx2, NULL, NULL)                                         \
    X(BF16_AVX2, "avx2-bf16", AVX2, BF16, 16, 16, 1, gemm_bf16_avx2, NULL, NULL)                                     \
    X(INT8_AVX2, "avx2-int8", AVX2, INT8, 8, 16, 1, gemm_int8_avx2, int8_quantize_rows_avx2, int8_row_bytes_avx2)    \
    X(INT4_AVX2, "avx2-int4", AVX2, INT4, 4, 16, 1, gemm_int4_avx2, int4_quantize_rows_avx2, int4_records)           \
    X(INT8_AMX, "amx-int8", AMX, INT8, 8, 16, 1, gemm_int8_amx, NULL, NULL)                                          \
    X(MXFP4_AVX512, "avx512-mxfp4", AVX512, MXFP4, 4, 16, 0, gemm_mxfp4_avx512, int4_quantize_rows, int4_records)    \
    X(MXFP4_AVX2, "avx2-mxfp4", AVX2, MXFP4, 4, 16, 0, gemm_mxfp4_avx2, int4_quantize_rows_avx2, int4_records)

#define MOE_KERNEL_ENUM(id, ...) MOE_KERNEL_##id,
enum { MOE_KERNEL_TABLE(MOE_KERNEL_ENUM) MOE_KERNEL_COUNT };
#undef MOE_KERNEL_ENUM

/* a: the rows (bfloat16, or float32 for F32 kernels) or their quantized records, stride kp; group: int4's k-rows
 * per scale (ignored by the others); columns [n0, n1) of c (row stride ldc) = a's m rows times packed weight w */
typedef void (*moe_gemm_fn)(const void *a, int64_t kp, const void *w, int64_t group, float *c, int64_t ldc,
                            int64_t m, int64_t n0, int64_t n1);
/* columns [c0, c1) of m bfloat16 rows (stride lda) quantized into their records (kp values a record) */
typedef void (*moe_quantize_fn)(const uint16_t *a, int64_t lda, int64_t m, int64_t c0, int64_t c1, char *q,
                                int64_t kp);

typedef struct {
    const char *name;
    int isa;    /* MOE_ISA_* */
    int format; /* MOE_FORMAT_* */
    int bits;
    int block;
    int dense;
    moe_gemm_fn gemm;
    moe_quantize_fn quantize;            /* NULL: the GEMM reads the rows themselves */
    int64_t (*record_bytes)(int64_t kp); /* bytes of one row's record of kp values, with `quantize` */
} moe_kernel;

/* The row of `code`, or NULL for a code outside the table: every caller refuses what this does not know. */
const moe_kernel *moe_kernel_get(int64_t code);
/* The code of the kernel called `name`, or -1 (exported: Python's lookup by name). */
int moe_kernel_code(const char *name);
/* For code in [0, MOE_KERNEL_COUNT): its name and, in out[5], isa, format, bits, block, dense; NULL for any other
 * code (exported: the test that Python's table and this one agree). */
const char *moe_kernel_describe(int code, int *out);
int moe_kernel_count(void);

#endif
