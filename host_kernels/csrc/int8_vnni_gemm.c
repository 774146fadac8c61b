/* Decode-sized GEMMs over int8 weights on AVX512-VNNI's VPDPWSSD (16 x 2 products of signed 16-bit words per
 * instruction, summed into int32), for int8_gemm (bf16_gemm.c) at a few rows, on every CPU with AVX-512 int8
 * experts (AMD Zen 4/5, Intel Cooper Lake and later; under int8_gemm_amx's tiles on Sapphire Rapids). Only this
 * file is compiled for avx512vnni; its callers check the CPU first.
 *
 * Why: a few rows are bound by turning weights into operands. Widening each 32 int8 weights to bfloat16 takes two
 * sign extensions, two conversions and a pack (slower than DRAM delivers them); here one sign extension to 16
 * bits gives the VPDPWSSD operand, because int8_gemm's layout (per 16-column block, k-pair rows of 32 bytes) is
 * already the word-pair order VPDPWSSD reads.
 *
 * Activations: each bfloat16 row is quantized to int16 per CHUNK values with a power-of-two scale d = 2^(e - 14),
 * e the exponent of the chunk's largest magnitude, q = round(a / d) to nearest even (|q| < 2^15). A bfloat16 value
 * carries 8 significant bits, so every value within 2^7 of the chunk's largest is exact, and any other is off by at
 * most d / 2 <= max |a| / 2^15 (llama.cpp's int8 activations: max |a| / 254). quant.quantize_activations_int16 is
 * the same rule. A chunk's products are exact int32 sums (CHUNK x 2^15 x 127 < 2^31), scaled once by d in float32,
 * the column scales applied at the end.
 *
 * Register blocking: 1-2 rows read each block front to back as one stream (four integer sums a row, consecutive
 * k-pair rows in turn); more rows, up to 6 rows x 4 column blocks of int32 sums (24 registers; four weight
 * streams side by side, prefetched ahead), the float32 sums kept in the output between chunks.
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int8_vnni_gemm.h"
#include "simd.h"

/* ahead of the k-pair row loaded: always in the one stream of 1-2 rows; per stream of the tiles at 3 or more rows
 * (at fewer, four streams read faster on the hardware prefetcher alone) */
#define PREFETCH_BYTES 2048
#define SCALE_SHIFT 14      /* d = 2^(e - 14): a largest magnitude below 2^(e + 1) quantizes below 2^15 */
#define MIN_EXPONENT (-112) /* below it 1 / d would overflow float32: such chunks keep this exponent's d */

static inline int64_t block_bytes(int64_t kp) { return kp * 16 + 64; } /* int8 k-pairs, then 16 float32 scales */

static inline float pow2f(int n) { /* 2^n, n in [-126, 127] */
    const uint32_t bits = (uint32_t)(n + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

int64_t int8_vnni_row_bytes(int64_t kp) {
    return (kp * 2 + (kp + INT8_VNNI_CHUNK - 1) / INT8_VNNI_CHUNK * 4 + 63) / 64 * 64;
}

void int8_vnni_quantize_rows(const uint16_t *a, int64_t lda, int64_t m, int64_t kp, char *q) {
    const int64_t stride = int8_vnni_row_bytes(kp);
    for (int64_t i = 0; i < m; i++) {
        const uint16_t *row = a + i * lda;
        int16_t *values = (int16_t *)(q + i * stride);
        float *scales = (float *)(values + kp);
        for (int64_t c0 = 0; c0 < kp; c0 += INT8_VNNI_CHUNK) {
            const int64_t c1 = c0 + INT8_VNNI_CHUNK < kp ? c0 + INT8_VNNI_CHUNK : kp;
            __m512i largest = _mm512_setzero_si512(); /* magnitudes' bits: ordered as the floats are */
            for (int64_t c = c0; c < c1; c += 16) {
                const __m512i bits = _mm512_castps_si512(widen_bf16x16(row + c));
                largest = _mm512_max_epu32(largest, _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)));
            }
            const uint32_t top = (uint32_t)_mm512_reduce_max_epu32(largest);
            int exponent = (int)(top >> 23) - 127;
            if (exponent < MIN_EXPONENT) exponent = MIN_EXPONENT;
            const float d = top ? pow2f(exponent - SCALE_SHIFT) : 0.0f;
            const __m512 inverse = _mm512_set1_ps(top ? pow2f(SCALE_SHIFT - exponent) : 0.0f);
            for (int64_t c = c0; c < c1; c += 16) {
                /* x / d is exact (a power of two); the conversion rounds to nearest even */
                const __m512 scaled = _mm512_mul_ps(widen_bf16x16(row + c), inverse);
                _mm256_storeu_si256((__m256i *)(values + c), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(scaled)));
            }
            scales[c0 / INT8_VNNI_CHUNK] = d;
        }
    }
}

