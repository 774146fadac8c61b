/* GEMMs over int8 and int4 weights on AVX2's integer products, for the fused expert forward (moe_forward.c), XLA's
 * dense handler and host_kernels/int8_gemm.py, int4_gemm.py on CPUs without AVX-512. Both quantize their bfloat16
 * rows to int8 per 32 values first, as llama.cpp does for its Q8_0 and Q4_0 products (quant.quantize_activations
 * is the same rule), so each 32-value chunk's products are exact integer sums, scaled once in float32.
 *
 * int4 (VPMADDUBSW + VPMADDWD in place of AVX512-VNNI's VPDPBUSD, as llama.cpp's Q4_0 products do on these CPUs): Weights in int4_gemm.c's packed layout, activations in its quantized row records
 * (int4_gemm.h), which `int4_quantize_rows_avx2` writes bit for bit as `int4_quantize_rows` does: the integer
 * sums are exact in both, so both kernels compute the same products and differ only in float32 summation order.
 *
 * Per 64-byte row of a 16-column block (8 k-rows: byte 4c + i holds column c's k-row 8r + i in its low nibble and
 * 8r + 4 + i in its high one), each 32-byte half (8 columns): the nibbles masked out, multiplied by the row's four
 * matching int8 activations and summed in pairs (maddubs: at most 2 x 15 x 128 per 16-bit lane), the low and high
 * nibbles' pair sums added (at most 7,680: no saturation), then the pairs summed to one int32 per column (madd).
 *
 * int8 (bf16_gemm.c's int8 layout: per 16-column block, k-pair rows of 32 bytes, then 16 float32 scales): each
 * half row (8 columns' pairs) sign-extended to 16 bits and multiplied by the activations' matching pair with
 * VPMADDWD, one int32 per column (3 instructions per 8 columns and k-pair where widening to float32 took 8). Its
 * rows' records hold the int8 values widened to int16, so a pair is one broadcast load (int8_row_bytes_avx2).
 *
 * Register blocking: one row x two blocks (decode: two weight streams) or two rows x one block.
 * Only this file is compiled for avx2 + f16c (the float16 scales); its callers check the CPU first.
 */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "avx2_kernels.h"
#include "int4_gemm.h"
#include "simd_avx2.h"

#define CHUNK 32           /* activations' quantization block, in k */
#define SCALE_BYTES 32     /* 16 float16 scales per group and block */
/* Each stream prefetches where the next tile's stream will read: `blocks` blocks on. A fixed 2 KB ahead within
 * the block left each tile's first 2 KB to DRAM latency, a large share of the bytes of short blocks. */

static inline int64_t block_bytes(int64_t kp, int64_t group) {
    return kp * 8 + (kp + group - 1) / group * SCALE_BYTES;
}

int64_t int8_row_bytes_avx2(int64_t kp) { return kp * 2 + kp / CHUNK * 4; }

/* 32 bfloat16 values quantized to nearest of d = max |x| / 127 (as int4_quantize_rows): the values in v (int32,
 * within [-127, 127]), d returned, their sum in *sum */
static inline float quantize_chunk(const uint16_t *x, __m256i v[4], int32_t *sum) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 f[4], absmax = _mm256_setzero_ps();
    for (int h = 0; h < 4; h++) {
        f[h] = widen_bf16x8(x + 8 * h);
        absmax = _mm256_max_ps(absmax, _mm256_and_ps(f[h], magnitude));
    }
    const float d = hmax8(absmax) / 127.0f, inverse = d > 0 ? 1.0f / d : 0.0f;
    __m256i total = _mm256_setzero_si256();
    for (int h = 0; h < 4; h++) {
        v[h] = _mm256_cvtps_epi32(_mm256_mul_ps(f[h], _mm256_set1_ps(inverse)));
        total = _mm256_add_epi32(total, v[h]);
    }
    *sum = hsum8_epi32(total);
    return d;
}

