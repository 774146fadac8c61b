/* AVX-512 helpers shared by the native kernels (include only from files compiled for avx512f/bw/vl). */
#ifndef MOE_SIMD_H
#define MOE_SIMD_H
#include <immintrin.h>
#include <stdint.h>

/* Each lane's float32 rounded to bfloat16 (to nearest even, as every kernel rounds), in its low 16 bits */
static inline __m512i bf16_bits(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
}

/* Stores 16 floats (masked) as float32, or as bfloat16 rounded to nearest even when `bf16` (inputs for the AMX
 * GEMM that reads them next: half the bytes written, and no separate conversion pass). */
static inline void store16(void *dst, int64_t j, __mmask16 k, __m512 v, int bf16) {
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)dst + j, k, v);
        return;
    }
    _mm256_mask_storeu_epi16((uint16_t *)dst + j, k, _mm512_cvtepi32_epi16(bf16_bits(v)));
}

/* 16 bfloat16 (uint16) widened to float32: the bits moved up 16 (simd_avx2.h's widen_bf16x8, twice as wide) */
static inline __m512 widen_bf16x16(const uint16_t *src) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
}

static inline __mmask16 tail_mask(int64_t remaining) {
    return remaining >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << remaining) - 1);
}

/* The register tiling of bf16_gemm.c and int8_vnni_gemm.c: columns [n0, n1) of C in strips of 4 16-column blocks
 * (b: the strip's first block; blocks are block_stride bytes apart), rows in groups of 6. CASE(R, B) computes rows
 * [r0, r0 + R) x B blocks of the strip at block nb (R, B constants: the accumulators stay in registers), the last
 * block's first `cols` columns stored. */
#define TILE_ROWS 6   /* the most rows, and column blocks, one CASE computes: accumulator arrays size by these */
#define TILE_BLOCKS 4
#define TILE_ROWS_6(B, CASE)      \
    switch (rows) {               \
        case 1: CASE(1, B); break; \
        case 2: CASE(2, B); break; \
        case 3: CASE(3, B); break; \
        case 4: CASE(4, B); break; \
        case 5: CASE(5, B); break; \
        default: CASE(TILE_ROWS, B); break; \
    }
#define TILES_6X4(m, n0, n1, b_packed, block_stride, CASE)                                           \
    for (int64_t nb = (n0) / 16; nb * 16 < (n1); nb += TILE_BLOCKS) {                               \
        const int64_t width = (n1) - nb * 16; /* columns left from this block on */                 \
        const int blocks = width >= TILE_BLOCKS * 16 ? TILE_BLOCKS : (int)((width + 15) / 16);      \
        const int cols = (int)(width - (blocks - 1) * 16 < 16 ? width - (blocks - 1) * 16 : 16);     \
        const char *b = (const char *)(b_packed) + nb * (block_stride);                             \
        for (int64_t r0 = 0; r0 < (m); r0 += TILE_ROWS) {                                           \
            const int rows = (m) - r0 < TILE_ROWS ? (int)((m) - r0) : TILE_ROWS;                    \
            switch (blocks) {                                                                       \
                case 1: TILE_ROWS_6(1, CASE) break;                                                 \
                case 2: TILE_ROWS_6(2, CASE) break;                                                 \
                case 3: TILE_ROWS_6(3, CASE) break;                                                 \
                default: TILE_ROWS_6(TILE_BLOCKS, CASE) break;                                      \
            }                                                                                       \
        }                                                                                           \
    }

#endif
