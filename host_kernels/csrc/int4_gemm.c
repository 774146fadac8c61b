/* GEMMs over int4 weights on AVX512-VNNI (VPDPBUSD: 64 products of unsigned x signed bytes per instruction), for
 * the fused expert forward (moe_forward.c), XLA's dense handler (host_kernels/csrc/xla_dense.c) and
 * host_kernels/int4_gemm.py. Only this file is compiled for avx512vnni; its callers check the CPU first.
 *
 * Weights: int4 in groups of `group` k-rows (32, 64 or 128) with a float16 scale per group and column, llama.cpp's
 * Q4_0 rule (stored as q + 8 in [0, 15]; the value is (stored - 8) * d). Per 16-column block, per group: the
 * group's k-quads two at a time in 64-byte rows (byte 4c + i holds column c's k-row 8r + i in its low nibble and
 * 8r + 4 + i in its high one: two VPDPBUSD operands after an and, a shift and an and), then its 16 scales (32
 * bytes). The last group may be shorter (kp, a multiple of 32, need not be one of `group`).
 *
 * Activations: bfloat16 rows quantized to int8 per 32 values, as llama.cpp quantizes them for its Q4_0 products
 * (Q8_0): d_a = max |a| / 127, q_a = round(a / d_a). `int4_quantize_rows` writes a row's record: kp int8 values,
 * then per 32-value chunk its d_a (float32), then -8 * sum(q_a) (int32, the offset of the stored nibbles, folded
 * into the integer sums' start). A chunk's integer dot product is exact; it is scaled by d_a * d_w in float32.
 *
 * Register blocking: 1-2 rows x 1 column block (decode: one weight stream through the blocks, which lie end to
 * end) or up to 4 rows x 2 blocks; larger m goes over the same strip again (from cache) for each 4 rows.
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int4_gemm.h"
#include "simd.h"

#define CHUNK 32           /* activations' quantization block, in k */
#define SCALE_BYTES 32     /* 16 float16 scales per group and block */
#define PREFETCH_BYTES 2048 /* ahead of the row loaded, per stream (512 left one core short of DRAM's rate) */

static inline int64_t block_bytes(int64_t kp, int64_t group) {
    return kp * 8 + (kp + group - 1) / group * SCALE_BYTES;
}

void int4_quantize_rows(const uint16_t *a, int64_t lda, int64_t m, int64_t c0, int64_t c1, char *q, int64_t kp) {
    const int64_t stride = int4_row_bytes(kp);
    for (int64_t i = 0; i < m; i++) {
        const uint16_t *row = a + i * lda;
        int8_t *values = (int8_t *)(q + i * stride);
        float *scales = (float *)(q + i * stride + kp);
        int32_t *offsets = (int32_t *)(scales + kp / CHUNK);
        for (int64_t c = c0; c < c1; c += CHUNK) {
            __m512 x[2];
            for (int h = 0; h < 2; h++) x[h] = widen_bf16x16(row + c + 16 * h);
            const float absmax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x[0]), _mm512_abs_ps(x[1])));
            const float d = absmax / 127.0f, inverse = d > 0 ? 1.0f / d : 0.0f;
            __m512i sum = _mm512_setzero_si512();
            for (int h = 0; h < 2; h++) {
                const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(x[h], _mm512_set1_ps(inverse))); /* to nearest */
                _mm_storeu_si128((__m128i *)(values + c + 16 * h), _mm512_cvtsepi32_epi8(v));
                sum = _mm512_add_epi32(sum, v);
            }
            scales[c / CHUNK] = d;
            offsets[c / CHUNK] = -8 * _mm512_reduce_add_epi32(sum);
        }
    }
}

/* MXFP4 (`mxfp4` below): the same layout with group 32, each nibble an e2m1 code and each group's scales 16 e8m0
 * bytes (then 16 unused). A code becomes its value doubled plus 12 by one byte shuffle (unsigned, in [0, 24], as
 * VPDPBUSD wants; the record's offset -8 * sum(q_a) becomes -12 * sum(q_a)), and an e8m0 byte e the float
 * 2^(e - 128), half the power of two to undo the doubling (ggml's ggml_e8m0_to_fp32_half). */
static inline __m512 e8m0_half16(const char *scales) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)scales));
    const __mmask16 tiny = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    return _mm512_castsi512_ps(_mm512_mask_sllv_epi32(normal, tiny, _mm512_set1_epi32(0x00200000), e));
}