void int4_quantize_rows_avx2(const uint16_t *a, int64_t lda, int64_t m, int64_t c0, int64_t c1, char *q, int64_t kp) {
    const int64_t stride = int4_row_bytes(kp);
    for (int64_t i = 0; i < m; i++) {
        int8_t *values = (int8_t *)(q + i * stride);
        float *scales = (float *)(q + i * stride + kp);
        int32_t *offsets = (int32_t *)(scales + kp / CHUNK);
        for (int64_t c = c0; c < c1; c += CHUNK) {
            __m256i v[4];
            int32_t sum;
            scales[c / CHUNK] = quantize_chunk(a + i * lda + c, v, &sum);
            offsets[c / CHUNK] = -8 * sum;
            /* packs interleave the 128-bit lanes: 32-bit groups come out as 0 4 1 5 2 6 3 7; the permute undoes it */
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
            _mm256_storeu_si256((__m256i *)(values + c),
                                _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
    }
}

void int8_quantize_rows_avx2(const uint16_t *a, int64_t lda, int64_t m, int64_t c0, int64_t c1, char *q, int64_t kp) {
    const int64_t stride = int8_row_bytes_avx2(kp);
    for (int64_t i = 0; i < m; i++) {
        int16_t *values = (int16_t *)(q + i * stride);
        float *scales = (float *)(values + kp);
        for (int64_t c = c0; c < c1; c += CHUNK) {
            __m256i v[4];
            int32_t sum;
            scales[c / CHUNK] = quantize_chunk(a + i * lda + c, v, &sum);
            const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7); /* packs' lane interleave, undone */
            for (int h = 0; h < 2; h++)
                _mm256_storeu_si256((__m256i *)(values + c + 16 * h),
                                    _mm256_permutevar8x32_epi32(_mm256_packs_epi32(v[2 * h], v[2 * h + 1]), order));
        }
    }
}

/* 8 columns' MXFP4 scales (e8m0 bytes) as 2^(e - 128): int4_gemm.c's e8m0_half16 */
static inline __m256 e8m0_half8(const char *scales) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)scales));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i is_tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, is_tiny));
}

/* c rows [0, rows) x `blocks` blocks of 16 columns (the last one's first `cols` stored), from quantized rows q
 * (row stride int4_row_bytes(kp)) and the weight blocks at b (int4, or MXFP4 when `mxfp4`: int4_gemm.c); rows,
 * blocks and mxfp4 are constants at each call site */
static inline __attribute__((always_inline)) void block_rows(const char *q, int64_t kp, const char *b, int64_t group,
                                                             float *c, int64_t ldc, const int rows, const int blocks,
                                                             int cols, const int mxfp4) {
    enum { MAX_ROWS = 2, MAX_BLOCKS = 2 };
    const int64_t stride = block_bytes(kp, group), q_stride = int4_row_bytes(kp);
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i e2m1 = _mm256_broadcastsi128_si256(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    __m256 acc[MAX_ROWS][MAX_BLOCKS][2];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < blocks; j++) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < kp; g0 += group) {
        const int64_t g1 = g0 + group < kp ? g0 + group : kp;
        const char *gb = b + g0 / group * (group * 8 + SCALE_BYTES); /* this group in block 0 */
        for (int64_t c0 = g0; c0 < g1; c0 += CHUNK) {
            __m256i sums[MAX_ROWS][MAX_BLOCKS][2];
            for (int i = 0; i < rows; i++) {
                const int32_t *offsets = (const int32_t *)(q + i * q_stride + kp + kp / CHUNK * 4);
                const int32_t offset = mxfp4 ? offsets[c0 / CHUNK] / 2 * 3 : offsets[c0 / CHUNK];
                for (int j = 0; j < blocks; j++) sums[i][j][0] = sums[i][j][1] = _mm256_set1_epi32(offset);
            }
            for (int64_t r = 0; r < CHUNK / 8; r++) { /* 8 k-rows per 64-byte row: two quads */
                __m256i x0[MAX_ROWS], x1[MAX_ROWS];
                for (int i = 0; i < rows; i++) {
                    const int32_t *quads = (const int32_t *)(q + i * q_stride + c0 + r * 8);
                    x0[i] = _mm256_set1_epi32(quads[0]), x1[i] = _mm256_set1_epi32(quads[1]);
                }
                for (int j = 0; j < blocks; j++) {
                    const char *row = gb + j * stride + (c0 - g0) * 8 + r * 64;
                    _mm_prefetch(row + blocks * stride, _MM_HINT_T0);
                    for (int h = 0; h < 2; h++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(row + 32 * h));
                        __m256i lo = _mm256_and_si256(v, low4);
                        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                        if (mxfp4) lo = _mm256_shuffle_epi8(e2m1, lo), hi = _mm256_shuffle_epi8(e2m1, hi);
                        for (int i = 0; i < rows; i++) {
                            const __m256i pairs =
                                _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0[i]), _mm256_maddubs_epi16(hi, x1[i]));
                            sums[i][j][h] = _mm256_add_epi32(sums[i][j][h], _mm256_madd_epi16(pairs, ones));
                        }
                    }
                }
            }
            for (int j = 0; j < blocks; j++)
                for (int h = 0; h < 2; h++) {
                    const char *scales = gb + j * stride + (g1 - g0) * 8;
                    const __m256 weight_scale = mxfp4 ? e8m0_half8(scales + 8 * h)
                                                      : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 16 * h)));
                    for (int i = 0; i < rows; i++) {
                        const __m256 row_scale = _mm256_set1_ps(((const float *)(q + i * q_stride + kp))[c0 / CHUNK]);
                        acc[i][j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i][j][h]),
                                                       _mm256_mul_ps(weight_scale, row_scale), acc[i][j][h]);
                    }
                }
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < blocks; j++)
            for (int h = 0; h < 2; h++)
                store8(c + i * ldc + j * 16 + 8 * h, acc[i][j][h], j == blocks - 1 ? cols - 8 * h : 8);
}

