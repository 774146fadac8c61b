/* XLA FFI handler "moe_jax_decode_attention": one decode step's attention on XLA:CPU, bfloat16 KV cache.
 *
 * For each row and KV head it writes the step's new key and value into the cache at the row's position (the
 * cache buffers are aliased to the results, so this is in place) and attends the group's queries to the cache
 * entries the position can see. XLA ran this as a select over the whole cache plus two batched products and a
 * softmax: ~125 us a layer on the bench model at batch 16, against ~50 us here at position 48 (the keys past the
 * position are not read at all).
 *
 * Operands: q [b, kv, g, d], k_new and v_new [b, kv, 1, d], positions [b, 1] (s32), k_cache and v_cache
 * [b, kv, s, d]; all bf16 but positions. Results: out [b, kv, g, d], k_cache, v_cache. Attribute `window` (s64):
 * a sliding window's length, 0 for none. Arithmetic as the XLA path (layers.attend): q.k products summed in
 * float32, scaled by d^-0.5, softmax in float32, probabilities rounded to bf16, p.v summed in float32, rounded to
 * bf16 (summation order and exp differ: results agree to bf16 rounding, not bit for bit).
 * Written against XLA's C API (jaxlib's xla/ffi/api/c_api.h); moe_jax/native/ffi.py registers it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ffi_common.h"

#define KERNEL __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as XLA's convert */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* 16 bf16 values (the first `count` of them; the rest read as 0) as float32: bf16 is float32's upper half. */
static KERNEL inline __m512 load_bf16(const uint16_t *p, int count) {
    __m256i h = count >= 16 ? _mm256_loadu_si256((const __m256i *)p)
                            : _mm256_maskz_loadu_epi16((__mmask16)((1u << count) - 1), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* e^x for x <= 0 (a softmax's shifted scores), 16 at a time: 2^(x log2 e) as 2^n times the degree-6 Taylor
 * polynomial of 2^f, n the nearest integer (|f| <= 1/2); relative error under 4e-6 (checked against float64 over
 * [-80, 0]), far below the bf16 rounding the probabilities get next. */
static KERNEL inline __m512 exp_nonpositive(__m512 x) {
    __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}

/* x rounded to bfloat16 precision (nearest even), kept as float32; for finite x. */
static KERNEL inline __m512 round_to_bf16(__m512 x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32((int)0xffff0000u)));
}

/* r[k] = the sum of v[k]'s 16 lanes, for 16 vectors at once (a transpose folded into the additions). */
static KERNEL inline __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4];
    for (int k = 0; k < 8; k++) /* quarters 0-1: v[2k], 2-3: v[2k+1] */
        a[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
    for (int k = 0; k < 4; k++) /* quarter r: v[4k + r] */
        b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xDD));
    __m512 u0 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
    __m512 u1 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
    __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u0), _mm512_castps_pd(u1))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u0), _mm512_castps_pd(u1))));
    /* s holds sum(v[4l + r]) at 4r + l */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s);
}

/* One (row, kv head): the group's `g` queries against keys [first, last]. Work space (float32): qf g * dp,
 * block 16 * dp, scores g * stride, out_f g * dp, with dp = d rounded up to 16 (zero padding). */