/* c rows [0, rows) x `blocks` 16-column blocks from the quantized rows q (row stride int8_vnni_row_bytes(kp)).
 * rows and blocks are constants at each call site, so the int32 sums stay in registers. cols: valid columns of the
 * last block (1..16). */
static inline __attribute__((always_inline)) void block_rows(const char *q, int64_t kp, const char *b, float *c,
                                                             int64_t ldc, const int rows, const int blocks, int cols) {
    const int64_t stride = block_bytes(kp), q_stride = int8_vnni_row_bytes(kp);
    const __mmask16 last = tail_mask(cols);
    for (int64_t c0 = 0; c0 < kp; c0 += INT8_VNNI_CHUNK) {
        const int64_t c1 = c0 + INT8_VNNI_CHUNK < kp ? c0 + INT8_VNNI_CHUNK : kp;
        __m512i sums[TILE_ROWS][TILE_BLOCKS];
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < blocks; j++) sums[i][j] = _mm512_setzero_si512();
        /* two k-pair rows (one 64-byte line of each stream) a turn: a loop whose turns alternate between
         * prefetching and not is one the compiler keeps the sums in memory for */
        for (int64_t r = c0 / 2; r < c1 / 2; r += 2) {
            if (rows > 2)
                for (int j = 0; j < blocks; j++) _mm_prefetch(b + j * stride + r * 32 + PREFETCH_BYTES, _MM_HINT_T0);
            for (int64_t half = r; half < r + 2; half++) {
                __m512i w[TILE_BLOCKS];
                for (int j = 0; j < blocks; j++)
                    w[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + j * stride + half * 32)));
                for (int i = 0; i < rows; i++) {
                    const __m512i x = _mm512_set1_epi32(((const int32_t *)(q + i * q_stride))[half]);
                    for (int j = 0; j < blocks; j++) sums[i][j] = _mm512_dpwssd_epi32(sums[i][j], x, w[j]);
                }
            }
        }
        /* the float32 sums live in c between chunks: beside 24 integer sums they would not fit the 32 registers,
         * and spilled by the compiler they cost the loop above more than these loads and stores cost here */
        for (int i = 0; i < rows; i++) {
            const __m512 d = _mm512_set1_ps(((const float *)(q + i * q_stride + kp * 2))[c0 / INT8_VNNI_CHUNK]);
            for (int j = 0; j < blocks; j++) {
                float *out = c + i * ldc + j * 16;
                const __mmask16 mask = j == blocks - 1 ? last : (__mmask16)0xFFFF;
                const __m512 sum = c0 ? _mm512_maskz_loadu_ps(mask, out) : _mm512_setzero_ps();
                _mm512_mask_storeu_ps(out, mask, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i][j]), d, sum));
            }
        }
    }
    for (int j = 0; j < blocks; j++) {
        const __m512 scale = _mm512_loadu_ps((const float *)(b + j * stride + kp * 16));
        const __mmask16 mask = j == blocks - 1 ? last : (__mmask16)0xFFFF;
        for (int i = 0; i < rows; i++) {
            float *out = c + i * ldc + j * 16;
            _mm512_mask_storeu_ps(out, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, out), scale));
        }
    }
}

/* rows [r0, r0 + R) x B blocks of the strip at b (TILES_6X4) */
#define TILE_CASE(R, B) block_rows(q + r0 * q_stride, kp, b, c + r0 * ldc + nb * 16 - n0, ldc, R, B, cols)

#define STREAM_ROWS 2
#define STREAM_CHAINS 4 /* integer sums per row: consecutive k-pair rows go to each in turn */

