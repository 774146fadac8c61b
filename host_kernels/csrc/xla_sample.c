/* XLA FFI handler "moe_jax_sample": each row's next token drawn from float32 logits [rows, vocab] at its own
 * temperature, top-p and top-k (f32 [rows], f32 [rows], s32 [rows]) with its own uniform draw in [0, 1) (float64,
 * carried as the two u32 words of its bits [rows, 2]: XLA without x64 has no float64 arrays), into s32 [rows, 1].
 * A row at temperature 0 takes its argmax (xla_argmax.h). The same distribution as the host's sampler
 * (moe_jax/generation/sampling.py): z = (logit - max) / T in float64, top-k keeping ties with the k-th, the nucleus
 * as its `_nucleus` cuts it (the same tie rule; floors of its own), then the first token in token order whose
 * cumulative probability passes the draw; with the host's draw, the host's token unless the draw lies within
 * rounding of a boundary. It lets sampled decode steps run in blocks on XLA:CPU (moe_jax/generation/engine.py)
 * instead of one step a call with the logits read and sampled in Python. A NaN or +inf logit is an error, as on
 * the host. The s64 attribute `avx512` picks the variant of the exp pass: 1 or 0 (AVX2).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ffi_common.h"
#include "xla_argmax.h"

#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2,fma")))

/* exp is taken as 0 below this (x <= 0 here: e^-700 is 1e-304, nothing a draw in [0, 1) can tell from 0): a -inf
 * logit, masked by its caller, gets no probability at all */
#define EXP_FLOOR (-700.0)
#define BLOCK 64 /* tokens whose probabilities are summed together, for the draw to skip to its block */
#define LOG2E 1.4426950408889634
#define LN2_HI 0.6931471803691238 /* ln 2 in two parts (Cody and Waite): n * LN2_HI is exact for |n| < 2^11 */
#define LN2_LO 1.9082149292705877e-10

/* exp(r) for |r| <= ln2 / 2: its degree-12 Taylor polynomial (truncated below 2e-16 relative), highest first */
static const double EXP_TAYLOR[13] = {1.0 / 479001600, 1.0 / 39916800, 1.0 / 3628800, 1.0 / 362880, 1.0 / 40320,
                                      1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0};

static AVX512 __m512d exp_reduced8(__m512d r) {
    __m512d acc = _mm512_set1_pd(EXP_TAYLOR[0]);
    for (int i = 1; i < 13; i++) acc = _mm512_fmadd_pd(acc, r, _mm512_set1_pd(EXP_TAYLOR[i]));
    return acc;
}

static AVX2 __m256d exp_reduced4(__m256d r) {
    __m256d acc = _mm256_set1_pd(EXP_TAYLOR[0]);
    for (int i = 1; i < 13; i++) acc = _mm256_fmadd_pd(acc, r, _mm256_set1_pd(EXP_TAYLOR[i]));
    return acc;
}

/* blocks[b] = the sum of p[b * BLOCK .. (b + 1) * BLOCK) (the last block: what remains) */
static void block_sums(const double *p, int64_t n, double *blocks) {
    for (int64_t b = 0; b * BLOCK < n; b++) {
        double sum = 0.0;
        for (int64_t j = b * BLOCK; j < n && j < (b + 1) * BLOCK; j++) sum += p[j];
        blocks[b] = sum;
    }
}

/* p[j] = exp((x[j] - top) / t) in float64 for j < n (times 1 / t: within an ulp of the host's quotient), 8 at a
 * time, and the sums of each BLOCK of them into blocks[j / BLOCK]; returns their sum */