static KERNEL void attend_head(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, int64_t g,
                               int64_t d, int64_t first, int64_t last, float *work, int64_t stride) {
    const int64_t dp = (d + 15) / 16 * 16, n = last - first + 1;
    float *qf = work, *block = qf + g * dp, *scores = block + 16 * dp, *out_f = scores + g * stride;
    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf((float)d));
    for (int64_t m = 0; m < g; m++)
        for (int64_t i = 0; i < dp; i += 16)
            _mm512_storeu_ps(qf + m * dp + i, load_bf16(q + m * d + i, d - i < 16 ? (int)(d - i) : 16));
    /* scores, 16 keys at a time: the keys in float32 once, then each query's 16 dot products summed together */
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t keys = n - j0 < 16 ? n - j0 : 16;
        for (int64_t jj = 0; jj < 16; jj++)
            for (int64_t i = 0; i < dp; i += 16)
                _mm512_storeu_ps(block + jj * dp + i, jj < keys ? load_bf16(k + (first + j0 + jj) * d + i,
                                                                            d - i < 16 ? (int)(d - i) : 16)
                                                                : _mm512_setzero_ps());
        const __mmask16 kept = (__mmask16)((1u << keys) - 1);
        for (int64_t m = 0; m < g; m++) {
            __m512 dots[16];
            for (int jj = 0; jj < 16; jj++) dots[jj] = _mm512_setzero_ps();
            for (int64_t i = 0; i < dp; i += 16) {
                const __m512 qv = _mm512_loadu_ps(qf + m * dp + i);
                for (int jj = 0; jj < 16; jj++) dots[jj] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(block + jj * dp + i), dots[jj]);
            }
            _mm512_mask_storeu_ps(scores + m * stride + j0, kept, _mm512_mul_ps(sum16(dots), scale));
        }
    }
    /* softmax per query; probabilities rounded to bf16 (as XLA's path feeds them to its p.v product) */
    for (int64_t m = 0; m < g; m++) {
        float *row = scores + m * stride;
        __m512 top = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 mask = (__mmask16)(n - j < 16 ? (1u << (n - j)) - 1 : 0xffffu);
            top = _mm512_mask_max_ps(top, mask, top, _mm512_maskz_loadu_ps(mask, row + j));
        }
        const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 mask = (__mmask16)(n - j < 16 ? (1u << (n - j)) - 1 : 0xffffu);
            const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + j), shift));
            _mm512_mask_storeu_ps(row + j, mask, e);
            total = _mm512_mask_add_ps(total, mask, total, e);
        }
        const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 mask = (__mmask16)(n - j < 16 ? (1u << (n - j)) - 1 : 0xffffu);
            _mm512_mask_storeu_ps(row + j, mask, round_to_bf16(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row + j), inverse)));
        }
    }
    /* p.v: 16 columns at a time, 4 queries' sums in registers across the keys */
    for (int64_t i = 0; i < dp; i += 16) {
        const int count = d - i < 16 ? (int)(d - i) : 16;
        for (int64_t m0 = 0; m0 < g; m0 += 4) {
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            const int64_t block_g = g - m0 < 4 ? g - m0 : 4;
            for (int64_t j = 0; j < n; j++) {
                const __m512 vv = load_bf16(v + (first + j) * d + i, count);
                for (int mm = 0; mm < 4; mm++)
                    if (mm < block_g)
                        acc[mm] = _mm512_fmadd_ps(_mm512_set1_ps(scores[(m0 + mm) * stride + j]), vv, acc[mm]);
            }
            for (int mm = 0; mm < block_g; mm++) _mm512_storeu_ps(out_f + (m0 + mm) * dp + i, acc[mm]);
        }
    }
    for (int64_t m = 0; m < g; m++)
        for (int64_t i = 0; i < d; i++) out[m * d + i] = f32_to_bf16(out_f[m * dp + i]);
}

static int is_bf16(const XLA_FFI_Buffer *b, int64_t rank) { return b->dtype == XLA_FFI_DataType_BF16 && b->rank == rank; }

