/* AVX-512 helpers shared by the native kernels (include only from files compiled for avx512f/bw/vl). */
#ifndef MOE_SIMD_H
#define MOE_SIMD_H
#include <immintrin.h>
#include <stdint.h>

/* Stores 16 floats (masked) as float32, or as bfloat16 rounded to nearest even when `bf16` (inputs for the AMX
 * GEMM that reads them next: half the bytes written, and no separate conversion pass). */
static inline void store16(void *dst, int64_t j, __mmask16 k, __m512 v, int bf16) {
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)dst + j, k, v);
        return;
    }
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    _mm256_mask_storeu_epi16((uint16_t *)dst + j, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

static inline __mmask16 tail_mask(int64_t remaining) {
    return remaining >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << remaining) - 1);
}

#endif
