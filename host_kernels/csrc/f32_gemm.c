/* float32 GEMM for the fused expert forward of float32 stores, on AVX-512 FMA (loaded with ctypes; see
 * host_kernels/fused_forward.py, which calls it only where the CPU has AVX-512: this file alone is compiled for it).
 *
 * C[m, n] = A[m, k] @ B[k, n], all float32. B is packed once per weight into column blocks of 32:
 * packed[nb][k][32], zero-padded, so each block is one contiguous stream (a decode step's few rows make the GEMM
 * weight-bound: what matters is reading B once, sequentially). Register blocking: up to 8 rows x 32 columns of C
 * in 16 accumulators; a block is re-read (from L2) once per 8 rows.
 */
#pragma GCC target("avx512f")
#include <immintrin.h>
#include <stdint.h>

#include "f32_gemm.h"

#define ROWS 8
/* each block's stream prefetched 2 KB ahead, as the AVX2 kernel's (avx2_gemm.c): the hardware prefetcher alone
 * left a single row from DRAM below numpy's GEMV rate */
#define PREFETCH_BYTES 2048

/* c[0..rows) x 32 columns (store masks m0, m1) = a[0..rows) @ one packed block b. `rows` is a constant in each
 * caller below, so the accumulators stay in registers and the row loop unrolls away. */
static inline __attribute__((always_inline)) void block_rows(const float *a, int64_t lda, const float *b, int64_t k,
                                                             float *c, int64_t ldc, const int rows, __mmask16 m0,
                                                             __mmask16 m1) {
    __m512 acc[ROWS][2];
    for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        _mm_prefetch((const char *)(b + kk * 32) + PREFETCH_BYTES, _MM_HINT_T0); /* 128 bytes a k-row: two lines */
        _mm_prefetch((const char *)(b + kk * 32) + PREFETCH_BYTES + 64, _MM_HINT_T0);
        const __m512 b0 = _mm512_load_ps(b + kk * 32), b1 = _mm512_load_ps(b + kk * 32 + 16);
        for (int i = 0; i < rows; i++) {
            const __m512 x = _mm512_set1_ps(a[i * lda + kk]);
            acc[i][0] = _mm512_fmadd_ps(x, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(x, b1, acc[i][1]);
        }
    }
    for (int i = 0; i < rows; i++) {
        _mm512_mask_storeu_ps(c + i * ldc, m0, acc[i][0]);
        if (m1) _mm512_mask_storeu_ps(c + i * ldc + 16, m1, acc[i][1]);
    }
}

/* Columns [n0, n1) of C, written to c (which points at column n0 of row 0; row stride ldc floats). n0 must be a
 * multiple of 32. A: m rows of k floats, row stride lda. */
void f32_gemm(const float *a, int64_t lda, const float *b_packed, int64_t k, float *c, int64_t ldc, int64_t m,
              int64_t n0, int64_t n1) {
    for (int64_t nb = n0 / 32; nb * 32 < n1; nb++) {
        const float *b = b_packed + nb * k * 32;
        const int64_t width = n1 - nb * 32 < 32 ? n1 - nb * 32 : 32;
        const __mmask16 m0 = width >= 16 ? 0xFFFF : (__mmask16)((1u << width) - 1);
        const __mmask16 m1 = width >= 32 ? 0xFFFF : width > 16 ? (__mmask16)((1u << (width - 16)) - 1) : 0;
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const float *a_rows = a + r0 * lda;
            float *c_rows = c + r0 * ldc + nb * 32 - n0;
            switch (m - r0 < ROWS ? (int)(m - r0) : ROWS) {
                case 1: block_rows(a_rows, lda, b, k, c_rows, ldc, 1, m0, m1); break;
                case 2: block_rows(a_rows, lda, b, k, c_rows, ldc, 2, m0, m1); break;
                case 3: block_rows(a_rows, lda, b, k, c_rows, ldc, 3, m0, m1); break;
                case 4: block_rows(a_rows, lda, b, k, c_rows, ldc, 4, m0, m1); break;
                case 5: block_rows(a_rows, lda, b, k, c_rows, ldc, 5, m0, m1); break;
                case 6: block_rows(a_rows, lda, b, k, c_rows, ldc, 6, m0, m1); break;
                case 7: block_rows(a_rows, lda, b, k, c_rows, ldc, 7, m0, m1); break;
                default: block_rows(a_rows, lda, b, k, c_rows, ldc, 8, m0, m1); break;
            }
        }
    }
}
