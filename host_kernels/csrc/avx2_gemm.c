/* float32 and bfloat16 GEMMs on AVX2 + FMA, for CPUs without AVX-512 (AMD Zen 1-3, Intel Haswell to Alder Lake):
 * the fused expert forward there (moe_forward.c) and host_kernels/f32_gemm.py, bf16_gemm.py.
 * They read the same packed weights as the AVX-512 kernels (f32_gemm.c, bf16_gemm.c), so a store has one packing
 * whichever instruction set runs it. Only this file (and the other avx2_*.c) is compiled for avx2; its callers check
 * the CPU first.
 *
 * - f32_gemm_avx2: float32 weights in column blocks of 32, [n blocks][k][32]; up to 3 rows x 32 columns of C in 12
 *   accumulators, or for a decode step's one row two blocks side by side (two weight streams).
 * - bf16_gemm_avx2: weights in the AMX kernel's k-pair layout (per 16-column block, k-pair rows holding
 *   (B[2r, c], B[2r + 1, c]) for its 16 columns). AVX2 has no bfloat16 products: a k-pair row is split into its
 *   even and odd k-rows as float32 in registers (a shift and an and), and the A row's matching pair is broadcast
 *   once per row and split the same way; two FMAs per 8 columns and row, into separate sums for the
 *   even and odd k-rows (half the length of each float32 sum: its rounding error stays that of XLA's blocked
 *   sums). A decode step (m = 1) reads two column blocks side by side (two weight streams); larger m computes
 *   2 rows x 1 block at a time.
 * - bf16_pack_rows_avx2: amx_gemm.c's bf16_pack_rows (float32 rows rounded into the padded bfloat16 rows these
 *   kernels read), for the engine's GEMMs.
 */
#pragma GCC target("avx2,fma")
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "avx2_kernels.h"
#include "simd_avx2.h"

#define F32_ROWS 3
/* bfloat16: each stream prefetches where the next tile's stream will read, `blocks` blocks on (as
 * avx2_quantized_gemm.c's); float32 a fixed 2 KB ahead: its blocks are long (128 bytes a k-row: 64 KB at k 512), so
 * the next tile's start is past L2 for long k, and the part of a block read before a prefetch lands is small. */
#define F32_PREFETCH_BYTES 2048

/* ------------------------------------------------------------------------------------------------- float32 */

/* c rows [0, rows) x `blocks` blocks of 32 columns (the first `width` stored) = a @ the packed blocks at b; rows
 * and blocks are constants at each call site, so the accumulators stay in registers */
