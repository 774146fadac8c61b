/* The fused forward of one MoE layer's routed experts on the host, for inference: routing, the gather of each expert's
 * rows, the gate/up GEMM, SwiGLU, the down GEMM, the routing weights and the combine, in one call without Python. The
 * numpy engine (host_kernels/host_moe.py) makes ~10 Python and ctypes calls per expert and wakes its pool twice per
 * layer; at decode sizes that cost more than reading the weights. GEMMs: AMX for bfloat16 weights (amx_gemm.c; the
 * arithmetic is the engine's AMX path step for step, so both give the same bits) or, on CPUs without AMX, AVX512-BF16
 * over the same packed weights (bf16_gemm.c); AVX-512 FMA for float32 ones (f32_gemm.c); int8 weights with a scale per
 * column (bf16_gemm.c's int8_gemm, widened to bfloat16 in registers) or int4 ones with a scale per group of k-rows
 * (int4_gemm.c on AVX512-VNNI, whose int8 activation rows are made once: the inputs as they are gathered, the SwiGLU
 * outputs by the tile that computes them, as AVX2's int8 kernel's are), quantized from either.
 *
 * Work is cut into tiles (one expert x a block of output columns) that the runner's threads take from one atomic
 * counter, largest experts first: a skewed routing spreads over every thread, and a decode step whose two experts
 * would keep two threads busy unevenly is split by columns instead. Phases (gather, gate/up + SwiGLU, down,
 * combine) are separated by the runner's barrier.
 *
 * On CPUs without AVX-512 the same GEMMs and SwiGLU run on AVX2 + FMA (avx2_*.c) over the same packed weights.
 *
 * The parts of a call that the fused backward (moe_backward.c) runs too (the routing and buffers, the gather, the
 * tiles, one expert's GEMM, the combine) are defined here and declared in moe_call.h.
 *
 * The threads and their meeting points are runner.c's. This file is compiled for no instruction set beyond the
 * baseline: the kernels it calls are each compiled for theirs (host_kernels/fused_forward.py checks the CPU before
 * a layer is made), and its own few loops over rows (gather conversions, routing weights, the combine) are cloned
 * per instruction set and picked when the library loads.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "amx_gemm.h"
#include "avx2_kernels.h"
#include "bf16_gemm.h"
#include "f32_gemm.h"
#include "int4_gemm.h"
#include "moe_call.h"
#include "moe_forward.h"
#include "runner.h"

void swiglu_forward(const float *hg, int64_t ld_g, const float *hu, int64_t ld_u, void *act, int64_t ld_a, int bf16,
                    int64_t m, int64_t n);
void clamped_swiglu_forward(const float *hg, int64_t ld_g, const float *hu, int64_t ld_u, void *act, int64_t ld_a,
                            int bf16, int64_t m, int64_t n, float alpha, float limit);

#define TOKEN_BLOCK 64     /* tokens per combine task */
#define GATHER_BLOCK 256   /* rows per gather task */
#define SUM_BLOCK 512      /* columns of one combine step (a stack buffer) */

/* ------------------------------------------------------------------------------- loops over rows, per ISA */

/* the row loops below are compiled for each of these and the CPU's best is picked at load (GCC's ifunc) */
#define ROW_LOOP __attribute__((target_clones("avx512f", "avx2", "default")))

static inline uint16_t round_bf16(float v) { /* to nearest even, as every kernel rounds */
    uint32_t bits;
    memcpy(&bits, &v, 4);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

static inline float widen_bf16(uint16_t v) {
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

ROW_LOOP static void bf16_to_f32(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t j = 0; j < n; j++) dst[j] = widen_bf16(src[j]);
}

ROW_LOOP static void f32_to_bf16(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t j = 0; j < n; j++) dst[j] = round_bf16(src[j]);
}

ROW_LOOP static void scale_row(float *row, float w, int64_t n) {
    for (int64_t j = 0; j < n; j++) row[j] *= w;
}

ROW_LOOP static void add_row(float *sum, const float *row, int64_t n) {
    for (int64_t j = 0; j < n; j++) sum[j] += row[j];
}

/* ------------------------------------------------------------------------------------------------ one layer */

void moe_layer_free(moe_layer *l) {
    if (!l) return;
    free(l->w13), free(l->w2), free(l);
}

