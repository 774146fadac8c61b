/* XLA FFI handler "moe_jax_cache_attention": the attention of a step's new tokens to the KV cache on XLA:CPU, one
 * token a row (a decode step) or many (a prefill step), bfloat16 or float32 KV cache.
 *
 * For each row and KV head it writes the step's new keys and values into the cache at their positions (the cache
 * buffers are aliased to the results, so this is in place), then attends each new token's group of queries to the
 * cache entries its position sees: keys up to the position (within a sliding window), so a prefill's causal
 * attention reads each key block once for a block of tokens and never the keys past a token. XLA's path writes by a
 * select (a one-hot product for many tokens) over the whole cache and attends every query to every cache entry
 * under a mask.
 *
 * Operands: q [b, kv, t, g, d], k_new and v_new [b, kv, t, d], positions [b, t] (s32), k_cache and v_cache
 * [b, kv, s, d]; all bf16, or all float32 (a float32 model's cache), but positions. Results: out [b, kv, t, g, d],
 * k_cache, v_cache. A row's first position must lie in the cache; a later one past its end (a prefill's right
 * padding) is not written and sees the whole cache. Attributes (s64): `window`, a sliding window's length, 0 for
 * none; `avx512`, 1 for the AVX-512 variant, 0 for the AVX2 + FMA one (the same arithmetic 16 or 8 lanes wide:
 * cache_attention_block.h, written once for both, and for both element types). Arithmetic as the XLA path
 * (layers.attend): q.k products summed in float32, scaled by d^-0.5, softmax in float32, probabilities rounded to
 * bf16 for a bf16 cache, p.v summed in float32, rounded to bf16 for a bf16 cache (summation order and exp differ:
 * results agree to the dtype's rounding, not bit for bit). The tasks, a block of up to TASK_ROWS query rows of one
 * (row, kv head), are shared by the calling thread and helpers from XLA's pool.
 * Written against XLA's C API (jaxlib's xla/ffi/api/c_api.h); moe_jax/native/ffi.py registers it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ffi_common.h"

#define DP_ALIGN 32    /* head dims padded to a multiple of two AVX-512 vectors, p.v's column tile */
#define VALUE_CHUNK 64 /* values widened to float32 at a time for p.v */
#define TASK_ROWS 64   /* query rows (tokens x group) a task attends together, sharing each key block's widening */

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as XLA's convert */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* e^x for x <= 0 (a softmax's shifted scores), a vector at a time: 2^(x log2 e) as 2^n times the degree-6 Taylor
 * polynomial of 2^f, n the nearest integer (|f| <= 1/2); relative error under 4e-6 (checked against float64 over
 * [-80, 0]), far below the bf16 rounding the probabilities get next. Both instruction sets' versions use these
 * coefficients (SET1: the set's broadcast, defined in its section). */
#define EXP2_COEFFICIENTS(FMA, p, f)             \
    p = FMA(p, f, SET1(1.3333558e-3f));          \
    p = FMA(p, f, SET1(9.6181291e-3f));          \
    p = FMA(p, f, SET1(5.5504109e-2f));          \
    p = FMA(p, f, SET1(2.4022651e-1f));          \
    p = FMA(p, f, SET1(6.9314718e-1f));          \
    p = FMA(p, f, SET1(1.0f))
#define EXP2_FIRST 1.5403530e-4f

/* lanes [0, count) of `lanes` (count <= 0: none, >= lanes: all) */
static inline int lanes_of(int64_t count, int lanes) { return count <= 0 ? 0 : count >= lanes ? lanes : (int)count; }

/* ---- AVX-512: 16 lanes ---- */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,fma")
#define ISA avx512
#define V __m512
#define W 16
#define SET1 _mm512_set1_ps
static inline __mmask16 avx512_mask(int64_t count) { return (__mmask16)((1u << lanes_of(count, 16)) - 1); }
static inline V avx512_zero(void) { return _mm512_setzero_ps(); }
static inline V avx512_set1(float x) { return _mm512_set1_ps(x); }
static inline V avx512_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void avx512_store(float *p, V x) { _mm512_storeu_ps(p, x); }
static inline V avx512_add(V a, V b) { return _mm512_add_ps(a, b); }
static inline V avx512_sub(V a, V b) { return _mm512_sub_ps(a, b); }
static inline V avx512_mul(V a, V b) { return _mm512_mul_ps(a, b); }
static inline V avx512_max(V a, V b) { return _mm512_max_ps(a, b); }
static inline V avx512_fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline V avx512_load_n(const float *p, int64_t count, float fill) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), avx512_mask(count), p);
}
static inline void avx512_store_n(float *p, V x, int64_t count) { _mm512_mask_storeu_ps(p, avx512_mask(count), x); }
static inline V avx512_keep(V x, int64_t count) { return _mm512_maskz_mov_ps(avx512_mask(count), x); }
static inline float avx512_hmax(V x) { return _mm512_reduce_max_ps(x); }
static inline float avx512_hsum(V x) { return _mm512_reduce_add_ps(x); }
/* W float32 values (the first `count` of them; the rest read as 0) */
static inline V avx512_load_f32(const float *p, int64_t count) { return _mm512_maskz_loadu_ps(avx512_mask(count), p); }
/* the same from bf16 values, as float32: bf16 is float32's upper half */
static inline V avx512_load_bf16(const uint16_t *p, int64_t count) {
    __m256i h = count >= 16 ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(avx512_mask(count), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline V avx512_exp_nonpositive(V x) {
    V t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-126.0f));
    V n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, n);
    V p = _mm512_set1_ps(EXP2_FIRST);
    EXP2_COEFFICIENTS(_mm512_fmadd_ps, p, f);
    __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}