#define BLOCK_CASE(R, B) \
    block_rows(q + r0 * q_stride, kp, b, group, c + r0 * ldc + nb * 16 - n0, ldc, R, B, cols, mxfp4)

static inline __attribute__((always_inline)) void quantized_gemm(const char *q, int64_t kp, const uint8_t *b_packed,
                                                                 int64_t group, float *c, int64_t ldc, int64_t m,
                                                                 int64_t n0, int64_t n1, const int mxfp4) {
    const int64_t q_stride = int4_row_bytes(kp);
    AVX2_TILES(m, n0, n1, b_packed, block_bytes(kp, group), BLOCK_CASE);
}

void int4_gemm_quantized_avx2(const char *q, int64_t kp, const uint8_t *b_packed, int64_t group, float *c,
                              int64_t ldc, int64_t m, int64_t n0, int64_t n1) {
    quantized_gemm(q, kp, b_packed, group, c, ldc, m, n0, n1, 0);
}

void mxfp4_gemm_quantized_avx2(const char *q, int64_t kp, const uint8_t *b_packed, float *c, int64_t ldc, int64_t m,
                               int64_t n0, int64_t n1) {
    quantized_gemm(q, kp, b_packed, 32, c, ldc, m, n0, n1, 1);
}

/* the rows quantized first (int4's records, for both formats), then the product; non-zero where memory runs out */
static int from_rows(const uint16_t *a, int64_t lda, const uint8_t *b_packed, int64_t kp, float *c, int64_t ldc,
                     int64_t m, int64_t n0, int64_t n1, int64_t group, int mxfp4) {
    char *q = malloc((size_t)(m * int4_row_bytes(kp)));
    if (!q) return 1;
    int4_quantize_rows_avx2(a, lda, m, 0, kp, q, kp);
    quantized_gemm(q, kp, b_packed, group, c, ldc, m, n0, n1, mxfp4);
    free(q);
    return 0;
}

int int4_gemm_avx2(const uint16_t *a, int64_t lda, const uint8_t *b_packed, int64_t kp, float *c, int64_t ldc,
              int64_t m, int64_t n0, int64_t n1, int64_t group) {
    return from_rows(a, lda, b_packed, kp, c, ldc, m, n0, n1, group, 0);
}

int mxfp4_gemm_avx2(const uint16_t *a, int64_t lda, const uint8_t *b_packed, int64_t kp, float *c, int64_t ldc,
               int64_t m, int64_t n0, int64_t n1) {
    return from_rows(a, lda, b_packed, kp, c, ldc, m, n0, n1, 32, 1);
}

void int4_unpack_avx2(const uint8_t *b_packed, int64_t kp, int64_t group, int64_t blocks, int64_t k, float *out,
                      int64_t ldo) {
    const int64_t stride = block_bytes(kp, group);
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    const __m256 eight = _mm256_set1_ps(8.0f);
    for (int64_t nb = 0; nb < blocks; nb++) {
        const char *block = (const char *)b_packed + nb * stride;
        for (int64_t g0 = 0; g0 < k; g0 += group) {
            const int64_t g1 = g0 + group < kp ? g0 + group : kp;
            const char *gb = block + g0 / group * (group * 8 + SCALE_BYTES);
            for (int h = 0; h < 2; h++) { /* columns [8h, 8h + 8) of the block */
                const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gb + (g1 - g0) * 8 + 16 * h)));
                for (int64_t r = g0; r < g1 && r < k; r += 8) {
                    /* lane c: column c's 4 bytes, k-rows r..r+3 in the low nibbles, r+4..r+7 in the high ones */
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(gb + (r - g0) * 8 + 32 * h));
                    for (int i = 0; i < 8 && r + i < k; i++) {
                        const __m256i shift = _mm256_set1_epi32(8 * (i & 3) + 4 * (i >> 2));
                        const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(v, shift), low4);
                        const __m256 w = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(q), eight), scale);
                        _mm256_storeu_ps(out + (r + i) * ldo + nb * 16 + 8 * h, w);
                    }
                }
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------------- int8 */