XLA_FFI_Error *moe_jax_decode_attention(XLA_FFI_CallFrame *frame) {
    const XLA_FFI_Api *api = frame->api;
    if (ffi_answer_metadata(frame)) return NULL;
    if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE)
        return ffi_error(api, "moe_jax_decode_attention: not the execute stage");
    if (frame->args.size != 6 || frame->rets.size != 3 || frame->attrs.size != 1 ||
        frame->attrs.types[0] != XLA_FFI_AttrType_SCALAR)
        return ffi_error(api, "moe_jax_decode_attention takes (q, k_new, v_new, positions, k_cache, v_cache), "
                                    "returns (out, k_cache, v_cache), and has one attribute `window`");
    for (int i = 0; i < 6; i++)
        if (frame->args.types[i] != XLA_FFI_ArgType_BUFFER)
            return ffi_error(api, "moe_jax_decode_attention: operands are arrays");
    const XLA_FFI_Buffer *q = frame->args.args[0], *k_new = frame->args.args[1], *v_new = frame->args.args[2];
    const XLA_FFI_Buffer *positions = frame->args.args[3], *k_in = frame->args.args[4], *v_in = frame->args.args[5];
    const XLA_FFI_Buffer *out = frame->rets.rets[0], *k_out = frame->rets.rets[1], *v_out = frame->rets.rets[2];
    const XLA_FFI_Scalar *window_attr = frame->attrs.attrs[0];
    if (window_attr->dtype != XLA_FFI_DataType_S64)
        return ffi_error(api, "moe_jax_decode_attention: `window` must be an s64");
    const int64_t window = *(const int64_t *)window_attr->value;
    if (!is_bf16(q, 4) || !is_bf16(k_new, 4) || !is_bf16(v_new, 4) || !is_bf16(k_in, 4) || !is_bf16(v_in, 4) ||
        !is_bf16(out, 4) || !is_bf16(k_out, 4) || !is_bf16(v_out, 4) || positions->dtype != XLA_FFI_DataType_S32)
        return ffi_error(api, "moe_jax_decode_attention: bf16 arrays of rank 4 and s32 positions expected");
    const int64_t b = k_in->dims[0], kv = k_in->dims[1], s = k_in->dims[2], d = k_in->dims[3], g = q->dims[2];
    for (int i = 0; i < 4; i++)
        if (v_in->dims[i] != k_in->dims[i] || k_out->dims[i] != k_in->dims[i] || v_out->dims[i] != k_in->dims[i] ||
            out->dims[i] != q->dims[i])
            return ffi_error(api, "moe_jax_decode_attention: cache, result and query shapes disagree");
    if (q->dims[0] != b || q->dims[1] != kv || q->dims[3] != d || k_new->dims[0] != b || k_new->dims[1] != kv ||
        k_new->dims[2] != 1 || k_new->dims[3] != d || v_new->dims[2] != 1 || positions->rank != 2 ||
        positions->dims[0] != b || positions->dims[1] != 1)
        return ffi_error(api, "moe_jax_decode_attention: q [b, kv, g, d], new entries [b, kv, 1, d], "
                                    "positions [b, 1], cache [b, kv, s, d] expected");
    const int32_t *pos = positions->data;
    for (int64_t r = 0; r < b; r++)
        if (pos[r] < 0 || pos[r] >= s) return ffi_error(api, "moe_jax_decode_attention: a position is outside the cache");
    const size_t cache_bytes = (size_t)(b * kv * s * d) * 2;
    if (k_out->data != k_in->data) memcpy(k_out->data, k_in->data, cache_bytes); /* not aliased: copy, then write */
    if (v_out->data != v_in->data) memcpy(v_out->data, v_in->data, cache_bytes);
    const int64_t dp = (d + 15) / 16 * 16, stride = (s + 15) / 16 * 16;
    float *work = malloc((size_t)(2 * g * dp + 16 * dp + g * stride) * sizeof(float));
    if (!work) return ffi_error(api, "moe_jax_decode_attention: out of memory for its work space");
    for (int64_t r = 0; r < b; r++) {
        const int64_t last = pos[r], first = window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
        for (int64_t h = 0; h < kv; h++) {
            const int64_t head = r * kv + h;
            uint16_t *k = (uint16_t *)k_out->data + head * s * d, *v = (uint16_t *)v_out->data + head * s * d;
            memcpy(k + last * d, (const uint16_t *)k_new->data + head * d, (size_t)d * 2);
            memcpy(v + last * d, (const uint16_t *)v_new->data + head * d, (size_t)d * 2);
            attend_head((const uint16_t *)q->data + head * g * d, k, v, (uint16_t *)out->data + head * g * d, g, d,
                        first, last, work, stride);
        }
    }
    free(work);
    return NULL;
}