/* w13, w2: addresses of each expert's packed weights for `kernel` (a kernel table code; bfloat16: amx.pack's
 * layout; float32: f32_gemm.c's; int8: bf16_gemm.h's; int4 and MXFP4: int4_gemm.h's; the AVX2 kernels read the
 * AVX-512 ones' layouts). group: int4's k-rows per scale. NULL for a code the table does not know. */
moe_layer *moe_layer_new(int kernel, int64_t experts, int64_t hidden, int64_t ffn, const uint64_t *w13,
                         const uint64_t *w2, int64_t *routed, int64_t group) {
    const moe_kernel *k = moe_kernel_get(kernel);
    if (!k) return NULL;
    moe_layer *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    l->experts = experts, l->hidden = hidden, l->ffn = ffn;
    l->f32 = k->format == MOE_FORMAT_F32;
    l->kernel = kernel, l->k = k;
    l->avx2 = k->isa == MOE_ISA_AVX2;
    l->records = k->quantize != NULL;
    l->group = group;
    l->weight_bits = k->bits;
    l->row_bytes = l->f32 ? 4 : 2;
    l->kp_hidden = l->f32 ? hidden : padded(hidden, 32), l->kp_ffn = l->f32 ? ffn : padded(ffn, 32);
    l->ffn_padded = padded(ffn, l->f32 ? 32 : 16);
    l->w13 = malloc(experts * sizeof *l->w13);
    l->w2 = malloc(experts * sizeof *l->w2);
    if (!l->w13 || !l->w2) {
        moe_layer_free(l);
        return NULL;
    }
    for (int64_t e = 0; e < experts; e++) l->w13[e] = (const void *)w13[e], l->w2[e] = (const void *)w2[e];
    l->routed = routed;
    return l;
}

/* The layer's gated activation (MOE_GLU_*) and its experts' gate/up biases (NULL: none; else [experts, 2 * ffn]
 * float32, gate then up, alive as long as the layer). Returns non-zero for an unknown kind. */
int moe_layer_set_glu(moe_layer *l, int glu, float alpha, float limit, const float *b13) {
    if (glu != MOE_GLU_SWIGLU && glu != MOE_GLU_CLAMPED_SWIGLU) return 1;
    l->glu = glu, l->glu_alpha = alpha, l->glu_limit = limit, l->b13 = b13;
    return 0;
}

/* ------------------------------------------------------------------------------------------------ one call */

/* Bytes of one quantized row record of kp values, for a layer whose GEMMs read records */
static int64_t record_bytes(const moe_layer *l, int64_t kp) {
    return l->k->record_bytes(kp);
}

int64_t moe_gather_tasks(const call_state *s) { return (s->pairs + GATHER_BLOCK - 1) / GATHER_BLOCK; }

int64_t moe_combine_tasks(const call_state *s) { return (s->tokens + TOKEN_BLOCK - 1) / TOKEN_BLOCK; }

void moe_gather_task(void *state, int worker, int64_t task) {
    call_state *s = state;
    (void)worker;
    const moe_layer *l = s->layer;
    const int64_t d = l->hidden, kp = l->kp_hidden, size = l->row_bytes;
    const int64_t first = task * GATHER_BLOCK, last = first + GATHER_BLOCK < s->pairs ? first + GATHER_BLOCK : s->pairs;
    for (int64_t i = first; i < last; i++) {
        char *dst = s->rows + i * kp * size;
        const int64_t t = s->token_of[i];
        const char *src = (const char *)s->x + t * d * (s->x_bf16 ? 2 : 4);
        if (s->x_bf16 == !l->f32)
            memcpy(dst, src, d * size);
        else if (s->x_bf16) /* bfloat16 inputs widened for float32 weights */
            bf16_to_f32((const uint16_t *)src, (float *)dst, d);
        else /* float32 inputs rounded for bfloat16 weights */
            f32_to_bf16((const float *)src, (uint16_t *)dst, d);
        /* k padding (bfloat16 rows) meets the weights' zero padding: it must not be NaN */
        memset(dst + d * size, 0, (kp - d) * size);
        char *act_row = s->act + i * s->act_kp * size;
        memset(act_row + s->act_width * size, 0, (s->act_kp - s->act_width) * size);
        if (l->records) l->k->quantize((const uint16_t *)dst, kp, 1, 0, kp, s->rows_q + i * record_bytes(l, kp), kp);
    }
}

/* Columns [n0, n1) of the rows at `a` (m of them, the layer's row type and stride; or their quantized records)
 * times packed weight w. */