/* c rows [0, rows) x `blocks` blocks of 16 columns, from quantized rows q (row stride int4_row_bytes(kp)) and
 * the weight blocks at b (int4, or MXFP4 when `mxfp4`). rows, blocks and mxfp4 are constants at each call site, so
 * the sums stay in registers. */
static inline __attribute__((always_inline)) void block_rows(const char *q, int64_t kp, const char *b, int64_t group,
                                                             float *c, int64_t ldc, const int rows, const int blocks,
                                                             int cols, const int mxfp4) {
    enum { MAX_ROWS = 4, MAX_BLOCKS = 4 };
    const int64_t stride = block_bytes(kp, group), q_stride = int4_row_bytes(kp);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i e2m1 = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    __m512 acc[MAX_ROWS][MAX_BLOCKS];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < blocks; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < kp; g0 += group) {
        const int64_t g1 = g0 + group < kp ? g0 + group : kp;
        const char *gb = b + g0 / group * (group * 8 + SCALE_BYTES); /* this group in block 0 */
        __m512 weight_scale[MAX_BLOCKS];
        for (int j = 0; j < blocks; j++) {
            const char *scales = gb + j * stride + (g1 - g0) * 8;
            weight_scale[j] = mxfp4 ? e8m0_half16(scales) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
        }
        for (int64_t c0 = g0; c0 < g1; c0 += CHUNK) {
            /* two sums per output vector (low and high nibbles' quads): twice the independent chains */
            __m512i sums[MAX_ROWS][MAX_BLOCKS], sums_hi[MAX_ROWS][MAX_BLOCKS];
            for (int i = 0; i < rows; i++) {
                const int32_t *offsets = (const int32_t *)(q + i * q_stride + kp + kp / CHUNK * 4);
                const int32_t offset = mxfp4 ? offsets[c0 / CHUNK] / 2 * 3 : offsets[c0 / CHUNK];
                for (int j = 0; j < blocks; j++)
                    sums[i][j] = _mm512_set1_epi32(offset), sums_hi[i][j] = _mm512_setzero_si512();
            }
            for (int64_t r = 0; r < CHUNK / 8; r++) { /* 8 k-rows per 64-byte row: two quads */
                __m512i lo[MAX_BLOCKS], hi[MAX_BLOCKS];
                for (int j = 0; j < blocks; j++) {
                    const char *row = gb + j * stride + (c0 - g0) * 8 + r * 64;
                    _mm_prefetch(row + PREFETCH_BYTES, _MM_HINT_T0);
                    const __m512i v = _mm512_loadu_si512((const void *)row);
                    lo[j] = _mm512_and_si512(v, low4), hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                    if (mxfp4) lo[j] = _mm512_shuffle_epi8(e2m1, lo[j]), hi[j] = _mm512_shuffle_epi8(e2m1, hi[j]);
                }
                for (int i = 0; i < rows; i++) {
                    const int32_t *quads = (const int32_t *)(q + i * q_stride + c0 + r * 8);
                    const __m512i x0 = _mm512_set1_epi32(quads[0]), x1 = _mm512_set1_epi32(quads[1]);
                    for (int j = 0; j < blocks; j++) {
                        sums[i][j] = _mm512_dpbusd_epi32(sums[i][j], lo[j], x0);
                        sums_hi[i][j] = _mm512_dpbusd_epi32(sums_hi[i][j], hi[j], x1);
                    }
                }
            }
            for (int i = 0; i < rows; i++) {
                const __m512 row_scale = _mm512_set1_ps(((const float *)(q + i * q_stride + kp))[c0 / CHUNK]);
                for (int j = 0; j < blocks; j++)
                    acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(sums[i][j], sums_hi[i][j])),
                                                _mm512_mul_ps(weight_scale[j], row_scale), acc[i][j]);
            }
        }
    }
    const __mmask16 last = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < blocks; j++)
            _mm512_mask_storeu_ps(c + i * ldc + j * 16, j == blocks - 1 ? last : (__mmask16)0xFFFF, acc[i][j]);
}

/* rows [r0, r0 + rows) x `blocks` blocks: R and B constants, R x B <= 8 (16 accumulators) */
#define BLOCK_CASE(R, B) \
    block_rows(q + r0 * q_stride, kp, b, group, c + r0 * ldc + nb * 16 - n0, ldc, R, B, cols, mxfp4)

