/* bfloat16 GEMM on AVX512-BF16 (VDPBF16PS), for CPUs with those instructions but no AMX (AMD Zen 4/5, Intel
 * Cooper Lake): the fused expert forward of bfloat16 stores there (moe_forward.c) and host_kernels/bf16_gemm.py.
 * Only this file is compiled for avx512bf16; its callers check the CPU first.
 *
 * C[m, n] (float32) = A[m, k] (bfloat16, row-major, k padded with zeros to an even count) @ B[k, n], float32
 * accumulation. B is the AMX kernel's packed layout (amx_gemm.c): per 16-column block, k-pair rows of 64 bytes
 * holding (B[2r, c], B[2r + 1, c]) for its 16 columns c, the block's rows contiguous. That is exactly one
 * VDPBF16PS operand: one load gives a k-pair for 16 columns, and the A row's matching pair is broadcast as one
 * 32-bit value. So both kernels share one packing and one weight stream per column block.
 *
 * Register blocking: up to 6 rows x 4 column blocks (64 columns) of C in 24 accumulators, four weight streams read
 * side by side (at decode sizes the product is bound by reading B: one core reads four streams faster than one),
 * prefetched a few rows ahead. Larger m re-reads a 64-column strip (kp x 128 bytes, from L2) once per 6 rows.
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
#include <immintrin.h>
#include <stdint.h>

#define ROWS 6
#define BLOCKS 4
#define PREFETCH_ROWS 8 /* k-pair rows (64 bytes each) ahead of the one loaded, per stream */

/* c rows [0, rows) x blocks 16-column blocks of C += A @ B over all kp / 2 k-pairs. `rows` and `blocks` are
 * constants at each call site below, so the accumulators stay in registers. cols: valid columns of the last
 * block (1..16). */
static inline __attribute__((always_inline)) void block_rows(const uint16_t *a, int64_t lda, const uint16_t *b,
                                                             int64_t kp, float *c, int64_t ldc, const int rows,
                                                             const int blocks, int cols) {
    __m512 acc[ROWS][BLOCKS];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < blocks; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t pairs = kp / 2, stride = kp * 16; /* uint16 elements from one column block to the next */
    for (int64_t r = 0; r < pairs; r++) {
        __m512bh w[BLOCKS];
        for (int j = 0; j < blocks; j++) {
            const uint16_t *row = b + j * stride + r * 32;
            _mm_prefetch((const char *)(row + PREFETCH_ROWS * 32), _MM_HINT_T0);
            w[j] = (__m512bh)_mm512_load_si512((const void *)row);
        }
        for (int i = 0; i < rows; i++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32(((const int32_t *)(a + i * lda))[r]);
            for (int j = 0; j < blocks; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, w[j]);
        }
    }
    const __mmask16 last = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < blocks; j++)
            _mm512_mask_storeu_ps(c + i * ldc + j * 16, j == blocks - 1 ? last : (__mmask16)0xFFFF, acc[i][j]);
}

#define ROWS_CASES(BLOCKS_N)                                                                  \
    switch (rows) {                                                                           \
        case 1: block_rows(a_rows, lda, b, kp, c_rows, ldc, 1, BLOCKS_N, cols); break;        \
        case 2: block_rows(a_rows, lda, b, kp, c_rows, ldc, 2, BLOCKS_N, cols); break;        \
        case 3: block_rows(a_rows, lda, b, kp, c_rows, ldc, 3, BLOCKS_N, cols); break;        \
        case 4: block_rows(a_rows, lda, b, kp, c_rows, ldc, 4, BLOCKS_N, cols); break;        \
        case 5: block_rows(a_rows, lda, b, kp, c_rows, ldc, 5, BLOCKS_N, cols); break;        \
        default: block_rows(a_rows, lda, b, kp, c_rows, ldc, ROWS, BLOCKS_N, cols); break;    \
    }

/* Columns [n0, n1) of C, written to c (which points at column n0 of row 0; row stride ldc floats). n0 must be a
 * multiple of 16; kp (the packed k: a multiple of 32) is also the row length A is read over (lda >= kp). */
void bf16_gemm(const uint16_t *a, int64_t lda, const uint16_t *b_packed, int64_t kp, float *c, int64_t ldc,
               int64_t m, int64_t n0, int64_t n1) {
    for (int64_t nb = n0 / 16; nb * 16 < n1; nb += BLOCKS) {
        const int64_t width = n1 - nb * 16; /* columns left from this block on */
        const int blocks = width >= BLOCKS * 16 ? BLOCKS : (int)((width + 15) / 16);
        const int cols = (int)(width - (blocks - 1) * 16 < 16 ? width - (blocks - 1) * 16 : 16);
        const uint16_t *b = b_packed + nb * kp * 16;
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
