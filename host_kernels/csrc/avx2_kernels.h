/* The AVX2 + FMA kernels (avx2_gemm.c, avx2_quantized_gemm.c, avx2_swiglu.c), for the fused expert forward
 * (moe_forward.c) and the host_kernels modules on CPUs without AVX-512. Each has the arguments of its AVX-512
 * namesake (f32_gemm.c, bf16_gemm.h, int4_gemm.h, swiglu.c) and reads the same packed weights; int8_gemm_avx2
 * quantizes its rows first, so it can run out of memory (non-zero) as int4_gemm does. Callers check the CPU's avx2
 * and fma (and f16c for int4) first. */
#ifndef AVX2_KERNELS_H
#define AVX2_KERNELS_H
#include <stdint.h>

void f32_gemm_avx2(const float *a, int64_t lda, const float *b_packed, int64_t k, float *c, int64_t ldc, int64_t m,
                   int64_t n0, int64_t n1);
void bf16_gemm_avx2(const uint16_t *a, int64_t lda, const uint16_t *b_packed, int64_t kp, float *c, int64_t ldc,
                    int64_t m, int64_t n0, int64_t n1);
void bf16_pack_rows_avx2(const float *src, int64_t lds, const int64_t *rows, int64_t m, int64_t k, uint16_t *dst,
                         int64_t kp, int64_t mp);

/* int8 weights: columns [c0, c1) of m bfloat16 rows quantized per 32 values (int4_quantize_rows' rule) into
 * records of int8_row_bytes_avx2(kp) bytes: the kp values widened to int16, then a float32 scale per 32 */
int64_t int8_row_bytes_avx2(int64_t kp);
void int8_quantize_rows_avx2(const uint16_t *a, int64_t lda, int64_t m, int64_t c0, int64_t c1, char *q, int64_t kp);
void int8_gemm_quantized_avx2(const char *q, int64_t kp, const int8_t *b_packed, float *c, int64_t ldc, int64_t m,
                              int64_t n0, int64_t n1);
int int8_gemm_avx2(const uint16_t *a, int64_t lda, const int8_t *b_packed, int64_t kp, float *c, int64_t ldc,
                   int64_t m, int64_t n0, int64_t n1);

void int4_quantize_rows_avx2(const uint16_t *a, int64_t lda, int64_t m, int64_t c0, int64_t c1, char *q, int64_t kp);
void int4_gemm_quantized_avx2(const char *q, int64_t kp, const uint8_t *b_packed, int64_t group, float *c,
                              int64_t ldc, int64_t m, int64_t n0, int64_t n1);
void int4_unpack_avx2(const uint8_t *b_packed, int64_t kp, int64_t group, int64_t blocks, int64_t k, float *out,
                      int64_t ldo);
int int4_gemm_avx2(const uint16_t *a, int64_t lda, const uint8_t *b_packed, int64_t kp, float *c, int64_t ldc,
                   int64_t m, int64_t n0, int64_t n1, int64_t group);

void mxfp4_gemm_quantized_avx2(const char *q, int64_t kp, const uint8_t *b_packed, float *c, int64_t ldc, int64_t m,
                               int64_t n0, int64_t n1);
int mxfp4_gemm_avx2(const uint16_t *a, int64_t lda, const uint8_t *b_packed, int64_t kp, float *c, int64_t ldc,
                    int64_t m, int64_t n0, int64_t n1);

void swiglu_forward_avx2(const float *hg, int64_t ld_g, const float *hu, int64_t ld_u, void *act, int64_t ld_a,
                         int bf16, int64_t m, int64_t n);
void swiglu_backward_avx2(const float *hg, int64_t ld_g, const float *hu, int64_t ld_u, const float *grad,
                          int64_t ld_grad, const float *weight, void *dh_gate, void *dh_up, int64_t ld_dh, int bf16,
                          float *dw, int64_t ld_dw, float *act, int64_t ld_a, int64_t m, int64_t n);
void clamped_swiglu_forward_avx2(const float *hg, int64_t ld_g, const float *hu, int64_t ld_u, void *act,
                                 int64_t ld_a, int bf16, int64_t m, int64_t n, float alpha, float limit);
void clamped_swiglu_backward_avx2(const float *hg, int64_t ld_g, const float *hu, int64_t ld_u, const float *grad,
                                  int64_t ld_grad, const float *weight, void *dh_gate, void *dh_up, int64_t ld_dh,
                                  int bf16, float *dw, int64_t ld_dw, float *act, int64_t ld_a, int64_t m, int64_t n,
                                  float alpha, float limit);

#endif