void moe_expert_gemm(const moe_layer *l, const char *a, int64_t kp, const void *w, float *c, int64_t ldc, int64_t m,
                        int64_t n0, int64_t n1) {
    l->k->gemm(a, kp, w, l->group, c, ldc, m, n0, n1);
}

/* Where the GEMMs read row r0 of the gathered inputs or SwiGLU outputs (row stride kp): those rows, or (a layer
 * that reads records) their quantized records. */
static const char *gemm_rows(const moe_layer *l, const char *rows, const char *rows_q, int64_t kp, int64_t r0) {
    return l->records ? rows_q + r0 * record_bytes(l, kp) : rows + r0 * kp * l->row_bytes;
}

static void gate_up_task(void *state, int worker, int64_t task) {
    call_state *s = state;
    const moe_layer *l = s->layer;
    const tile t = s->tiles[task];
    const int64_t r0 = s->offsets[t.expert], m = s->offsets[t.expert + 1] - r0, width = t.c1 - t.c0;
    float *hg = s->runner->scratch[worker].data, *hu = hg + m * COLUMN_BLOCK;
    const char *a = gemm_rows(l, s->rows, s->rows_q, l->kp_hidden, r0);
    const void *w13 = l->w13[t.expert];
    int64_t c = t.c0;
    if (l->kernel == MOE_KERNEL_BF16_AMX && m <= 16) /* decode: gate and up columns side by side, four weight streams */
        for (; c + 32 <= t.c1; c += 32) {
            const int64_t kp = l->kp_hidden, gate = c / 16, up = (l->ffn_padded + c) / 16;
            const uint16_t *b[4] = {amx_block(w13, kp, gate), amx_block(w13, kp, gate + 1), amx_block(w13, kp, up),
                                    amx_block(w13, kp, up + 1)};
            float *out[4] = {hg + (c - t.c0), hg + (c - t.c0) + 16, hu + (c - t.c0), hu + (c - t.c0) + 16};
            amx_gemm_4_streams((const uint16_t *)a, kp, kp, b, out, COLUMN_BLOCK, m);
        }
    if (c < t.c1) {
        moe_expert_gemm(l, a, l->kp_hidden, w13, hg + (c - t.c0), COLUMN_BLOCK, m, c, t.c1);
        moe_expert_gemm(l, a, l->kp_hidden, w13, hu + (c - t.c0), COLUMN_BLOCK, m, l->ffn_padded + c,
                    l->ffn_padded + t.c1);
    }
    if (l->b13) { /* the expert's gate and up biases of these columns */
        const float *bias = l->b13 + t.expert * 2 * l->ffn;
        for (int64_t i = 0; i < m; i++) {
            add_row(hg + i * COLUMN_BLOCK, bias + t.c0, width);
            add_row(hu + i * COLUMN_BLOCK, bias + l->ffn + t.c0, width);
        }
    }
    if (s->keep) /* the pre-activations as computed, gate then up, in the sorted rows (the engine's backward reads them) */
        for (int64_t i = 0; i < m; i++) {
            float *kept = s->keep + (r0 + i) * 2 * l->ffn;
            memcpy(kept + t.c0, hg + i * COLUMN_BLOCK, width * 4);
            memcpy(kept + l->ffn + t.c0, hu + i * COLUMN_BLOCK, width * 4);
        }
    char *act = s->act + r0 * s->act_kp * l->row_bytes;
    char *act_tile = act + t.c0 * l->row_bytes;
    if (l->glu == MOE_GLU_CLAMPED_SWIGLU)
        (l->avx2 ? clamped_swiglu_forward_avx2 : clamped_swiglu_forward)(
            hg, COLUMN_BLOCK, hu, COLUMN_BLOCK, act_tile, l->kp_ffn, !l->f32, m, width, l->glu_alpha, l->glu_limit);
    else
        (l->avx2 ? swiglu_forward_avx2 : swiglu_forward)(hg, COLUMN_BLOCK, hu, COLUMN_BLOCK, act_tile, l->kp_ffn,
                                                          !l->f32, m, width);
    if (l->records) { /* this tile's 32-column chunks (the last one's padding was zeroed by the gather) */
        const int64_t end = padded(t.c1, 32) < l->kp_ffn ? padded(t.c1, 32) : l->kp_ffn;
        l->k->quantize((const uint16_t *)act, l->kp_ffn, m, t.c0, end, s->act_q + r0 * record_bytes(l, l->kp_ffn),
                       l->kp_ffn);
    }
}

