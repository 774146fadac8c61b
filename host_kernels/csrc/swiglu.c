/* The SwiGLU elementwise passes of the host expert engine, one pass over memory each (loaded with ctypes; see
 * host_kernels/native.py, which calls them only where the CPU has AVX-512: this file alone is compiled for it).
 * numpy needs 6-9 passes with temporaries for the same work, which on training-sized tiles took longer than the
 * GEMMs around them. Arrays are float32, row-major, with row strides ("ld"); 16 columns per step, the last
 * step masked.
 */
#pragma GCC target("avx512f,avx512bw,avx512vl")
#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

/* exp(x): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (< 2 ulp), times 2^n by
 * scalef. x is clamped to [-88, 88] first (exp there is ~0 and ~FLT_MAX): beyond, r loses all its bits. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* sigmoid(x) = 1 / (1 + exp(-x)): 0 or 1 at the extremes, never NaN for finite x */
static inline __m512 sigmoid16(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

/* act[i, j] = silu(hg[i, j]) * hu[i, j]; act is float32, or bfloat16 when `bf16` (its ld in elements) */
void swiglu_forward(const float *hg, int64_t ld_g, const float *hu, int64_t ld_u, void *act, int64_t ld_a, int bf16,
                    int64_t m, int64_t n) {
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t i = 0; i < m; i++) {
        const float *g = hg + i * ld_g, *u = hu + i * ld_u;
        char *a = (char *)act + i * ld_a * size;
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = tail_mask(n - j);
            const __m512 gv = _mm512_maskz_loadu_ps(k, g + j), uv = _mm512_maskz_loadu_ps(k, u + j);
            store16(a, j, k, _mm512_mul_ps(_mm512_mul_ps(gv, sigmoid16(gv)), uv), bf16);
        }
    }
}

/* Backward of y = w * (silu(hg) * hu) @ W2 given grad = dL/d(silu(hg) * hu) before the routing weight w:
 *   dh_gate = w grad hu silu'(hg),  dh_up = w grad silu(hg),  dw[i] = sum_j grad * silu(hg) * hu,
 * with silu'(h) = s (1 + h (1 - s)), s = sigmoid(h); and act = silu(hg) * hu when act is not NULL (for the down
 * projection's LoRA gradients). dh_gate and dh_up are float32, or bfloat16 when `bf16` (ld_dh in elements). */
void swiglu_backward(const float *hg, int64_t ld_g, const float *hu, int64_t ld_u, const float *grad, int64_t ld_grad,
                     const float *weight, void *dh_gate, void *dh_up, int64_t ld_dh, int bf16, float *dw, int64_t ld_dw,
                     float *act, int64_t ld_a, int64_t m, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t i = 0; i < m; i++) {
        const float *g = hg + i * ld_g, *u = hu + i * ld_u, *d = grad + i * ld_grad;
        char *dg = (char *)dh_gate + i * ld_dh * size, *du = (char *)dh_up + i * ld_dh * size;
        float *a = act ? act + i * ld_a : 0;
        const __m512 w = _mm512_set1_ps(weight[i]);
        __m512 dot = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = tail_mask(n - j);
            const __m512 gv = _mm512_maskz_loadu_ps(k, g + j), uv = _mm512_maskz_loadu_ps(k, u + j);
            const __m512 dv = _mm512_maskz_loadu_ps(k, d + j);
            const __m512 s = sigmoid16(gv);
            const __m512 silu = _mm512_mul_ps(gv, s);
            const __m512 av = _mm512_mul_ps(silu, uv);
            dot = _mm512_fmadd_ps(dv, av, dot);
            if (a) _mm512_mask_storeu_ps(a + j, k, av);
            const __m512 dwv = _mm512_mul_ps(dv, w);
            const __m512 dsilu = _mm512_mul_ps(s, _mm512_fmadd_ps(gv, _mm512_sub_ps(one, s), one));
            store16(dg, j, k, _mm512_mul_ps(_mm512_mul_ps(dwv, uv), dsilu), bf16);
            store16(du, j, k, _mm512_mul_ps(dwv, silu), bf16);
        }
        dw[i * ld_dw] = _mm512_reduce_add_ps(dot);
    }
}

/* GPT-OSS's clamped SwiGLU: act = (u' + 1) * g' * sigmoid(alpha g'), g' = min(hg, limit), u' = clip(hu, +-limit);
 * act as swiglu_forward's. */