static AVX512 double exp_pass_avx512(const float *x, int64_t n, double top, double t, double *p, double *blocks) {
    const __m512d vtop = _mm512_set1_pd(top), vt = _mm512_set1_pd(1.0 / t), floor = _mm512_set1_pd(EXP_FLOOR);
    __m512d sum = _mm512_setzero_pd(), block = _mm512_setzero_pd();
    for (int64_t j = 0; j < n; j += 8) {
        const __mmask8 valid = n - j >= 8 ? 0xFF : (__mmask8)((1u << (n - j)) - 1);
        const __m256 xs = _mm512_castps512_ps256(_mm512_maskz_loadu_ps((__mmask16)valid, x + j));
        const __m512d z = _mm512_mul_pd(_mm512_sub_pd(_mm512_cvtps_pd(xs), vtop), vt);
        const __mmask8 live = _mm512_cmp_pd_mask(z, floor, _CMP_GE_OQ) & valid;
        const __m512d zc = _mm512_max_pd(z, floor);
        const __m512d k = _mm512_roundscale_pd(_mm512_mul_pd(zc, _mm512_set1_pd(LOG2E)), _MM_FROUND_TO_NEAREST_INT);
        __m512d r = _mm512_fnmadd_pd(k, _mm512_set1_pd(LN2_HI), zc);
        r = _mm512_fnmadd_pd(k, _mm512_set1_pd(LN2_LO), r);
        const __m512d e = _mm512_maskz_mov_pd(live, _mm512_scalef_pd(exp_reduced8(r), k));
        _mm512_mask_storeu_pd(p + j, valid, e);
        block = _mm512_add_pd(block, e);
        if ((j + 8) % BLOCK == 0 || j + 8 >= n) {
            blocks[j / BLOCK] = _mm512_reduce_add_pd(block);
            sum = _mm512_add_pd(sum, block);
            block = _mm512_setzero_pd();
        }
    }
    return _mm512_reduce_add_pd(sum);
}

static AVX2 double exp_pass_avx2(const float *x, int64_t n, double top, double t, double *p, double *blocks) {
    const __m256d vtop = _mm256_set1_pd(top), vt = _mm256_set1_pd(1.0 / t), floor = _mm256_set1_pd(EXP_FLOOR);
    __m256d sum = _mm256_setzero_pd();
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const __m256d z = _mm256_mul_pd(_mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + j)), vtop), vt);
        const __m256d live = _mm256_cmp_pd(z, floor, _CMP_GE_OQ);
        const __m256d zc = _mm256_max_pd(z, floor);
        const __m256d k = _mm256_round_pd(_mm256_mul_pd(zc, _mm256_set1_pd(LOG2E)), _MM_FROUND_TO_NEAREST_INT);
        __m256d r = _mm256_fnmadd_pd(k, _mm256_set1_pd(LN2_HI), zc);
        r = _mm256_fnmadd_pd(k, _mm256_set1_pd(LN2_LO), r);
        /* 2^k: k + 1023 into the exponent bits (k >= -1010 here, so always a normal number) */
        const __m256i bits = _mm256_slli_epi64(
            _mm256_cvtepi32_epi64(_mm_add_epi32(_mm256_cvtpd_epi32(k), _mm_set1_epi32(1023))), 52);
        const __m256d e = _mm256_and_pd(_mm256_mul_pd(exp_reduced4(r), _mm256_castsi256_pd(bits)), live);
        _mm256_storeu_pd(p + j, e);
        sum = _mm256_add_pd(sum, e);
    }
    double lanes[4], total;
    _mm256_storeu_pd(lanes, sum);
    total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; j < n; j++) {
        const double z = ((double)x[j] - top) * (1.0 / t);
        p[j] = z >= EXP_FLOOR ? exp(z) : 0.0;
        total += p[j];
    }
    block_sums(p, n, blocks);
    return total;
}

/* Probability floors (of the row's mass) that the top-k and nucleus cuts look above first, each next one where too
 * few tokens or too little mass lies above: a peaked row's cut is then found among a few tokens (the host's
 * sampler does the same with its own floors). The last floor, 0, holds every token. */
#define FLOORS 4
static const double FLOOR[FLOORS] = {1e-3, 1e-5, 1e-7, 0.0};

/* The k-th largest of v[0..n) (1 <= k <= n), v reordered: quickselect around a median of three. */
static double kth_largest(double *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    const int64_t want = k - 1;
    while (lo < hi) {
        const double a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi];
        const double pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                const double s = v[i];
                v[i++] = v[j];
                v[j--] = s;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            return v[want];
    }
    return v[want];
}

/* Of v[0..n) (> 0, reordered), the value `last` at which the prefix by falling value first reaches `need`: the
 * tokens above it all stay and of those equal to it the first *ties (in token order). A weighted quickselect (a
 * three-way partition around a median of three, then the part where the prefix crosses `need`): expected O(n),
 * where the host sorts what its floors leave (for a flat distribution, most of the vocabulary). */