static void down_task(void *state, int worker, int64_t task) {
    call_state *s = state;
    (void)worker;
    const moe_layer *l = s->layer;
    const tile t = s->tiles[task];
    const int64_t r0 = s->offsets[t.expert], m = s->offsets[t.expert + 1] - r0, d = l->hidden;
    float *out = s->out + r0 * d + t.c0;
    const char *a = gemm_rows(l, s->act, s->act_q, l->kp_ffn, r0);
    int64_t c = t.c0;
    const void *w2 = l->w2[t.expert];
    const int64_t kp = l->kp_ffn;
    if (l->kernel == MOE_KERNEL_BF16_AMX && m <= 16) /* decode: four 16-column blocks side by side, four weight streams */
        for (; c + 64 <= t.c1; c += 64) {
            const uint16_t *b[4] = {amx_block(w2, kp, c / 16), amx_block(w2, kp, c / 16 + 1),
                                    amx_block(w2, kp, c / 16 + 2), amx_block(w2, kp, c / 16 + 3)};
            float *o = out + (c - t.c0);
            float *outs[4] = {o, o + 16, o + 32, o + 48};
            amx_gemm_4_streams((const uint16_t *)a, kp, kp, b, outs, d, m);
        }
    if (c < t.c1) moe_expert_gemm(l, a, kp, w2, out + (c - t.c0), d, m, c, t.c1);
    for (int64_t i = 0; i < m; i++) scale_row(out + i * d, s->weight_sorted[r0 + i], t.c1 - t.c0);
}

/* y[t] = sum over t's pairs, in slot order, of the weighted expert rows (the engine's combine, same order) */
void moe_combine_task(void *state, int worker, int64_t task) {
    call_state *s = state;
    (void)worker;
    const int64_t d = s->layer->hidden;
    const int64_t first = task * TOKEN_BLOCK, last = first + TOKEN_BLOCK < s->tokens ? first + TOKEN_BLOCK : s->tokens;
    float sum[SUM_BLOCK];
    for (int64_t t = first; t < last; t++) {
        const int64_t *pos = s->position + t * s->top_k;
        char *y = (char *)s->y + t * d * (s->x_bf16 ? 2 : 4);
        for (int64_t j = 0; j < d; j += SUM_BLOCK) {
            const int64_t n = d - j < SUM_BLOCK ? d - j : SUM_BLOCK;
            float *to = s->x_bf16 ? sum : (float *)y + j; /* float32 outputs are summed in place */
            memcpy(to, s->out + pos[0] * d + j, n * 4);
            for (int64_t slot = 1; slot < s->top_k; slot++) add_row(to, s->out + pos[slot] * d + j, n);
            if (s->x_bf16) f32_to_bf16(sum, (uint16_t *)y + j, n);
        }
    }
}

/* Tiles of one phase: every routed expert's rows x column blocks of `width`, the experts with most rows first. */
void moe_plan_tiles(call_state *s, int64_t width) {
    int64_t n = 0;
    for (int64_t i = 0; i < s->layer->experts; i++) {
        const int32_t e = s->by_size[i];
        if (!s->sizes[e]) break;
        for (int64_t c = 0; c < width; c += COLUMN_BLOCK)
            s->tiles[n++] = (tile){e, (int32_t)c, (int32_t)(c + COLUMN_BLOCK < width ? c + COLUMN_BLOCK : width)};
    }
    s->tile_count = n;
}

static float load_weight(const void *weights, int bf16, int64_t i) {
    if (!bf16) return ((const float *)weights)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)weights)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

int moe_fail(char *err, int64_t err_len, const char *message, long long a, long long b) {
    if (err && err_len > 0) snprintf(err, (size_t)err_len, message, a, b);
    return 1;
}