void clamped_swiglu_forward(const float *hg, int64_t ld_g, const float *hu, int64_t ld_u, void *act, int64_t ld_a,
                            int bf16, int64_t m, int64_t n, float alpha, float limit) {
    const int64_t size = bf16 ? 2 : 4;
    const __m512 one = _mm512_set1_ps(1.0f), a = _mm512_set1_ps(alpha), hi = _mm512_set1_ps(limit);
    const __m512 lo = _mm512_set1_ps(-limit);
    for (int64_t i = 0; i < m; i++) {
        const float *g = hg + i * ld_g, *u = hu + i * ld_u;
        char *out = (char *)act + i * ld_a * size;
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = tail_mask(n - j);
            const __m512 gv = _mm512_min_ps(_mm512_maskz_loadu_ps(k, g + j), hi);
            const __m512 uv = _mm512_min_ps(_mm512_max_ps(_mm512_maskz_loadu_ps(k, u + j), lo), hi);
            const __m512 glu = _mm512_mul_ps(gv, sigmoid16(_mm512_mul_ps(gv, a)));
            store16(out, j, k, _mm512_mul_ps(_mm512_add_ps(uv, one), glu), bf16);
        }
    }
}

/* Backward of the clamped SwiGLU as swiglu_backward's of silu: with s = sigmoid(alpha g'),
 *   dh_gate = w grad (u' + 1) (s + alpha g' s (1 - s)) where hg <= limit (0 above: the clamp),
 *   dh_up = w grad g' s where |hu| <= limit, dw[i] = sum_j grad * act, and act when not NULL. */
void clamped_swiglu_backward(const float *hg, int64_t ld_g, const float *hu, int64_t ld_u, const float *grad,
                             int64_t ld_grad, const float *weight, void *dh_gate, void *dh_up, int64_t ld_dh,
                             int bf16, float *dw, int64_t ld_dw, float *act, int64_t ld_a, int64_t m, int64_t n,
                             float alpha, float limit) {
    const __m512 one = _mm512_set1_ps(1.0f), al = _mm512_set1_ps(alpha), hi = _mm512_set1_ps(limit);
    const __m512 lo = _mm512_set1_ps(-limit);
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t i = 0; i < m; i++) {
        const float *g = hg + i * ld_g, *u = hu + i * ld_u, *d = grad + i * ld_grad;
        char *dg = (char *)dh_gate + i * ld_dh * size, *du = (char *)dh_up + i * ld_dh * size;
        float *a = act ? act + i * ld_a : 0;
        const __m512 w = _mm512_set1_ps(weight[i]);
        __m512 dot = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = tail_mask(n - j);
            const __m512 graw = _mm512_maskz_loadu_ps(k, g + j), uraw = _mm512_maskz_loadu_ps(k, u + j);
            const __m512 dv = _mm512_maskz_loadu_ps(k, d + j);
            const __m512 gv = _mm512_min_ps(graw, hi);
            const __m512 up1 = _mm512_add_ps(_mm512_min_ps(_mm512_max_ps(uraw, lo), hi), one);
            const __m512 s = sigmoid16(_mm512_mul_ps(gv, al));
            const __m512 glu = _mm512_mul_ps(gv, s);
            const __m512 av = _mm512_mul_ps(up1, glu);
            dot = _mm512_fmadd_ps(dv, av, dot);
            if (a) _mm512_mask_storeu_ps(a + j, k, av);
            const __m512 dwv = _mm512_mul_ps(dv, w);
            const __m512 dglu = _mm512_mul_ps(s, _mm512_fmadd_ps(_mm512_mul_ps(al, gv), _mm512_sub_ps(one, s), one));
            const __mmask16 gate_open = _mm512_cmp_ps_mask(graw, hi, _CMP_LE_OQ);
            const __mmask16 up_open = _mm512_cmp_ps_mask(uraw, hi, _CMP_LE_OQ) & _mm512_cmp_ps_mask(uraw, lo, _CMP_GE_OQ);
            store16(dg, j, k, _mm512_maskz_mul_ps(gate_open, _mm512_mul_ps(dwv, up1), dglu), bf16);
            store16(du, j, k, _mm512_maskz_mul_ps(up_open, dwv, glu), bf16);
        }
        dw[i * ld_dw] = _mm512_reduce_add_ps(dot);
    }
}
