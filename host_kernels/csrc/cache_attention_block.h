/* A block of one (row, kv head)'s new tokens attending to the KV cache, written once for any vector width and for
 * either cache type: xla_cache_attention.c includes this once per (instruction set, element type), after defining
 * ISA (the name prefix of that set's vector operations, and of the function defined here), V (its float32 vector
 * type), W (its lanes), and ELEM (bf16 or f32: the type of q, the cache and the output; ELEM_T its C type,
 * ELEM_IS_BF16 1 or 0), inside a `#pragma GCC target` for that set (cache_attention_blocks.h includes it for both
 * types). The operations (ISA_zero, ISA_set1, ISA_load, ISA_store, ISA_add, ISA_sub, ISA_mul, ISA_max, ISA_fmadd,
 * ISA_load_n, ISA_store_n, ISA_keep, ISA_hmax, ISA_hsum, ISA_load_bf16, ISA_load_f32, ISA_exp_nonpositive,
 * ISA_round_to_bf16, ISA_sum_lanes) are that file's; `_n` ones take how many of the W lanes are real (<= 0: none,
 * >= W: all), and ISA_load_n fills the others with its last argument.
 *
 * `tokens` new tokens, each with the group's `g` queries (q [tokens][g][d], the m-th query row is q + m * d);
 * token j sees the cache's keys [firsts[j], lasts[j]]. Every query is scored against the block's keys [first, last]
 * (the union of the ranges: a causal block's later tokens see a few keys more than its first), its softmax taken over
 * its own range and its probabilities outside it set to 0, so one pass over the keys serves the whole block.
 * A bf16 cache's probabilities are rounded to bf16 before p.v, as XLA's path feeds them to its product in the
 * model's dtype; a float32 cache's are not.
 *
 * Work space (float32, block_work_floats): qf rows4 * dp, keys W * dp, values VALUE_CHUNK * dp, scores
 * rows4 * stride, out_f rows4 * dp, with rows4 the query rows rounded up to 4 (the padding rows' scores 0), dp = d
 * rounded up to DP_ALIGN (zero padding) and stride >= last - first + 1. */
#define OP_JOIN(isa, name) isa##_##name
#define OP_EXPAND(isa, name) OP_JOIN(isa, name)
#define OP(name) OP_EXPAND(ISA, name)
#define ELEM_JOIN(name, elem) name##_##elem
#define ELEM_EXPAND(name, elem) ELEM_JOIN(name, elem)
#define LOAD_ELEM ELEM_EXPAND(OP(load), ELEM) /* ISA_load_bf16 or ISA_load_f32: W values, those past `count` 0 */
#define WIDEN_ROWS ELEM_EXPAND(OP(widen_rows), ELEM)

/* rows x dp float32 values of `src` (rows of d elements) into `dst`, the columns past d zero */
static void WIDEN_ROWS(const ELEM_T *src, int64_t rows, int64_t d, int64_t dp, float *dst) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < dp; i += W) OP(store)(dst + r * dp + i, LOAD_ELEM(src + r * d + i, d - i));
}