/* c rows [0, rows) x `blocks` blocks (the last one's first `cols` stored) from int8 row records q (row stride
 * int8_row_bytes_avx2(kp)) and int8 weight blocks at b (block stride kp * 16 + 64) */
static inline __attribute__((always_inline)) void int8_block_rows(const char *q, int64_t kp, const char *b, float *c,
                                                                  int64_t ldc, const int rows, const int blocks,
                                                                  int cols) {
    enum { MAX_ROWS = 2, MAX_BLOCKS = 2 };
    const int64_t stride = kp * 16 + 64, q_stride = int8_row_bytes_avx2(kp);
    __m256 acc[MAX_ROWS][MAX_BLOCKS][2];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < blocks; j++) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
    for (int64_t c0 = 0; c0 < kp; c0 += CHUNK) {
        __m256i sums[MAX_ROWS][MAX_BLOCKS][2];
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < blocks; j++) sums[i][j][0] = sums[i][j][1] = _mm256_setzero_si256();
        for (int64_t r = c0 / 2; r < (c0 + CHUNK) / 2; r++) { /* the chunk's k-pairs */
            __m256i x[MAX_ROWS];
            for (int i = 0; i < rows; i++) x[i] = _mm256_set1_epi32(((const int32_t *)(q + i * q_stride))[r]);
            for (int j = 0; j < blocks; j++) {
                const char *row = b + j * stride + r * 32;
                _mm_prefetch(row + blocks * stride, _MM_HINT_T0);
                for (int h = 0; h < 2; h++) {
                    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + 16 * h)));
                    for (int i = 0; i < rows; i++)
                        sums[i][j][h] = _mm256_add_epi32(sums[i][j][h], _mm256_madd_epi16(w, x[i]));
                }
            }
        }
        for (int i = 0; i < rows; i++) {
            const __m256 row_scale = _mm256_set1_ps(((const float *)(q + i * q_stride + kp * 2))[c0 / CHUNK]);
            for (int j = 0; j < blocks; j++)
                for (int h = 0; h < 2; h++)
                    acc[i][j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i][j][h]), row_scale, acc[i][j][h]);
        }
    }
    for (int j = 0; j < blocks; j++)
        for (int h = 0; h < 2; h++) {
            const __m256 scale = _mm256_loadu_ps((const float *)(b + j * stride + kp * 16) + 8 * h);
            for (int i = 0; i < rows; i++)
                store8(c + i * ldc + j * 16 + 8 * h, _mm256_mul_ps(acc[i][j][h], scale),
                       j == blocks - 1 ? cols - 8 * h : 8);
        }
}

#define INT8_CASE(R, B) int8_block_rows(q + r0 * q_stride, kp, b, c + r0 * ldc + nb * 16 - n0, ldc, R, B, cols)

void int8_gemm_quantized_avx2(const char *q, int64_t kp, const int8_t *b_packed, float *c, int64_t ldc, int64_t m,
                              int64_t n0, int64_t n1) {
    const int64_t q_stride = int8_row_bytes_avx2(kp);
    AVX2_TILES(m, n0, n1, b_packed, kp * 16 + 64, INT8_CASE);
}

int int8_gemm_avx2(const uint16_t *a, int64_t lda, const int8_t *b_packed, int64_t kp, float *c, int64_t ldc,
                   int64_t m, int64_t n0, int64_t n1) {
    char *q = malloc((size_t)(m * int8_row_bytes_avx2(kp)));
    if (!q) return 1;
    int8_quantize_rows_avx2(a, lda, m, 0, kp, q, kp);
    int8_gemm_quantized_avx2(q, kp, b_packed, c, ldc, m, n0, n1);
    free(q);
    return 0;
}
