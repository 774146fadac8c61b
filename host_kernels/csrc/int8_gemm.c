/* GEMM over int8 weights with a float32 scale per output column, on AVX512-BF16: the fused expert forward of int8
 * stores (moe_forward.c) and host_kernels/int8_gemm.py. Only this file is compiled for avx512bf16; its callers check
 * the CPU first.
 *
 * C[m, n] (float32) = A[m, k] (bfloat16 rows, k zero-padded to kp) @ (Q[k, n] * scale[n]), Q int8. A weight-bound
 * (decode) product reads 1 byte per weight, a quarter of float32 and half of bfloat16. Each int8 is exact in
 * bfloat16, so the products are those of the bfloat16 kernel (bf16_gemm.c) on the dequantized weights, with the
 * scale applied once per output: sum_k a[k] q[k, c] * scale[c].
 *
 * Packed layout, per 16-column block: kp / 2 rows of 32 bytes, each the k-pair (Q[2r, c], Q[2r + 1, c]) for the
 * block's 16 columns c (the pair order VDPBF16PS reads), then the block's 16 float32 scales: one contiguous stream
 * of kp * 16 + 64 bytes. The int8 pairs are widened to bfloat16 in registers (two sign extensions, two
 * conversions and a pack per 32 weights).
 *
 * Register blocking as bf16_gemm.c: up to 6 rows x 4 column blocks, four weight streams side by side.
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
#include <immintrin.h>
#include <stdint.h>

#define ROWS 6
#define BLOCKS 4
#define PREFETCH_ROWS 16 /* k-pair rows (32 bytes each) ahead of the one loaded, per stream */

static inline int64_t block_bytes(int64_t kp) { return kp * 16 + 64; }

/* 32 int8 weights (a k-pair row of 16 columns) as 32 bfloat16 in the same order */
static inline __m512bh widen(const int8_t *q) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

static inline __attribute__((always_inline)) void block_rows(const uint16_t *a, int64_t lda, const int8_t *b,
                                                             int64_t kp, float *c, int64_t ldc, const int rows,
                                                             const int blocks, int cols) {
    __m512 acc[ROWS][BLOCKS];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < blocks; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t pairs = kp / 2, stride = block_bytes(kp);
    for (int64_t r = 0; r < pairs; r++) {
        __m512bh w[BLOCKS];
        for (int j = 0; j < blocks; j++) {
            const int8_t *row = b + j * stride + r * 32;
            _mm_prefetch((const char *)(row + PREFETCH_ROWS * 32), _MM_HINT_T0);
            w[j] = widen(row);
        }
        for (int i = 0; i < rows; i++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32(((const int32_t *)(a + i * lda))[r]);
            for (int j = 0; j < blocks; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, w[j]);
        }
    }
    const __mmask16 last = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
    for (int j = 0; j < blocks; j++) {
        const __m512 scale = _mm512_loadu_ps((const float *)(b + j * stride + kp * 16));
        for (int i = 0; i < rows; i++)
            _mm512_mask_storeu_ps(c + i * ldc + j * 16, j == blocks - 1 ? last : (__mmask16)0xFFFF,
                                  _mm512_mul_ps(acc[i][j], scale));
    }
}

#define ROWS_CASES(BLOCKS_N)                                                               \
    switch (rows) {                                                                        \
        case 1: block_rows(a_rows, lda, b, kp, c_rows, ldc, 1, BLOCKS_N, cols); break;     \
        case 2: block_rows(a_rows, lda, b, kp, c_rows, ldc, 2, BLOCKS_N, cols); break;     \
        case 3: block_rows(a_rows, lda, b, kp, c_rows, ldc, 3, BLOCKS_N, cols); break;     \
        case 4: block_rows(a_rows, lda, b, kp, c_rows, ldc, 4, BLOCKS_N, cols); break;     \
        case 5: block_rows(a_rows, lda, b, kp, c_rows, ldc, 5, BLOCKS_N, cols); break;     \
        default: block_rows(a_rows, lda, b, kp, c_rows, ldc, ROWS, BLOCKS_N, cols); break; \
    }

/* Columns [n0, n1) of C, written to c (which points at column n0 of row 0; row stride ldc floats). n0 must be a
 * multiple of 16; kp (the packed k: a multiple of 32) is also the row length A is read over (lda >= kp). */
void int8_gemm(const uint16_t *a, int64_t lda, const int8_t *b_packed, int64_t kp, float *c, int64_t ldc, int64_t m,
               int64_t n0, int64_t n1) {
    for (int64_t nb = n0 / 16; nb * 16 < n1; nb += BLOCKS) {
        const int64_t width = n1 - nb * 16;
        const int blocks = width >= BLOCKS * 16 ? BLOCKS : (int)((width + 15) / 16);
        const int cols = (int)(width - (blocks - 1) * 16 < 16 ? width - (blocks - 1) * 16 : 16);
        const int8_t *b = b_packed + nb * block_bytes(kp);
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const uint16_t *a_rows = a + r0 * lda;
            float *c_rows = c + r0 * ldc + nb * 16 - n0;
            const int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;
            switch (blocks) {
                case 1: ROWS_CASES(1) break;
                case 2: ROWS_CASES(2) break;
                case 3: ROWS_CASES(3) break;
                default: ROWS_CASES(BLOCKS) break;
            }
        }
    }
}
