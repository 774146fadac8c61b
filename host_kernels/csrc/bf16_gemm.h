/* The AVX512-BF16 GEMMs of bf16_gemm.c, for the fused expert forward (moe_forward.c) and XLA's dense handler
 * (host_kernels/csrc/xla_dense.c) on CPUs without AMX. Callers check the CPU's avx512_bf16 first. */
#ifndef BF16_GEMM_H
#define BF16_GEMM_H
#include <stdint.h>

/* C[:, n0:n1] = A @ B for B bfloat16 in the AMX kernel's packed layout (amx_gemm.h) */
void bf16_gemm(const uint16_t *a, int64_t lda, const uint16_t *b_packed, int64_t kp, float *c, int64_t ldc,
               int64_t m, int64_t n0, int64_t n1);
/* the same for int8 weights with a scale per column (host_kernels/int8_gemm.py's layout) */
void int8_gemm(const uint16_t *a, int64_t lda, const int8_t *b_packed, int64_t kp, float *c, int64_t ldc, int64_t m,
               int64_t n0, int64_t n1);

/* int8_gemm's layout, for a kernel that multiplies its weights as bfloat16 (int8_gemm above a few rows,
 * amx_gemm.c's int8_gemm_amx): `count` column blocks from block nb widened (exact) into dst, count * kp * 16
 * bfloat16 in the bfloat16 packing (64-byte aligned); and the scales of the `width` columns from block nb applied
 * to m rows of c (row stride ldc) */
void int8_widen_blocks(const int8_t *b_packed, int64_t kp, int64_t nb, int64_t count, uint16_t *dst);
void int8_scale_columns(const int8_t *b_packed, int64_t kp, int64_t nb, int64_t width, float *c, int64_t ldc,
                        int64_t m);
#endif
