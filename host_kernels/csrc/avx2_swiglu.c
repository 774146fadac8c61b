/* swiglu.c's SwiGLU passes on AVX2 + FMA (8 columns per step), for CPUs without AVX-512: the same exp
 * polynomial, with 2^n built from its exponent bits where AVX-512 has scalef (equal wherever 2^n is a normal
 * float: x is clamped to [-87, 88] first). Only this file is compiled for avx2; its callers check the CPU first.
 */
#pragma GCC target("avx2,fma")
#include <immintrin.h>
#include <stdint.h>

#include "avx2_kernels.h"
#include "simd_avx2.h"

static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static inline __m256 sigmoid8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

/* the first `count` floats at p (8 when count >= 8), zeros after */
static inline __m256 load8(const float *p, int64_t count) {
    return count >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes8(count));
}

void swiglu_forward_avx2(const float *hg, int64_t ld_g, const float *hu, int64_t ld_u, void *act, int64_t ld_a,
                         int bf16, int64_t m, int64_t n) {
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t i = 0; i < m; i++) {
        const float *g = hg + i * ld_g, *u = hu + i * ld_u;
        char *a = (char *)act + i * ld_a * size;
        for (int64_t j = 0; j < n; j += 8) {
            const __m256 gv = load8(g + j, n - j), uv = load8(u + j, n - j);
            store8_as(a, j, _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid8(gv)), uv), n - j, bf16);
        }
    }
}

void swiglu_backward_avx2(const float *hg, int64_t ld_g, const float *hu, int64_t ld_u, const float *grad,
                          int64_t ld_grad, const float *weight, void *dh_gate, void *dh_up, int64_t ld_dh, int bf16,
                          float *dw, int64_t ld_dw, float *act, int64_t ld_a, int64_t m, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t i = 0; i < m; i++) {
        const float *g = hg + i * ld_g, *u = hu + i * ld_u, *d = grad + i * ld_grad;
        char *dg = (char *)dh_gate + i * ld_dh * size, *du = (char *)dh_up + i * ld_dh * size;
        float *a = act ? act + i * ld_a : 0;
        const __m256 w = _mm256_set1_ps(weight[i]);
        __m256 dot = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j += 8) {
            const int64_t count = n - j;
            const __m256 gv = load8(g + j, count), uv = load8(u + j, count), dv = load8(d + j, count);
            const __m256 s = sigmoid8(gv);
            const __m256 silu = _mm256_mul_ps(gv, s);
            const __m256 av = _mm256_mul_ps(silu, uv);
            dot = _mm256_fmadd_ps(dv, av, dot);
            if (a) store8(a + j, av, count);
            const __m256 dwv = _mm256_mul_ps(dv, w);
            const __m256 dsilu = _mm256_mul_ps(s, _mm256_fmadd_ps(gv, _mm256_sub_ps(one, s), one));
            store8_as(dg, j, _mm256_mul_ps(_mm256_mul_ps(dwv, uv), dsilu), count, bf16);
            store8_as(du, j, _mm256_mul_ps(dwv, silu), count, bf16);
        }
        dw[i * ld_dw] = hsum8(dot);
    }
}

/* swiglu.c's clamped SwiGLU passes (GPT-OSS), 8 columns per step */
void clamped_swiglu_forward_avx2(const float *hg, int64_t ld_g, const float *hu, int64_t ld_u, void *act,
                                 int64_t ld_a, int bf16, int64_t m, int64_t n, float alpha, float limit) {
    const int64_t size = bf16 ? 2 : 4;
    const __m256 one = _mm256_set1_ps(1.0f), a = _mm256_set1_ps(alpha), hi = _mm256_set1_ps(limit);
    const __m256 lo = _mm256_set1_ps(-limit);
    for (int64_t i = 0; i < m; i++) {
        const float *g = hg + i * ld_g, *u = hu + i * ld_u;
        char *out = (char *)act + i * ld_a * size;
        for (int64_t j = 0; j < n; j += 8) {
            const __m256 gv = _mm256_min_ps(load8(g + j, n - j), hi);
            const __m256 uv = _mm256_min_ps(_mm256_max_ps(load8(u + j, n - j), lo), hi);
            const __m256 glu = _mm256_mul_ps(gv, sigmoid8(_mm256_mul_ps(gv, a)));
            store8_as(out, j, _mm256_mul_ps(_mm256_add_ps(uv, one), glu), n - j, bf16);
        }
    }
}

void clamped_swiglu_backward_avx2(const float *hg, int64_t ld_g, const float *hu, int64_t ld_u, const float *grad,
                                  int64_t ld_grad, const float *weight, void *dh_gate, void *dh_up, int64_t ld_dh,
                                  int bf16, float *dw, int64_t ld_dw, float *act, int64_t ld_a, int64_t m, int64_t n,
                                  float alpha, float limit) {
    const __m256 one = _mm256_set1_ps(1.0f), al = _mm256_set1_ps(alpha), hi = _mm256_set1_ps(limit);
    const __m256 lo = _mm256_set1_ps(-limit), zero = _mm256_setzero_ps();
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t i = 0; i < m; i++) {
        const float *g = hg + i * ld_g, *u = hu + i * ld_u, *d = grad + i * ld_grad;
        char *dg = (char *)dh_gate + i * ld_dh * size, *du = (char *)dh_up + i * ld_dh * size;
        float *a = act ? act + i * ld_a : 0;
        const __m256 w = _mm256_set1_ps(weight[i]);
        __m256 dot = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j += 8) {
            const int64_t count = n - j;
            const __m256 graw = load8(g + j, count), uraw = load8(u + j, count), dv = load8(d + j, count);
            const __m256 gv = _mm256_min_ps(graw, hi);
            const __m256 up1 = _mm256_add_ps(_mm256_min_ps(_mm256_max_ps(uraw, lo), hi), one);
            const __m256 s = sigmoid8(_mm256_mul_ps(gv, al));
            const __m256 glu = _mm256_mul_ps(gv, s);
            const __m256 av = _mm256_mul_ps(up1, glu);
            dot = _mm256_fmadd_ps(dv, av, dot);
            if (a) store8(a + j, av, count);
            const __m256 dwv = _mm256_mul_ps(dv, w);
            const __m256 dglu = _mm256_mul_ps(s, _mm256_fmadd_ps(_mm256_mul_ps(al, gv), _mm256_sub_ps(one, s), one));
            const __m256 gate_open = _mm256_cmp_ps(graw, hi, _CMP_LE_OQ);
            const __m256 up_open = _mm256_and_ps(_mm256_cmp_ps(uraw, hi, _CMP_LE_OQ), _mm256_cmp_ps(uraw, lo, _CMP_GE_OQ));
            store8_as(dg, j, _mm256_blendv_ps(zero, _mm256_mul_ps(_mm256_mul_ps(dwv, up1), dglu), gate_open), count, bf16);
            store8_as(du, j, _mm256_blendv_ps(zero, _mm256_mul_ps(dwv, glu), up_open), count, bf16);
        }
        dw[i * ld_dw] = hsum8(dot);
    }
}