/* x rounded to bfloat16 precision (nearest even), kept as float32; for finite x */
static inline V avx512_round_to_bf16(V x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32((int)0xffff0000u)));
}
/* r[k] = the sum of v[k]'s 16 lanes, for 16 vectors at once (a transpose folded into the additions) */
static inline V avx512_sum_lanes(const V *v) {
    V a[8], b[4];
    for (int k = 0; k < 8; k++) /* quarters 0-1: v[2k], 2-3: v[2k+1] */
        a[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
    for (int k = 0; k < 4; k++) /* quarter r: v[4k + r] */
        b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xDD));
    V u0 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
    V u1 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
    V s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u0), _mm512_castps_pd(u1))),
                        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u0), _mm512_castps_pd(u1))));
    /* s holds sum(v[4l + r]) at 4r + l */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s);
}
#include "cache_attention_blocks.h"
#undef SET1
#undef W
#undef V
#undef ISA
#pragma GCC pop_options

/* ---- AVX2 + FMA: 8 lanes ---- */
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define ISA avx2
#define V __m256
#define W 8
#define SET1 _mm256_set1_ps
#include "simd_avx2.h" /* compiled for avx2,fma here, as that header asks */
static inline __m256i avx2_mask(int64_t count) { return lanes8(count); }
static inline V avx2_zero(void) { return _mm256_setzero_ps(); }
static inline V avx2_set1(float x) { return _mm256_set1_ps(x); }
static inline V avx2_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void avx2_store(float *p, V x) { _mm256_storeu_ps(p, x); }
static inline V avx2_add(V a, V b) { return _mm256_add_ps(a, b); }
static inline V avx2_sub(V a, V b) { return _mm256_sub_ps(a, b); }
static inline V avx2_mul(V a, V b) { return _mm256_mul_ps(a, b); }
static inline V avx2_max(V a, V b) { return _mm256_max_ps(a, b); }
static inline V avx2_fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static inline V avx2_load_n(const float *p, int64_t count, float fill) {
    const __m256i mask = avx2_mask(count);
    return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, mask), _mm256_castsi256_ps(mask));
}
static inline void avx2_store_n(float *p, V x, int64_t count) { store8(p, x, count); }
static inline V avx2_keep(V x, int64_t count) { return _mm256_and_ps(x, _mm256_castsi256_ps(avx2_mask(count))); }
static inline float avx2_hmax(V x) { return hmax8(x); }
static inline float avx2_hsum(V x) { return hsum8(x); }
static inline V avx2_load_f32(const float *p, int64_t count) { return avx2_load_n(p, count, 0.0f); }
static inline V avx2_load_bf16(const uint16_t *p, int64_t count) {
    uint16_t part[8] = {0};
    if (count < 8) memcpy(part, p, (size_t)lanes_of(count, 8) * 2);
    return widen_bf16x8(count >= 8 ? p : part);
}
static inline V avx2_exp_nonpositive(V x) {
    V t = _mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(-126.0f));
    V n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm256_sub_ps(t, n);
    V p = _mm256_set1_ps(EXP2_FIRST);
    EXP2_COEFFICIENTS(_mm256_fmadd_ps, p, f);
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
static inline V avx2_round_to_bf16(V x) {
    __m256i bits = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32((int)0xffff0000u)));
}
/* r[k] = the sum of v[k]'s 8 lanes, for 8 vectors at once: pairwise horizontal additions, then the halves */
static inline V avx2_sum_lanes(const V *v) {
    const V b0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const V b1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* b0: sums of v[0..3]'s low halves, then of their high halves; b1 the same for v[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
#include "cache_attention_blocks.h"
#undef SET1
#undef W
#undef V
#undef ISA
#pragma GCC pop_options

/* One call's operands, shared by the tasks: a task is a block of up to `block` tokens of one (row, kv head). Arrays
 * of `elem`-byte values (bf16 or float32), addressed in bytes. */
typedef void (*attend_block_fn)(const void *, const void *, const void *, void *, int64_t, int64_t, int64_t,
                                const int64_t *, const int64_t *, float *, int64_t);
typedef struct {
    const char *q;
    const int32_t *positions;
    const char *k_cache, *v_cache;
    char *out;
    int64_t kv, t, s, d, g, window, elem, block, blocks;
    attend_block_fn attend_block;
    _Atomic int failed; /* a task could not allocate its work space */
} attention_call;

/* Each thread's work space, kept for its next task and call (a fresh one each task, above malloc's mmap threshold
 * for long caches, page-faulted its scores in every time); at most one task's size per thread, for the process. */
static __thread float *thread_work;
static __thread size_t thread_work_floats;

static float *work_space(size_t floats) {
    if (floats > thread_work_floats) {
        float *grown = realloc(thread_work, floats * sizeof(float));
        if (!grown) return NULL;
        thread_work = grown, thread_work_floats = floats;
    }
    return thread_work;
}

/* the keys [first, last] a token at `position` sees in a cache of `s` entries */
static void key_range(int64_t position, int64_t window, int64_t s, int64_t *first, int64_t *last) {
    *last = position < s ? position : s - 1;
    *first = window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
    if (*first > *last) *first = *last; /* right padding past the cache's end */
}

/* Attends one block of a (row, kv head)'s tokens to the keys they see (the new entries already written). */
static void attend_task(void *data, int64_t task) {
    attention_call *c = data;
    const int64_t head = task / c->blocks, t0 = task % c->blocks * c->block, row_index = head / c->kv;
    const int64_t tokens = c->t - t0 < c->block ? c->t - t0 : c->block;
    int64_t firsts[TASK_ROWS], lasts[TASK_ROWS], lowest = INT64_MAX, highest = 0;
    for (int64_t j = 0; j < tokens; j++) {
        key_range(c->positions[row_index * c->t + t0 + j], c->window, c->s, firsts + j, lasts + j);
        lowest = firsts[j] < lowest ? firsts[j] : lowest;
        highest = lasts[j] > highest ? lasts[j] : highest;
    }
    const int64_t d = c->d, dp = (d + DP_ALIGN - 1) / DP_ALIGN * DP_ALIGN, rows4 = (tokens * c->g + 3) / 4 * 4;
    const int64_t stride = (highest - lowest + 16) / 16 * 16, row = d * c->elem;
    float *work = work_space((size_t)(rows4 * (2 * dp + stride) + (16 + VALUE_CHUNK) * dp));
    if (!work) {
        atomic_store(&c->failed, 1);
        return;
    }
    const int64_t query = (head * c->t + t0) * c->g * row;
    c->attend_block(c->q + query, c->k_cache + head * c->s * row, c->v_cache + head * c->s * row, c->out + query,
                    tokens, c->g, d, firsts, lasts, work, stride);
}

/* Writes each row's new keys and values into the cache at their positions (those inside it). */
static void write_new_entries(const char *k_new, const char *v_new, const int32_t *positions, char *k_cache,
                              char *v_cache, int64_t b, int64_t kv, int64_t t, int64_t s, int64_t row) {
    for (int64_t head = 0; head < b * kv; head++)
        for (int64_t j = 0; j < t; j++) {
            const int64_t position = positions[head / kv * t + j];
            if (position >= s) continue;
            memcpy(k_cache + (head * s + position) * row, k_new + (head * t + j) * row, (size_t)row);
            memcpy(v_cache + (head * s + position) * row, v_new + (head * t + j) * row, (size_t)row);
        }
}

static attend_block_fn variant(int avx512, int f32) {
    if (avx512) return f32 ? avx512_attend_block_f32 : avx512_attend_block_bf16;
    return f32 ? avx2_attend_block_f32 : avx2_attend_block_bf16;
}

static int is_type(const XLA_FFI_Buffer *b, XLA_FFI_DataType type, int64_t rank) {
    return b->dtype == type && b->rank == rank;
}

XLA_FFI_Error *moe_jax_cache_attention(XLA_FFI_CallFrame *frame) {
    const XLA_FFI_Api *api = frame->api;
    if (ffi_answer_metadata(frame)) return NULL;
    if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE)
        return ffi_error(api, "moe_jax_cache_attention: not the execute stage");
    if (frame->args.size != 6 || frame->rets.size != 3)
        return ffi_error(api, "moe_jax_cache_attention takes (q, k_new, v_new, positions, k_cache, v_cache) and "
                              "returns (out, k_cache, v_cache)");
    int64_t window, avx512;
    if (ffi_s64_attr(frame, "window", &window) || ffi_s64_attr(frame, "avx512", &avx512))
        return ffi_error(api, "moe_jax_cache_attention: s64 attributes `window` and `avx512` expected");
    for (int i = 0; i < 6; i++)
        if (frame->args.types[i] != XLA_FFI_ArgType_BUFFER)
            return ffi_error(api, "moe_jax_cache_attention: operands are arrays");
    const XLA_FFI_Buffer *q = frame->args.args[0], *k_new = frame->args.args[1], *v_new = frame->args.args[2];
    const XLA_FFI_Buffer *positions = frame->args.args[3], *k_in = frame->args.args[4], *v_in = frame->args.args[5];
    const XLA_FFI_Buffer *out = frame->rets.rets[0], *k_out = frame->rets.rets[1], *v_out = frame->rets.rets[2];
    const XLA_FFI_DataType type = q->dtype;
    if ((type != XLA_FFI_DataType_BF16 && type != XLA_FFI_DataType_F32) || !is_type(q, type, 5) ||
        !is_type(k_new, type, 4) || !is_type(v_new, type, 4) || !is_type(k_in, type, 4) || !is_type(v_in, type, 4) ||
        !is_type(out, type, 5) || !is_type(k_out, type, 4) || !is_type(v_out, type, 4) ||
        positions->dtype != XLA_FFI_DataType_S32)
        return ffi_error(api, "moe_jax_cache_attention: q and out of rank 5, the rest of rank 4, all bf16 or all f32, "
                              "and s32 positions expected");
    const int64_t elem = type == XLA_FFI_DataType_F32 ? 4 : 2;
    const int64_t b = k_in->dims[0], kv = k_in->dims[1], s = k_in->dims[2], d = k_in->dims[3];
    const int64_t t = q->dims[2], g = q->dims[3];
    for (int i = 0; i < 5; i++)
        if (out->dims[i] != q->dims[i] || (i < 4 && (v_in->dims[i] != k_in->dims[i] ||
                                                     k_out->dims[i] != k_in->dims[i] || v_out->dims[i] != k_in->dims[i])))
            return ffi_error(api, "moe_jax_cache_attention: cache, result and query shapes disagree");
    if (q->dims[0] != b || q->dims[1] != kv || q->dims[4] != d || k_new->dims[0] != b || k_new->dims[1] != kv ||
        k_new->dims[2] != t || k_new->dims[3] != d || v_new->dims[0] != b || v_new->dims[1] != kv ||
        v_new->dims[2] != t || v_new->dims[3] != d || positions->rank != 2 || positions->dims[0] != b ||
        positions->dims[1] != t)
        return ffi_error(api, "moe_jax_cache_attention: q [b, kv, t, g, d], new entries [b, kv, t, d], "
                              "positions [b, t], cache [b, kv, s, d] expected");
    const int32_t *pos = positions->data;
    for (int64_t r = 0; r < b; r++)
        for (int64_t j = 0; j < t; j++)
            if (pos[r * t + j] < 0 || (j == 0 && pos[r * t] >= s))
                return ffi_error(api, "moe_jax_cache_attention: a position is outside the cache");
    const size_t cache_bytes = (size_t)(b * kv * s * d * elem);
    if (k_out->data != k_in->data) memcpy(k_out->data, k_in->data, cache_bytes); /* not aliased: copy, then write */
    if (v_out->data != v_in->data) memcpy(v_out->data, v_in->data, cache_bytes);
    write_new_entries(k_new->data, v_new->data, pos, k_out->data, v_out->data, b, kv, t, s, d * elem);
    const int64_t block = g < TASK_ROWS ? TASK_ROWS / g : 1, blocks = (t + block - 1) / block;
    attention_call call = {q->data, pos,   k_out->data, v_out->data, out->data, kv,     t, s, d, g, window, elem,
                           block,   blocks, variant(avx512, elem == 4), 0};
    if (ffi_parallel_for(api, frame->ctx, b * kv * blocks, attend_task, &call) || atomic_load(&call.failed))
        return ffi_error(api, "moe_jax_cache_attention: out of memory for its work space");
    return NULL;
}