static inline __attribute__((always_inline)) void f32_rows(const float *a, int64_t lda, const float *b, int64_t k,
                                                           float *c, int64_t ldc, const int rows, const int blocks,
                                                           int64_t width) {
    enum { VECTORS = 8 }; /* at most 2 blocks of 4 */
    __m256 acc[F32_ROWS][VECTORS];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < 4 * blocks; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        __m256 w[VECTORS];
        for (int block = 0; block < blocks; block++) {
            const float *row = b + block * k * 32 + kk * 32;
            _mm_prefetch((const char *)row + F32_PREFETCH_BYTES, _MM_HINT_T0); /* 128 bytes a k-row: two lines */
            _mm_prefetch((const char *)row + F32_PREFETCH_BYTES + 64, _MM_HINT_T0);
            for (int j = 0; j < 4; j++) w[4 * block + j] = _mm256_load_ps(row + 8 * j);
        }
        for (int i = 0; i < rows; i++) {
            const __m256 x = _mm256_broadcast_ss(a + i * lda + kk);
            for (int j = 0; j < 4 * blocks; j++) acc[i][j] = _mm256_fmadd_ps(x, w[j], acc[i][j]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < 4 * blocks; j++) store8(c + i * ldc + 8 * j, acc[i][j], width - 8 * j);
}

void f32_gemm_avx2(const float *a, int64_t lda, const float *b_packed, int64_t k, float *c, int64_t ldc, int64_t m,
                   int64_t n0, int64_t n1) {
    int blocks;
    for (int64_t nb = n0 / 32; nb * 32 < n1; nb += blocks) {
        const float *b = b_packed + nb * k * 32;
        const int64_t width = n1 - nb * 32; /* columns left from this block on */
        blocks = m == 1 && width > 32 ? 2 : 1;
        for (int64_t r0 = 0; r0 < m; r0 += F32_ROWS) {
            const float *a_rows = a + r0 * lda;
            float *c_rows = c + r0 * ldc + nb * 32 - n0;
            if (blocks == 2) {
                f32_rows(a_rows, lda, b, k, c_rows, ldc, 1, 2, width);
                continue;
            }
            switch (m - r0 < F32_ROWS ? (int)(m - r0) : F32_ROWS) {
                case 1: f32_rows(a_rows, lda, b, k, c_rows, ldc, 1, 1, width); break;
                case 2: f32_rows(a_rows, lda, b, k, c_rows, ldc, 2, 1, width); break;
                default: f32_rows(a_rows, lda, b, k, c_rows, ldc, F32_ROWS, 1, width); break;
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------------ bfloat16 */

enum { MAX_ROWS = 2, MAX_BLOCKS = 2 };

/* c rows [0, rows) x `blocks` 16-column blocks (the last one's first `cols` stored) = A @ B over all kp / 2
 * k-pairs; rows and blocks are constants at each call site, so the accumulators stay in registers */
static inline __attribute__((always_inline)) void pair_rows(const uint16_t *a, int64_t lda, const char *b, int64_t kp,
                                                            float *c, int64_t ldc, const int rows, const int blocks,
                                                            int cols) {
    __m256 acc[MAX_ROWS][MAX_BLOCKS][2][2]; /* [row][block][half][even, odd k-rows] */
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < blocks; j++)
            for (int h = 0; h < 2; h++) acc[i][j][h][0] = acc[i][j][h][1] = _mm256_setzero_ps();
    const int64_t stride = kp * 32; /* bytes of one block; a k-pair row is 64 */
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t r = 0; r < kp / 2; r++) {
        __m256 x_even[MAX_ROWS], x_odd[MAX_ROWS];
        for (int i = 0; i < rows; i++) { /* the row's pair (A[i, 2r], A[i, 2r + 1]) in every lane, then split */
            const __m256i pair = _mm256_set1_epi32(((const int32_t *)(a + i * lda))[r]);
            x_even[i] = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
            x_odd[i] = _mm256_castsi256_ps(_mm256_and_si256(pair, high));
        }
        for (int j = 0; j < blocks; j++) {
            const char *row = b + j * stride + r * 64;
            _mm_prefetch(row + blocks * stride, _MM_HINT_T0);
            for (int h = 0; h < 2; h++) { /* 8 x (even, odd): the low half moved up, the high half kept */
                const __m256i v = _mm256_load_si256((const __m256i *)(row + 32 * h));
                const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                for (int i = 0; i < rows; i++) {
                    acc[i][j][h][0] = _mm256_fmadd_ps(x_even[i], even, acc[i][j][h][0]);
                    acc[i][j][h][1] = _mm256_fmadd_ps(x_odd[i], odd, acc[i][j][h][1]);
                }
            }
        }
    }
    for (int j = 0; j < blocks; j++)
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < rows; i++)
                store8(c + i * ldc + j * 16 + 8 * h, _mm256_add_ps(acc[i][j][h][0], acc[i][j][h][1]),
                       j == blocks - 1 ? cols - 8 * h : 8);
}

#define PAIR_CASE(R, B) pair_rows(a + r0 * lda, lda, b, kp, c + r0 * ldc + nb * 16 - n0, ldc, R, B, cols)

/* Columns [n0, n1) of C, written to c (column n0 of row 0; row stride ldc floats); n0 a multiple of 16 */
void bf16_gemm_avx2(const uint16_t *a, int64_t lda, const uint16_t *b_packed, int64_t kp, float *c, int64_t ldc,
                    int64_t m, int64_t n0, int64_t n1) {
    AVX2_TILES(m, n0, n1, b_packed, kp * 32, PAIR_CASE);
}

void bf16_pack_rows_avx2(const float *src, int64_t lds, const int64_t *rows, int64_t m, int64_t k, uint16_t *dst,
                         int64_t kp, int64_t mp) {
    for (int64_t i = 0; i < mp; i++) {
        uint16_t *out = dst + i * kp;
        if (i >= m) {
            memset(out, 0, kp * 2);
            continue;
        }
        const float *in = src + (rows ? rows[i] : i) * lds;
        for (int64_t j = 0; j < k; j += 8) {
            const int64_t count = k - j;
            const __m256 v = count >= 8 ? _mm256_loadu_ps(in + j) : _mm256_maskload_ps(in + j, lanes8(count));
            store8_as(out, j, v, count, 1);
        }
        memset(out + k, 0, (kp - k) * 2);
    }
}