static inline __attribute__((always_inline)) void quantized_gemm(const char *q, int64_t kp, const uint8_t *b_packed,
                                                                 int64_t group, float *c, int64_t ldc, int64_t m,
                                                                 int64_t n0, int64_t n1, const int mxfp4) {
    const int64_t stride = block_bytes(kp, group), q_stride = int4_row_bytes(kp);
    /* decode (1-2 rows): one block after another, a single prefetched stream: four blocks side by side (four
     * streams) read a real model's decode weights slower end to end, and without the prefetch it is slower
     * still */
    const int wide = m <= 2;
    const int64_t step = wide ? 1 : 2, row_step = wide ? 2 : 4; /* else up to 4 rows x 2 blocks */
    for (int64_t nb = n0 / 16; nb * 16 < n1; nb += step) {
        const int64_t width = n1 - nb * 16; /* columns left from this block on */
        const int blocks = width >= step * 16 ? (int)step : (int)((width + 15) / 16);
        const int cols = (int)(width - (blocks - 1) * 16 < 16 ? width - (blocks - 1) * 16 : 16);
        const char *b = (const char *)b_packed + nb * stride;
        for (int64_t r0 = 0; r0 < m; r0 += row_step) {
            const int rows = m - r0 < row_step ? (int)(m - r0) : (int)row_step;
            if (wide) {
                if (rows == 1) BLOCK_CASE(1, 1);
                else BLOCK_CASE(2, 1);
            } else if (blocks == 1) {
                switch (rows) {
                    case 1: BLOCK_CASE(1, 1); break;
                    case 2: BLOCK_CASE(2, 1); break;
                    case 3: BLOCK_CASE(3, 1); break;
                    default: BLOCK_CASE(4, 1); break;
                }
            } else {
                switch (rows) {
                    case 1: BLOCK_CASE(1, 2); break;
                    case 2: BLOCK_CASE(2, 2); break;
                    case 3: BLOCK_CASE(3, 2); break;
                    default: BLOCK_CASE(4, 2); break;
                }
            }
        }
    }
}

void int4_gemm_quantized(const char *q, int64_t kp, const uint8_t *b_packed, int64_t group, float *c, int64_t ldc,
                         int64_t m, int64_t n0, int64_t n1) {
    quantized_gemm(q, kp, b_packed, group, c, ldc, m, n0, n1, 0);
}

void mxfp4_gemm_quantized(const char *q, int64_t kp, const uint8_t *b_packed, float *c, int64_t ldc, int64_t m,
                          int64_t n0, int64_t n1) {
    quantized_gemm(q, kp, b_packed, 32, c, ldc, m, n0, n1, 1);
}

/* the rows quantized first (int4's records, for both formats), then the product; non-zero where memory runs out */
static int from_rows(const uint16_t *a, int64_t lda, const uint8_t *b_packed, int64_t kp, float *c, int64_t ldc,
                     int64_t m, int64_t n0, int64_t n1, int64_t group, int mxfp4) {
    char *q = malloc((size_t)(m * int4_row_bytes(kp)));
    if (!q) return 1;
    int4_quantize_rows(a, lda, m, 0, kp, q, kp);
    quantized_gemm(q, kp, b_packed, group, c, ldc, m, n0, n1, mxfp4);
    free(q);
    return 0;
}

int int4_gemm(const uint16_t *a, int64_t lda, const uint8_t *b_packed, int64_t kp, float *c, int64_t ldc,
              int64_t m, int64_t n0, int64_t n1, int64_t group) {
    return from_rows(a, lda, b_packed, kp, c, ldc, m, n0, n1, group, 0);
}

int mxfp4_gemm(const uint16_t *a, int64_t lda, const uint8_t *b_packed, int64_t kp, float *c, int64_t ldc,
               int64_t m, int64_t n0, int64_t n1) {
    return from_rows(a, lda, b_packed, kp, c, ldc, m, n0, n1, 32, 1);
}

/* 16 float32 rounded to bfloat16: 8 pairs of 32 bits */
static inline __m256i bf16_row(const float *row) { return _mm512_cvtepi32_epi16(bf16_bits(_mm512_loadu_ps(row))); }

/* One 16-column block nb of a float32 weight W [k, n] (rows [0, k) at `block`, row stride 16) into the tile layout
 * (host_kernels/amx.py: [column blocks][32-row tiles][16 pairs][16 columns][2]) of W, or of W^T [n, k]. */
