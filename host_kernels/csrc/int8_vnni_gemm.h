/* Decode-sized GEMMs over int8 weights on AVX512-VNNI (int8_vnni_gemm.c), for bf16_gemm.c's int8_gemm at a few
 * rows. Callers check the CPU's avx512_vnni first. */
#ifndef INT8_VNNI_GEMM_H
#define INT8_VNNI_GEMM_H
#include <stdint.h>

#define INT8_VNNI_CHUNK 128 /* k values per activation scale */

/* bytes of one quantized activation row of kp values (a multiple of 32): kp int16 values, then a float32 scale per
 * INT8_VNNI_CHUNK of them, rounded up to 64 */
int64_t int8_vnni_row_bytes(int64_t kp);
/* m bfloat16 rows [m, kp] (row stride lda) quantized to int16 per chunk, into records at q (int8_vnni_row_bytes) */
void int8_vnni_quantize_rows(const uint16_t *a, int64_t lda, int64_t m, int64_t kp, char *q);
/* C[:, n0:n1] (c points at column n0) = rows q @ B, B int8 in bf16_gemm.h's int8_gemm layout; n0 a multiple of 16 */
void int8_vnni_gemm_quantized(const char *q, int64_t kp, const int8_t *b_packed, float *c, int64_t ldc, int64_t m,
                              int64_t n0, int64_t n1);
/* the same from bfloat16 rows A [m, kp] (row stride lda), quantized first; non-zero where memory runs out */
int int8_vnni_gemm(const uint16_t *a, int64_t lda, const int8_t *b_packed, int64_t kp, float *c, int64_t ldc,
                   int64_t m, int64_t n0, int64_t n1);
#endif
