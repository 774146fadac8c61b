/* One (row, kv head) of a decode step's attention, written once for any vector width and for either cache type:
 * xla_decode_attention.c includes this once per (instruction set, element type), after defining ISA (the name
 * prefix of that set's vector operations, and of the function defined here), V (its float32 vector type), W (its
 * lanes), and ELEM (bf16 or f32: the type of q, the cache and the output; ELEM_T its C type, ELEM_IS_BF16 1 or 0),
 * inside a `#pragma GCC target` for that set (decode_attention_heads.h includes it for both types). The operations
 * (ISA_zero, ISA_set1, ISA_load, ISA_store, ISA_add, ISA_sub, ISA_mul, ISA_max, ISA_fmadd, ISA_load_n, ISA_store_n,
 * ISA_keep, ISA_hmax, ISA_hsum, ISA_load_bf16, ISA_load_f32, ISA_exp_nonpositive, ISA_round_to_bf16,
 * ISA_sum_lanes) are that file's; `_n` ones take how many of the W lanes
 * are real (<= 0: none, >= W: all), and ISA_load_n fills the others with its last argument.
 *
 * A bf16 cache's probabilities are rounded to bf16 before p.v, as XLA's path feeds them to its product in the
 * model's dtype; a float32 cache's are not.
 *
 * The group's `g` queries against keys [first, last]. Work space (float32): qf g * dp, block 16 * dp, scores
 * g * stride, out_f g * dp, with dp = d rounded up to 16 (zero padding) and stride a multiple of 16. */
#define OP_JOIN(isa, name) isa##_##name
#define OP_EXPAND(isa, name) OP_JOIN(isa, name)
#define OP(name) OP_EXPAND(ISA, name)
#define ELEM_JOIN(name, elem) name##_##elem
#define ELEM_EXPAND(name, elem) ELEM_JOIN(name, elem)
#define LOAD_ELEM ELEM_EXPAND(OP(load), ELEM) /* ISA_load_bf16 or ISA_load_f32: W values, those past `count` 0 */

static void ELEM_EXPAND(OP(attend_head), ELEM)(const void *q_in, const void *k_in, const void *v_in, void *out_in,
                                                int64_t g, int64_t d, int64_t first, int64_t last, float *work,
                                                int64_t stride) {
    const ELEM_T *q = q_in, *k = k_in, *v = v_in;
    ELEM_T *out = out_in;
    const int64_t dp = (d + 15) / 16 * 16, n = last - first + 1;
    float *qf = work, *block = qf + g * dp, *scores = block + 16 * dp, *out_f = scores + g * stride;
    const V scale = OP(set1)(1.0f / sqrtf((float)d));
    for (int64_t m = 0; m < g; m++)
        for (int64_t i = 0; i < dp; i += W) OP(store)(qf + m * dp + i, LOAD_ELEM(q + m * d + i, d - i));
    /* scores, W keys at a time: the keys in float32 once, then each query's W dot products summed together */
    for (int64_t j0 = 0; j0 < n; j0 += W) {
        const int64_t keys = n - j0 < W ? n - j0 : W;
        for (int64_t jj = 0; jj < W; jj++)
            for (int64_t i = 0; i < dp; i += W)
                OP(store)(block + jj * dp + i, jj < keys ? LOAD_ELEM(k + (first + j0 + jj) * d + i, d - i)
                                                         : OP(zero)());
        for (int64_t m = 0; m < g; m++) {
            V dots[W];
            for (int jj = 0; jj < W; jj++) dots[jj] = OP(zero)();
            for (int64_t i = 0; i < dp; i += W) {
                const V qv = OP(load)(qf + m * dp + i);
                for (int jj = 0; jj < W; jj++) dots[jj] = OP(fmadd)(qv, OP(load)(block + jj * dp + i), dots[jj]);
            }
            OP(store_n)(scores + m * stride + j0, OP(mul)(OP(sum_lanes)(dots), scale), keys);
        }
    }
    /* softmax per query; a bf16 cache's probabilities rounded to bf16 (as XLA's path feeds them to its p.v) */
    for (int64_t m = 0; m < g; m++) {
        float *row = scores + m * stride;
        V top = OP(set1)(-INFINITY), total = OP(zero)();
        for (int64_t j = 0; j < n; j += W) /* lanes past n: the first lane, so never above the maximum */
            top = OP(max)(top, OP(load_n)(row + j, n - j, row[j]));
        const V shift = OP(set1)(OP(hmax)(top));
        for (int64_t j = 0; j < n; j += W) {
            const V e = OP(keep)(OP(exp_nonpositive)(OP(sub)(OP(load_n)(row + j, n - j, 0.0f), shift)), n - j);
            OP(store_n)(row + j, e, n - j);
            total = OP(add)(total, e);
        }
        const V inverse = OP(set1)(1.0f / OP(hsum)(total));
        for (int64_t j = 0; j < n; j += W) {
            const V p = OP(mul)(OP(load_n)(row + j, n - j, 0.0f), inverse);
            OP(store_n)(row + j, ELEM_IS_BF16 ? OP(round_to_bf16)(p) : p, n - j);
        }
    }
    /* p.v: W columns at a time, 4 queries' sums in registers across the keys */
    for (int64_t i = 0; i < dp; i += W) {
        for (int64_t m0 = 0; m0 < g; m0 += 4) {
            V acc[4] = {OP(zero)(), OP(zero)(), OP(zero)(), OP(zero)()};
            const int64_t block_g = g - m0 < 4 ? g - m0 : 4;
            for (int64_t j = 0; j < n; j++) {
                const V vv = LOAD_ELEM(v + (first + j) * d + i, d - i);
                for (int mm = 0; mm < 4; mm++)
                    if (mm < block_g) acc[mm] = OP(fmadd)(OP(set1)(scores[(m0 + mm) * stride + j]), vv, acc[mm]);
            }
            for (int mm = 0; mm < block_g; mm++) OP(store)(out_f + (m0 + mm) * dp + i, acc[mm]);
        }
    }
    for (int64_t m = 0; m < g; m++)
        for (int64_t i = 0; i < d; i++) {
            const float x = out_f[m * dp + i];
            out[m * d + i] = ELEM_IS_BF16 ? f32_to_bf16(x) : x;
        }
}

#undef LOAD_ELEM
#undef ELEM_EXPAND
#undef ELEM_JOIN
#undef OP
#undef OP_EXPAND
#undef OP_JOIN