int moe_open_call(moe_runner *r, const moe_layer *l, call_state *s, const int32_t *ids, const void *weights,
                  int w_dtype, int64_t tokens, int64_t hidden, int64_t top_k, int64_t act_width, int64_t act_kp,
                  int64_t scratch, char *err, int64_t err_len) {
    const int64_t experts = l->experts, d = l->hidden;
    if (hidden != d) return moe_fail(err, err_len, "inputs have %lld columns, the layer's experts take %lld", hidden, d);
    int64_t pairs = 0; /* routed here: NOT_ROUTED pairs are computed elsewhere (hybrid placements) and add nothing */
    for (int64_t p = 0; p < tokens * top_k; p++) {
        if (ids[p] < NOT_ROUTED || ids[p] >= experts)
            return moe_fail(err, err_len, "expert id %lld out of range (the layer has %lld experts)", ids[p], experts);
        pairs += ids[p] != NOT_ROUTED;
    }
    /* index arrays: offsets, sizes, fill, order by size, token_of, position, weight_sorted, tiles */
    const int64_t tile_cap = experts * (padded(l->ffn > d ? l->ffn : d, COLUMN_BLOCK) / COLUMN_BLOCK);
    const size_t index_bytes =
        (3 * (experts + 1) + pairs + tokens * top_k) * 8 + experts * 4 + pairs * 4 + tile_cap * sizeof(tile);
    char *index = runner_reserve(&r->index, index_bytes);
    char *rows = runner_reserve(&r->rows, (size_t)(pairs + 16) * l->kp_hidden * l->row_bytes);
    char *act = runner_reserve(&r->act, (size_t)(pairs + 16) * act_kp * l->row_bytes);
    float *out = runner_reserve(&r->out, (size_t)(pairs + 1) * d * 4); /* + a zero row, where NOT_ROUTED pairs point */
    char *rows_q = l->records ? runner_reserve(&r->rows_q, (size_t)(pairs + 16) * record_bytes(l, l->kp_hidden)) : NULL;
    char *act_q = l->records ? runner_reserve(&r->act_q, (size_t)(pairs + 16) * record_bytes(l, l->kp_ffn)) : NULL;
    if (!index || !rows || !act || !out || (l->records && (!rows_q || !act_q)))
        return moe_fail(err, err_len, "out of memory for %lld pairs (%lld)", pairs, 0);
    int64_t *offsets = (int64_t *)index, *sizes = offsets + experts + 1, *fill = sizes + experts + 1;
    int64_t *token_of = fill + experts + 1, *position = token_of + pairs;
    int32_t *by_size = (int32_t *)(position + tokens * top_k);
    float *weight_sorted = (float *)(by_size + experts);
    tile *tiles = (tile *)(weight_sorted + pairs);
    int64_t largest = 0;

    /* stable counting sort of the pairs by expert (np.argsort(kind="stable") order) */
    memset(sizes, 0, experts * 8);
    for (int64_t p = 0; p < tokens * top_k; p++)
        if (ids[p] != NOT_ROUTED) sizes[ids[p]]++;
    offsets[0] = 0;
    for (int64_t e = 0; e < experts; e++) {
        offsets[e + 1] = offsets[e] + sizes[e], fill[e] = offsets[e];
        largest = sizes[e] > largest ? sizes[e] : largest;
        by_size[e] = (int32_t)e;
    }
    for (int64_t p = 0; p < tokens * top_k; p++) {
        if (ids[p] == NOT_ROUTED) {
            position[p] = pairs;
            continue;
        }
        const int64_t at = fill[ids[p]]++;
        position[p] = at, token_of[at] = p / top_k, weight_sorted[at] = load_weight(weights, w_dtype, p);
    }
    memset(out + pairs * d, 0, d * 4);
    for (int64_t i = 1; i < experts; i++) /* insertion sort by size, descending (few experts) */
        for (int64_t j = i; j > 0 && sizes[by_size[j]] > sizes[by_size[j - 1]]; j--) {
            const int32_t swap = by_size[j];
            by_size[j] = by_size[j - 1], by_size[j - 1] = swap;
        }
    for (int i = 0; i < r->threads; i++)
        if (!runner_reserve(&r->scratch[i], (size_t)largest * scratch * 4))
            return moe_fail(err, err_len, "out of memory for %lld rows of one expert (%lld)", largest, 0);
    *s = (call_state){.runner = r, .layer = l, .tokens = tokens, .top_k = top_k, .pairs = pairs, .offsets = offsets,
                      .token_of = token_of, .position = position, .weight_sorted = weight_sorted, .rows = rows,
                      .act = act, .act_width = act_width, .act_kp = act_kp, .rows_q = rows_q, .act_q = act_q,
                      .out = out, .tiles = tiles, .sizes = sizes, .by_size = by_size};
    return 0;
}