static void ELEM_EXPAND(OP(attend_block), ELEM)(const void *q_in, const void *k_in, const void *v_in, void *out_in,
                                                 int64_t tokens, int64_t g, int64_t d, const int64_t *firsts,
                                                 const int64_t *lasts, float *work, int64_t stride) {
    const ELEM_T *q = q_in, *k = k_in, *v = v_in;
    ELEM_T *out = out_in;
    const int64_t rows = tokens * g, rows4 = (rows + 3) / 4 * 4, dp = (d + DP_ALIGN - 1) / DP_ALIGN * DP_ALIGN;
    int64_t first = firsts[0], last = lasts[0];
    for (int64_t j = 1; j < tokens; j++) {
        first = firsts[j] < first ? firsts[j] : first;
        last = lasts[j] > last ? lasts[j] : last;
    }
    const int64_t n = last - first + 1;
    float *qf = work, *keys = qf + rows4 * dp, *values = keys + W * dp, *scores = values + VALUE_CHUNK * dp;
    float *out_f = scores + rows4 * stride;
    const V scale = OP(set1)(1.0f / sqrtf((float)d));
    WIDEN_ROWS(q, rows, d, dp, qf);
    /* scores, W keys at a time: the keys in float32 once, then each query's W dot products summed together */
    for (int64_t j0 = 0; j0 < n; j0 += W) {
        const int64_t count = n - j0 < W ? n - j0 : W;
        WIDEN_ROWS(k + (first + j0) * d, count, d, dp, keys);
        for (int64_t jj = count; jj < W; jj++)
            for (int64_t i = 0; i < dp; i += W) OP(store)(keys + jj * dp + i, OP(zero)());
        for (int64_t m = 0; m < rows; m++) {
            V dots[W];
            for (int jj = 0; jj < W; jj++) dots[jj] = OP(zero)();
            for (int64_t i = 0; i < dp; i += W) {
                const V qv = OP(load)(qf + m * dp + i);
                for (int jj = 0; jj < W; jj++) dots[jj] = OP(fmadd)(qv, OP(load)(keys + jj * dp + i), dots[jj]);
            }
            OP(store_n)(scores + m * stride + j0, OP(mul)(OP(sum_lanes)(dots), scale), count);
        }
    }
    /* softmax per query over its token's keys [lo, hi] (relative to first); 0 elsewhere and in the padding rows */
    for (int64_t m = 0; m < rows4; m++) {
        float *row = scores + m * stride;
        if (m >= rows) {
            memset(row, 0, (size_t)n * sizeof(float));
            continue;
        }
        const int64_t lo = firsts[m / g] - first, hi = lasts[m / g] - first, count = hi - lo + 1;
        float *seen = row + lo;
        memset(row, 0, (size_t)lo * sizeof(float));
        memset(row + hi + 1, 0, (size_t)(n - hi - 1) * sizeof(float));
        V top = OP(set1)(-INFINITY), total = OP(zero)();
        for (int64_t j = 0; j < count; j += W) /* lanes past count: the first lane, so never above the maximum */
            top = OP(max)(top, OP(load_n)(seen + j, count - j, seen[j]));
        const V shift = OP(set1)(OP(hmax)(top));
        for (int64_t j = 0; j < count; j += W) {
            const V e = OP(keep)(OP(exp_nonpositive)(OP(sub)(OP(load_n)(seen + j, count - j, 0.0f), shift)), count - j);
            OP(store_n)(seen + j, e, count - j);
            total = OP(add)(total, e);
        }
        const V inverse = OP(set1)(1.0f / OP(hsum)(total));
        for (int64_t j = 0; j < count; j += W) {
            const V p = OP(mul)(OP(load_n)(seen + j, count - j, 0.0f), inverse);
            OP(store_n)(seen + j, ELEM_IS_BF16 ? OP(round_to_bf16)(p) : p, count - j);
        }
    }
    /* p.v: VALUE_CHUNK values in float32 at a time; 4 queries by 2 vectors of columns summed in registers */
    for (int64_t j0 = 0; j0 < n; j0 += VALUE_CHUNK) {
        const int64_t count = n - j0 < VALUE_CHUNK ? n - j0 : VALUE_CHUNK;
        WIDEN_ROWS(v + (first + j0) * d, count, d, dp, values);
        for (int64_t m0 = 0; m0 < rows4; m0 += 4)
            for (int64_t i = 0; i < dp; i += 2 * W) {
                V acc[4][2];
                for (int mm = 0; mm < 4; mm++)
                    for (int h = 0; h < 2; h++)
                        acc[mm][h] = j0 ? OP(load)(out_f + (m0 + mm) * dp + i + h * W) : OP(zero)();
                const float *p = scores + m0 * stride + j0;
                for (int64_t jj = 0; jj < count; jj++) {
                    const V v0 = OP(load)(values + jj * dp + i), v1 = OP(load)(values + jj * dp + i + W);
                    for (int mm = 0; mm < 4; mm++) {
                        const V pm = OP(set1)(p[mm * stride + jj]);
                        acc[mm][0] = OP(fmadd)(pm, v0, acc[mm][0]);
                        acc[mm][1] = OP(fmadd)(pm, v1, acc[mm][1]);
                    }
                }
                for (int mm = 0; mm < 4; mm++)
                    for (int h = 0; h < 2; h++) OP(store)(out_f + (m0 + mm) * dp + i + h * W, acc[mm][h]);
            }
    }
    for (int64_t m = 0; m < rows; m++)
        for (int64_t i = 0; i < d; i++) {
            const float x = out_f[m * dp + i];
            out[m * d + i] = ELEM_IS_BF16 ? f32_to_bf16(x) : x;
        }
}

#undef WIDEN_ROWS
#undef LOAD_ELEM
#undef ELEM_EXPAND
#undef ELEM_JOIN
#undef OP
#undef OP_EXPAND
#undef OP_JOIN
