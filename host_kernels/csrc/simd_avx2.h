/* AVX2 helpers shared by the AVX2 kernels (include only from files compiled for avx2,fma). */
#ifndef MOE_SIMD_AVX2_H
#define MOE_SIMD_AVX2_H
#include <immintrin.h>
#include <stdint.h>

/* the lanes [0, count) of 8 (count >= 8: all), as a maskload/maskstore mask */
static inline __m256i lanes8(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(count > 8 ? 8 : (int)count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* stores the first `count` floats of v (all 8 when count >= 8; none when count <= 0) */
static inline void store8(float *dst, __m256 v, int64_t count) {
    if (count >= 8)
        _mm256_storeu_ps(dst, v);
    else if (count > 0)
        _mm256_maskstore_ps(dst, lanes8(count), v);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static inline int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* 8 bfloat16 (uint16) widened to float32: the bits moved up 16 */
static inline __m256 widen_bf16x8(const uint16_t *src) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16));
}

/* Stores the first `count` of 8 floats as float32, or as bfloat16 rounded to nearest even when `bf16` */
static inline void store8_as(void *dst, int64_t j, __m256 v, int64_t count, int bf16) {
    if (!bf16) {
        store8((float *)dst + j, v, count);
        return;
    }
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    /* 8 x 32-bit (each < 65536) -> 8 x 16-bit: packus of the two halves keeps the order */
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
    uint16_t *out = (uint16_t *)dst + j;
    if (count >= 8) {
        _mm_storeu_si128((__m128i *)out, packed);
        return;
    }
    uint16_t lanes[8];
    _mm_storeu_si128((__m128i *)lanes, packed);
    for (int64_t i = 0; i < count; i++) out[i] = lanes[i];
}

/* The tiling the AVX2 GEMMs share over C's columns [n0, n1) (16-column blocks from n0 / 16, n0 a multiple of 16)
 * and m rows: a decode step's one row x two blocks side by side (two weight streams), else two rows x one block.
 * For each tile, CASE(R, B) computes rows [r0, r0 + R) x blocks [nb, nb + B), with `b` the packed weights of block
 * nb (block_stride bytes apart) and `cols` the valid columns of the tile's last block. */
#define AVX2_TILES(m, n0, n1, b_packed, block_stride, CASE)                                          \
    do {                                                                                            \
        int blocks;                                                                                 \
        for (int64_t nb = (n0) / 16; nb * 16 < (n1); nb += blocks) {                                \
            const int64_t width = (n1) - nb * 16; /* columns left from this block on */             \
            blocks = (m) == 1 && width > 16 ? 2 : 1;                                                \
            const int cols = (int)(width - (blocks - 1) * 16 < 16 ? width - (blocks - 1) * 16 : 16); \
            const char *b = (const char *)(b_packed) + nb * (block_stride);                         \
            for (int64_t r0 = 0; r0 < (m); r0 += 2) {                                               \
                if (blocks == 2) CASE(1, 2);                                                        \
                else if ((m) - r0 == 1) CASE(1, 1);                                                 \
                else CASE(2, 1);                                                                    \
            }                                                                                       \
        }                                                                                           \
    } while (0)

#endif
