/* GEMMs over int4 weights with a float16 scale per group of k-rows on AVX512-VNNI (int4_gemm.c), for the fused
 * expert forward (moe_forward.c) and XLA's dense handler (host_kernels/csrc/xla_dense.c). Callers check the CPU's
 * avx512_vnni first. */
#ifndef INT4_GEMM_H
#define INT4_GEMM_H
#include <stdint.h>

/* bytes of one quantized activation row of kp (a multiple of 32) values: kp int8 values, then per 32 of them a
 * float32 scale and an int32 offset */
static inline int64_t int4_row_bytes(int64_t kp) { return kp + kp / 32 * 8; }
/* columns [c0, c1) (multiples of 32, c1 <= kp) of m bfloat16 rows (row stride lda) quantized to int8 per 32 values,
 * into the records at q (row stride int4_row_bytes(kp)) */
void int4_quantize_rows(const uint16_t *a, int64_t lda, int64_t m, int64_t c0, int64_t c1, char *q, int64_t kp);
/* C[:, n0:n1] (float32, row stride ldc; c points at column n0) = rows q @ B, B int4 in host_kernels/int4_gemm.py's
 * layout with `group` k-rows per scale; n0 a multiple of 16 */
void int4_gemm_quantized(const char *q, int64_t kp, const uint8_t *b_packed, int64_t group, float *c, int64_t ldc,
                         int64_t m, int64_t n0, int64_t n1);
/* the same from bfloat16 rows A [m, kp] (row stride lda), quantized first; non-zero where memory runs out */
int int4_gemm(const uint16_t *a, int64_t lda, const uint8_t *b_packed, int64_t kp, float *c, int64_t ldc, int64_t m,
              int64_t n0, int64_t n1, int64_t group);

/* the same over MXFP4 weights (group 32, e2m1 codes and e8m0 scales in the int4 layout: int4_gemm.c) */
void mxfp4_gemm_quantized(const char *q, int64_t kp, const uint8_t *b_packed, float *c, int64_t ldc, int64_t m,
                          int64_t n0, int64_t n1);
int mxfp4_gemm(const uint16_t *a, int64_t lda, const uint8_t *b_packed, int64_t kp, float *c, int64_t ldc, int64_t m,
               int64_t n0, int64_t n1);

/* The float32 weights (stored - 8) * scale of `blocks` 16-column blocks, rows [0, k), into out (row stride ldo
 * >= 16 * blocks): what the products compute with, for GEMMs that need the weights themselves (training's
 * backward). */
void int4_unpack(const uint8_t *b_packed, int64_t kp, int64_t group, int64_t blocks, int64_t k, float *out,
                 int64_t ldo);
/* the same weights of W [k, n] rounded to bfloat16 in the tile layout (amx.pack_layout's) of W, or of W^T where
 * `transposed`, a block at a time through `scratch` (16 k floats): training's GEMMs on the bfloat16 kernels */
void int4_unpack_bf16_tiles(const uint8_t *b_packed, int64_t kp, int64_t group, int64_t blocks, int64_t k, int64_t n,
                            int transposed, uint16_t *dst, float *scratch);

#endif