/* c rows [0, rows) x one 16-column block (its first `cols` stored) from the quantized rows q, the block at b read
 * front to back as one stream: a few rows are bound by reading the weights, and one sequential stream reads
 * faster than four 32 KB apart. The same integer sums per chunk as block_rows, so the same bits. */
static inline __attribute__((always_inline)) void stream_block(const char *q, int64_t kp, const char *b, float *c,
                                                               int64_t ldc, const int rows, int cols) {
    const int64_t q_stride = int8_vnni_row_bytes(kp);
    __m512 acc[STREAM_ROWS];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < kp; c0 += INT8_VNNI_CHUNK) {
        const int64_t c1 = c0 + INT8_VNNI_CHUNK < kp ? c0 + INT8_VNNI_CHUNK : kp;
        __m512i sums[STREAM_ROWS][STREAM_CHAINS];
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < STREAM_CHAINS; j++) sums[i][j] = _mm512_setzero_si512();
        for (int64_t r = c0 / 2; r < c1 / 2; r += STREAM_CHAINS) { /* a chunk's k-pair rows: a multiple of 16 */
            const char *at = b + r * 32;
            _mm_prefetch(at + PREFETCH_BYTES, _MM_HINT_T0);
            _mm_prefetch(at + 64 + PREFETCH_BYTES, _MM_HINT_T0);
            for (int j = 0; j < STREAM_CHAINS; j++) {
                const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(at + j * 32)));
                for (int i = 0; i < rows; i++) {
                    const __m512i x = _mm512_set1_epi32(((const int32_t *)(q + i * q_stride))[r + j]);
                    sums[i][j] = _mm512_dpwssd_epi32(sums[i][j], x, w);
                }
            }
        }
        for (int i = 0; i < rows; i++) {
            __m512i sum = sums[i][0];
            for (int j = 1; j < STREAM_CHAINS; j++) sum = _mm512_add_epi32(sum, sums[i][j]);
            const __m512 d = _mm512_set1_ps(((const float *)(q + i * q_stride + kp * 2))[c0 / INT8_VNNI_CHUNK]);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), d, acc[i]);
        }
    }
    const __m512 scale = _mm512_loadu_ps((const float *)(b + kp * 16));
    for (int i = 0; i < rows; i++) _mm512_mask_storeu_ps(c + i * ldc, tail_mask(cols), _mm512_mul_ps(acc[i], scale));
}

void int8_vnni_gemm_quantized(const char *q, int64_t kp, const int8_t *b_packed, float *c, int64_t ldc, int64_t m,
                              int64_t n0, int64_t n1) {
    const int64_t q_stride = int8_vnni_row_bytes(kp);
    if (m > STREAM_ROWS) {
        TILES_6X4(m, n0, n1, b_packed, block_bytes(kp), TILE_CASE)
        return;
    }
    for (int64_t nb = n0 / 16; nb * 16 < n1; nb++) {
        const char *b = (const char *)b_packed + nb * block_bytes(kp);
        float *out = c + nb * 16 - n0;
        const int cols = n1 - nb * 16 < 16 ? (int)(n1 - nb * 16) : 16;
        switch (m) {
            case 1: stream_block(q, kp, b, out, ldc, 1, cols); break;
            case 2: stream_block(q, kp, b, out, ldc, 2, cols); break;
            default: break; /* m = 0 */
        }
    }
}

int int8_vnni_gemm(const uint16_t *a, int64_t lda, const int8_t *b_packed, int64_t kp, float *c, int64_t ldc,
                   int64_t m, int64_t n0, int64_t n1) {
    static __thread char *records; /* per thread, grown, never shrunk: a decode step's rows are a few KB */
    static __thread int64_t capacity;
    const int64_t bytes = m * int8_vnni_row_bytes(kp);
    if (capacity < bytes) {
        free(records);
        records = aligned_alloc(64, (size_t)bytes);
        capacity = records ? bytes : 0;
        if (!records) return 1;
    }
    int8_vnni_quantize_rows(a, lda, m, kp, records);
    int8_vnni_gemm_quantized(records, kp, b_packed, c, ldc, m, n0, n1);
    return 0;
}
