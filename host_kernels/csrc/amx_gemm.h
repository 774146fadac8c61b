/* The AMX GEMMs of amx_gemm.c, for the fused expert forward (moe_forward.c) and XLA's dense handler
 * (host_kernels/csrc/xla_dense.c), and where a column block starts in a weight packed for them. */
#ifndef AMX_GEMM_H
#define AMX_GEMM_H
#include <stdint.h>

void amx_gemm(const uint16_t *a, int64_t lda, const uint16_t *b_packed, int64_t kp, float *c, int64_t ldc,
              int64_t m, int64_t n0, int64_t n1);
/* int8 weights with a scale per column (bf16_gemm.h's int8_gemm layout): widened to bfloat16 on the tiles above 16
 * rows, int8_gemm's stream at or below */
void int8_gemm_amx(const uint16_t *a, int64_t lda, const int8_t *b_packed, int64_t kp, float *c, int64_t ldc,
                   int64_t m, int64_t n0, int64_t n1);
void amx_gemm_4_streams(const uint16_t *a, int64_t lda, int64_t kp, const uint16_t *const b[4], float *const c[4],
                        int64_t ldc, int64_t m);

/* Column block nb (16 columns, all kp rows) of a packed weight: one contiguous stream */
static inline const uint16_t *amx_block(const void *packed, int64_t kp, int64_t nb) {
    return (const uint16_t *)packed + nb * kp * 16;
}

#endif