static double nucleus_cut(double *v, int64_t n, double need, int64_t *ties) {
    int64_t lo = 0, hi = n;
    double before = 0.0; /* the mass of the values above [lo, hi): less than `need` */
    for (;;) {
        const double a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi - 1];
        const double pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        int64_t above = lo, i = lo, below = hi; /* [lo, above) > pivot, [above, i) == pivot, [below, hi) < pivot */
        while (i < below) {
            const double x = v[i];
            if (x > pivot) {
                v[i++] = v[above];
                v[above++] = x;
            } else if (x < pivot) {
                v[i] = v[--below];
                v[below] = x;
            } else {
                i++;
            }
        }
        double greater = 0.0;
        for (int64_t j = lo; j < above; j++) greater += v[j];
        if (above > lo && before + greater >= need) { /* the prefix crosses among the greater ones */
            hi = above;
            continue;
        }
        before += greater;
        int64_t equal = below - above, take = 0;
        while (take < equal && before + (double)take * pivot < need) take++;
        if (take < equal || below == hi) {
            *ties = take;
            return pivot;
        }
        before += (double)equal * pivot;
        lo = below;
    }
}

/* The host's `_nucleus` over probabilities p [n] summing to 1 (0 for tokens top-k dropped): zeroes those outside
 * the smallest prefix by falling probability whose mass reaches top_p (ties with its last kept in token order), the
 * most likely token always kept; `scratch` holds n doubles. Returns the kept mass. */
static double nucleus(double *p, int64_t n, double top_p, double *scratch) {
    int64_t live = 0;
    for (int f = 0; f < FLOORS; f++) { /* the most likely tokens first: the cut lies among them if they hold top_p */
        double mass = 0.0;
        live = 0;
        for (int64_t j = 0; j < n; j++)
            if (p[j] >= FLOOR[f] && p[j] > 0) {
                scratch[live++] = p[j];
                mass += p[j];
            }
        if (mass >= top_p) break;
    }
    int64_t ties;
    const double last = nucleus_cut(scratch, live, top_p, &ties);
    double mass = 0.0;
    for (int64_t j = 0; j < n; j++) {
        if (p[j] > last || (p[j] == last && ties-- > 0))
            mass += p[j];
        else
            p[j] = 0.0;
    }
    return mass;
}

/* The first token whose cumulative probability (p [n], summing to `mass`, in blocks of BLOCK summing to `blocks`)
 * passes u * mass: the host's inverse-CDF draw (searchsorted side "right" over the normalized cumulative sums). */
static int32_t draw(const double *p, const double *blocks, int64_t n, double mass, double u) {
    const double target = u * mass;
    double before = 0.0;
    int64_t j = 0;
    for (int64_t b = 0; (b + 1) * BLOCK < n && before + blocks[b] <= target; b++, j += BLOCK) before += blocks[b];
    int32_t last_live = -1;
    for (; j < n; j++) {
        if (p[j] <= 0.0) continue;
        before += p[j];
        last_live = (int32_t)j;
        if (before > target) return (int32_t)j;
    }
    return last_live; /* rounding left the target at the very end: the last token with any probability */
}

typedef struct {
    double *p, *scratch, *blocks;
} sample_buffers;

/* The row's maximum into *top; non-zero where it holds a NaN. */
static AVX512 int row_top_avx512(const float *x, int64_t n, float *top) {
    __m512 best = _mm512_set1_ps(-__builtin_inff());
    __mmask16 nan = 0;
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 valid = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(best, valid, x + j);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_max_ps(best, v);
    }
    *top = _mm512_reduce_max_ps(best);
    return nan != 0;
}

static AVX2 int row_top_avx2(const float *x, int64_t n, float *top) {
    __m256 best = _mm256_set1_ps(-__builtin_inff()), nan = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        best = _mm256_max_ps(best, v);
    }
    float lanes[8], m = -__builtin_inff();
    _mm256_storeu_ps(lanes, best);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (; j < n; j++) {
        any_nan |= x[j] != x[j];
        m = x[j] > m ? x[j] : m;
    }
    *top = m;
    return any_nan;
}

/* One row's token at temperature t > 0; -1 where its logits hold NaN or +inf. */
static int32_t sample_row(const float *x, int64_t n, double t, double top_p, int64_t top_k, double u, int avx512,
                          sample_buffers *buf) {
    float top;
    if (avx512 ? row_top_avx512(x, n, &top) : row_top_avx2(x, n, &top)) return -1;
    if (!(top < __builtin_inff()) || top == -__builtin_inff()) return -1; /* +inf, or every logit -inf */
    double total = avx512 ? exp_pass_avx512(x, n, top, t, buf->p, buf->blocks)
                          : exp_pass_avx2(x, n, top, t, buf->p, buf->blocks);
    if (top_k > 0 && top_k < n) { /* the k-th largest z is the k-th largest p: exp is monotone */
        int64_t count = 0;
        for (int f = 0; f < FLOORS && count < top_k; f++) { /* among the most likely, where k of them are */
            count = 0;
            for (int64_t j = 0; j < n; j++)
                if (buf->p[j] >= FLOOR[f] * total) buf->scratch[count++] = buf->p[j];
        }
        const double kth = kth_largest(buf->scratch, count, top_k);
        total = 0.0;
        for (int64_t j = 0; j < n; j++) {
            if (buf->p[j] < kth) buf->p[j] = 0.0;
            total += buf->p[j];
        }
    }
    double mass = total;
    if (top_p < 1.0) {
        for (int64_t j = 0; j < n; j++) buf->p[j] /= total;
        mass = nucleus(buf->p, n, top_p, buf->scratch);
    }
    if (top_p < 1.0 || (top_k > 0 && top_k < n)) block_sums(buf->p, n, buf->blocks);
    return draw(buf->p, buf->blocks, n, mass, u);
}

