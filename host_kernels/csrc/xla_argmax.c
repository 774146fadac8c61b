/* XLA FFI handler "moe_jax_argmax": each row's greedy token, the index of its first maximum, from float32 logits
 * [rows, vocab] into int32 [rows, 1]. A NaN counts as the maximum (the first NaN wins), as in jnp.argmax and
 * numpy. XLA:CPU's own argmax, a variadic reduce, was a visible share of every greedy decode step at large
 * vocabularies; this is one AVX-512 or AVX2 pass over them (the s64 attribute
 * `avx512` says which: 1 or 0).
 * Written against XLA's C API (jaxlib's xla/ffi/api/c_api.h); moe_jax/native/ffi.py registers it.
 */
#include <immintrin.h>
#include <stdint.h>

#include "ffi_common.h"
#include "xla_argmax.h"

#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2")))

static int32_t first_nan(const float *x, int64_t n) {
    for (int64_t j = 0; j < n; j++)
        if (x[j] != x[j]) return (int32_t)j;
    return -1;
}

static AVX512 int32_t row_argmax_avx512(const float *x, int64_t n) {
    __m512 best = _mm512_set1_ps(-__builtin_inff());
    __m512i best_at = _mm512_setzero_si512(), at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 nan = 0;
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 valid = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(best, valid, x + j); /* past the end: `best`, never greater */
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ); /* strictly: a lane keeps its first */
        best = _mm512_mask_mov_ps(best, greater, v);
        best_at = _mm512_mask_mov_epi32(best_at, greater, at);
        at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
    }
    if (nan) return first_nan(x, n);
    const float top = _mm512_reduce_max_ps(best);
    /* the lowest index among the lanes holding the maximum: the first occurrence in the row */
    const __mmask16 holds = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    return _mm512_mask_reduce_min_epi32(holds, best_at);
}

/* The same over 8 lanes: whole blocks in the vectors, the last n % 8 values one by one (their indices are above
 * every lane's, so a strictly greater value still keeps the first maximum). */
static AVX2 int32_t row_argmax_avx2(const float *x, int64_t n) {
    __m256 best = _mm256_set1_ps(-__builtin_inff()), nan = _mm256_setzero_ps();
    __m256i best_at = _mm256_setzero_si256(), at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
        best = _mm256_blendv_ps(best, v, greater);
        best_at = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(best_at), _mm256_castsi256_ps(at), greater));
        at = _mm256_add_epi32(at, _mm256_set1_epi32(8));
    }
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t k = j; k < n && !any_nan; k++) any_nan = x[k] != x[k];
    if (any_nan) return first_nan(x, n);
    float lanes[8];
    int32_t lane_at[8];
    _mm256_storeu_ps(lanes, best);
    _mm256_storeu_si256((__m256i *)lane_at, best_at);
    float top = lanes[0];
    int32_t top_at = lane_at[0];
    for (int lane = 1; lane < 8; lane++) /* the lowest index among the lanes holding the maximum */
        if (lanes[lane] > top || (lanes[lane] == top && lane_at[lane] < top_at)) {
            top = lanes[lane];
            top_at = lane_at[lane];
        }
    for (; j < n; j++)
        if (x[j] > top) {
            top = x[j];
            top_at = (int32_t)j;
        }
    return top_at;
}

int32_t row_argmax(const float *x, int64_t n, int avx512) {
    return avx512 ? row_argmax_avx512(x, n) : row_argmax_avx2(x, n);
}

XLA_FFI_Error *moe_jax_argmax(XLA_FFI_CallFrame *frame) {
    const XLA_FFI_Api *api = frame->api;
    if (ffi_answer_metadata(frame)) return NULL;
    if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return ffi_error(api, "moe_jax_argmax: not the execute stage");
    if (frame->args.size != 1 || frame->rets.size != 1 || frame->args.types[0] != XLA_FFI_ArgType_BUFFER)
        return ffi_error(api, "moe_jax_argmax takes one array of logits and returns one");
    int64_t avx512;
    if (ffi_s64_attr(frame, "avx512", &avx512)) return ffi_error(api, "moe_jax_argmax: s64 attribute avx512 expected");
    const XLA_FFI_Buffer *logits = frame->args.args[0], *tokens = frame->rets.rets[0];
    if (logits->dtype != XLA_FFI_DataType_F32 || logits->rank != 2 || tokens->dtype != XLA_FFI_DataType_S32 ||
        tokens->rank != 2 || tokens->dims[0] != logits->dims[0] || tokens->dims[1] != 1 || logits->dims[1] < 1)
        return ffi_error(api, "moe_jax_argmax: f32 logits [rows, vocab >= 1] -> s32 [rows, 1] expected");
    const int64_t rows = logits->dims[0], vocab = logits->dims[1];
    const float *x = logits->data;
    int32_t *out = tokens->data;
    for (int64_t r = 0; r < rows; r++)
        out[r] = row_argmax(x + r * vocab, vocab, (int)avx512);
    return NULL;
}
