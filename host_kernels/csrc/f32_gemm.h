/* The AVX-512 FMA float32 GEMM of f32_gemm.c, for the fused expert forward (moe_forward.c) and XLA's dense handler
 * (xla_dense.c). Callers check the CPU's avx512f first; f32_gemm_avx2 (avx2_kernels.h) is its AVX2 variant. */
#ifndef F32_GEMM_H
#define F32_GEMM_H
#include <stdint.h>

/* C[:, n0:n1] = A @ B for B float32 in column blocks of 32 ([n blocks][k][32], host_kernels/f32_gemm.py); c points
 * at column n0 of row 0, n0 a multiple of 32 */
void f32_gemm(const float *a, int64_t lda, const float *b_packed, int64_t k, float *c, int64_t ldc, int64_t m,
              int64_t n0, int64_t n1);

#endif