static int vector_of(const XLA_FFI_Buffer *b, int64_t rows, XLA_FFI_DataType type) {
    return b->dtype == type && b->rank == 1 && b->dims[0] == rows;
}

XLA_FFI_Error *moe_jax_sample(XLA_FFI_CallFrame *frame) {
    const XLA_FFI_Api *api = frame->api;
    if (ffi_answer_metadata(frame)) return NULL;
    if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return ffi_error(api, "moe_jax_sample: not the execute stage");
    if (frame->args.size != 5 || frame->rets.size != 1)
        return ffi_error(api, "moe_jax_sample takes logits, temperature, top_p, top_k and draws and returns tokens");
    for (int64_t i = 0; i < 5; i++)
        if (frame->args.types[i] != XLA_FFI_ArgType_BUFFER) return ffi_error(api, "moe_jax_sample: arrays expected");
    int64_t avx512;
    if (ffi_s64_attr(frame, "avx512", &avx512)) return ffi_error(api, "moe_jax_sample: s64 attribute avx512 expected");
    const XLA_FFI_Buffer *logits = frame->args.args[0], *temperature = frame->args.args[1];
    const XLA_FFI_Buffer *top_p = frame->args.args[2], *top_k = frame->args.args[3], *draws = frame->args.args[4];
    const XLA_FFI_Buffer *tokens = frame->rets.rets[0];
    if (logits->dtype != XLA_FFI_DataType_F32 || logits->rank != 2 || logits->dims[1] < 1)
        return ffi_error(api, "moe_jax_sample: f32 logits [rows, vocab >= 1] expected");
    const int64_t rows = logits->dims[0], vocab = logits->dims[1];
    if (!vector_of(temperature, rows, XLA_FFI_DataType_F32) || !vector_of(top_p, rows, XLA_FFI_DataType_F32) ||
        !vector_of(top_k, rows, XLA_FFI_DataType_S32) || draws->dtype != XLA_FFI_DataType_U32 || draws->rank != 2 ||
        draws->dims[0] != rows || draws->dims[1] != 2 || tokens->dtype != XLA_FFI_DataType_S32 || tokens->rank != 2 ||
        tokens->dims[0] != rows || tokens->dims[1] != 1)
        return ffi_error(api, "moe_jax_sample: f32 [rows] temperature and top_p, s32 [rows] top_k, u32 [rows, 2] draws "
                              "-> s32 [rows, 1] expected");
    const float *x = logits->data, *t = temperature->data, *p = top_p->data;
    const int32_t *k = top_k->data;
    const uint32_t *bits = draws->data;
    int32_t *out = tokens->data;
    sample_buffers buf = {NULL, NULL, NULL};
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * vocab;
        if (t[r] == 0.0f) {
            out[r] = row_argmax(row, vocab, (int)avx512);
            continue;
        }
        if (!buf.p) {
            buf.p = malloc((2 * (size_t)vocab + (size_t)vocab / BLOCK + 1) * sizeof(double));
            if (!buf.p) return ffi_error(api, "moe_jax_sample: out of memory for its probabilities");
            buf.scratch = buf.p + vocab;
            buf.blocks = buf.scratch + vocab;
        }
        double u;
        const uint64_t word = (uint64_t)bits[2 * r] | (uint64_t)bits[2 * r + 1] << 32; /* little-endian, as numpy's */
        memcpy(&u, &word, sizeof u);
        out[r] = sample_row(row, vocab, (double)t[r], (double)p[r], (int64_t)k[r], u, (int)avx512, &buf);
        if (out[r] < 0) {
            free(buf.p);
            return ffi_error(api, "a row of logits to sample from holds NaN or inf: the model is broken");
        }
    }
    free(buf.p);
    return NULL;
}