static void block_tiles(const float *block, int64_t k, int64_t n, int64_t nb, int transposed, uint16_t *dst) {
    if (!transposed) { /* a k-pair row: the two rows' 16 columns interleaved */
        const int64_t tiles = (k + 31) / 32;
        for (int64_t r = 0; r < k; r += 2) {
            const __m512i even = bf16_bits(_mm512_loadu_ps(block + r * 16));
            const __m512i odd = r + 1 < k ? bf16_bits(_mm512_loadu_ps(block + (r + 1) * 16)) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + (nb * tiles + r / 32) * 512 + (r % 32) / 2 * 32,
                                _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
        }
        return;
    }
    /* W^T's rows 16 nb .. 16 nb + 15 are this block's columns: in one 32-row tile (nb / 2), its pair rows from
     * 8 (nb & 1) on; each pair row holds, for 16 of W's rows, one pair of this block's columns: the transpose of
     * 16 rows x 8 pairs, done as two 8 x 8 transposes side by side (rows jj and jj + 8 share a register) */
    const int64_t tiles = (n + 31) / 32;
    const __m512i low_lanes = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i high_lanes = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int64_t j0 = 0; j0 < k; j0 += 16) {
        __m512i a[8], t[8], u[8];
        for (int i = 0; i < 8; i++) { /* W's rows past k: W^T's padding columns, zeros */
            const int64_t lo = j0 + i, hi = j0 + i + 8;
            const __m256i rl = lo < k ? bf16_row(block + lo * 16) : _mm256_setzero_si256();
            const __m256i rh = hi < k ? bf16_row(block + hi * 16) : _mm256_setzero_si256();
            a[i] = _mm512_inserti64x4(_mm512_castsi256_si512(rl), rh, 1);
        }
        for (int i = 0; i < 8; i += 2)
            t[i] = _mm512_unpacklo_epi32(a[i], a[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(a[i], a[i + 1]);
        for (int i = 0; i < 8; i += 4) {
            u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
            u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
        }
        uint16_t *tile = dst + ((j0 / 16) * tiles + nb / 2) * 512 + 8 * (nb & 1) * 32;
        for (int p = 0; p < 4; p++) {
            _mm512_storeu_si512(tile + p * 32, _mm512_permutex2var_epi64(u[p], low_lanes, u[p + 4]));
            _mm512_storeu_si512(tile + (p + 4) * 32, _mm512_permutex2var_epi64(u[p], high_lanes, u[p + 4]));
        }
    }
}

/* int4_unpack's weights of W [k, n] rounded to bfloat16 in the tile layout of W, or of W^T where `transposed`: each
 * block dequantized into `scratch` (16 kp float32, the caller's: it stays in cache) and packed from there. dst is
 * zeroed first where the layout has padding. */
void int4_unpack_bf16_tiles(const uint8_t *b_packed, int64_t kp, int64_t group, int64_t blocks, int64_t k, int64_t n,
                            int transposed, uint16_t *dst, float *scratch) {
    const int64_t rows = transposed ? n : k, cols = transposed ? k : n;
    if (rows % 32 || cols % 16) memset(dst, 0, (size_t)((cols + 15) / 16 * ((rows + 31) / 32) * 512 * 2));
    for (int64_t nb = 0; nb < blocks && nb * 16 < n; nb++) {
        int4_unpack(b_packed + nb * block_bytes(kp, group), kp, group, 1, k, scratch, 16);
        block_tiles(scratch, k, n, nb, transposed, dst);
    }
}

void int4_unpack(const uint8_t *b_packed, int64_t kp, int64_t group, int64_t blocks, int64_t k, float *out,
                 int64_t ldo) {
    const int64_t stride = block_bytes(kp, group);
    const __m512i low4 = _mm512_set1_epi32(0x0F);
    const __m512 eight = _mm512_set1_ps(8.0f);
    for (int64_t nb = 0; nb < blocks; nb++) {
        const char *block = (const char *)b_packed + nb * stride;
        for (int64_t g0 = 0; g0 < k; g0 += group) {
            const int64_t g1 = g0 + group < kp ? g0 + group : kp;
            const char *gb = block + g0 / group * (group * 8 + SCALE_BYTES);
            const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gb + (g1 - g0) * 8)));
            for (int64_t r = g0; r < g1 && r < k; r += 8) {
                /* lane c: column c's 4 bytes, k-rows r..r+3 in the low nibbles, r+4..r+7 in the high ones */
                const __m512i v = _mm512_loadu_si512((const void *)(gb + (r - g0) * 8));
                for (int i = 0; i < 8 && r + i < k; i++) {
                    const __m512i q = _mm512_and_si512(_mm512_srli_epi32(v, 8 * (i & 3) + 4 * (i >> 2)), low4);
                    const __m512 w = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(q), eight), scale);
                    _mm512_storeu_ps(out + (r + i) * ldo + nb * 16, w);
                }
            }
        }
    }
}