void moe_count_call(moe_runner *r, const moe_layer *l, const call_state *s, int64_t bytes_in, int64_t bytes_out,
                    int forward) {
    int64_t active = 0;
    for (int64_t e = 0; e < l->experts; e++) {
        active += s->sizes[e] > 0;
        if (l->routed && forward) l->routed[e] += s->sizes[e];
    }
    if (forward) r->totals[TOKENS] += s->tokens, r->totals[PAIRS] += s->pairs;
    r->totals[FLOPS] += 2 * s->pairs * 3 * l->hidden * l->ffn;
    r->totals[WEIGHT_BYTES] += active * 3 * l->hidden * l->ffn * l->weight_bits / 8;
    r->totals[BYTES_IN] += bytes_in;
    r->totals[BYTES_OUT] += bytes_out;
}

static int forward_locked(moe_runner *r, const moe_layer *l, const void *x, int x_dtype, const int32_t *ids,
                          const void *weights, int w_dtype, int64_t tokens, int64_t hidden, int64_t top_k, void *y,
                          float *keep, const moe_helpers *helpers, char *err, int64_t err_len) {
    if (tokens <= 0 && hidden == l->hidden) return 0;
    call_state s;
    if (moe_open_call(r, l, &s, ids, weights, w_dtype, tokens, hidden, top_k, l->ffn, l->kp_ffn, 2 * COLUMN_BLOCK,
                      err, err_len))
        return 1;
    s.x = x, s.x_bf16 = x_dtype == MOE_BFLOAT16, s.keep = keep, s.y = y;
    runner_open_call(r, helpers);
    runner_run_phase(r, moe_gather_task, &s, moe_gather_tasks(&s));
    moe_plan_tiles(&s, l->ffn);
    runner_run_phase(r, gate_up_task, &s, s.tile_count);
    moe_plan_tiles(&s, l->hidden);
    runner_run_phase(r, down_task, &s, s.tile_count);
    runner_run_phase(r, moe_combine_task, &s, moe_combine_tasks(&s));
    runner_close_call(r);
    const int64_t x_size = x_dtype == MOE_BFLOAT16 ? 2 : 4, w_size = w_dtype == MOE_BFLOAT16 ? 2 : 4;
    moe_count_call(r, l, &s, tokens * l->hidden * x_size + tokens * top_k * (4 + w_size), tokens * l->hidden * x_size,
                   1);
    return 0;
}

static int forward_timed(moe_runner *r, const moe_layer *l, const void *x, int x_dtype, const int32_t *ids,
                         const void *weights, int w_dtype, int64_t tokens, int64_t hidden, int64_t top_k, void *y,
                         float *keep, const moe_helpers *helpers, char *err, int64_t err_len) {
    const uint64_t start = runner_now_ns();
    pthread_mutex_lock(&r->one_call);
    const int status = forward_locked(r, l, x, x_dtype, ids, weights, w_dtype, tokens, hidden, top_k, y, keep, helpers,
                                      err, err_len);
    const uint64_t elapsed = runner_now_ns() - start;
    r->totals[CALLS]++;
    r->totals[NANOSECONDS] += elapsed;
    if (helpers) r->totals[SCHEDULED_NANOSECONDS] += elapsed;
    pthread_mutex_unlock(&r->one_call);
    return status;
}

int moe_forward(void *runner, const void *layer, const void *x, int x_dtype, const int32_t *ids,
                const void *weights, int w_dtype, int64_t tokens, int64_t hidden, int64_t top_k, void *y,
                const moe_helpers *helpers, char *err, int64_t err_len) {
    return forward_timed(runner, layer, x, x_dtype, ids, weights, w_dtype, tokens, hidden, top_k, y, NULL, helpers,
                         err, err_len);
}

/* moe_forward that also writes the gate/up pre-activations into keep: float32 [routed pairs, 2 * ffn] in
 * expert-sorted order (stable by expert, NOT_ROUTED pairs left out: host_kernels/schedule.py's Routing), gate
 * columns then up, for a training step's backward to read instead of recomputing x @ W13. On the runner's own
 * threads. */
int moe_forward_keeping(void *runner, const void *layer, const void *x, int x_dtype, const int32_t *ids,
                        const void *weights, int w_dtype, int64_t tokens, int64_t hidden, int64_t top_k, void *y,
                        float *keep, char *err, int64_t err_len) {
    return forward_timed(runner, layer, x, x_dtype, ids, weights, w_dtype, tokens, hidden, top_k, y, keep, NULL, err,
                         err_len);
}

/* The moe_call an FFI handler calls through (moe_forward.h) */
void moe_call_init(moe_call *call, moe_runner *runner, const moe_layer *layer) {
    call->forward = moe_forward, call->runner = runner, call->layer = layer;
}
