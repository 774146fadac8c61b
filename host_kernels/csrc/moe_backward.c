/* The fused backward of one MoE layer's routed experts for a training step, as moe_forward.c runs the forward:
 * routing, gathers, both GEMMs, the SwiGLU backward and the combine in one call on the runner's threads, no Python
 * between them. For bfloat16 weights on AMX, AVX512-BF16 or AVX2 (the kernels of the fused forward that read
 * amx.pack's layout), given the gate/up pre-activations the training forward kept (moe_forward_keeping).
 *
 * For each (token t, slot k) pair routed to expert e with weight w, gradient dy_t at the layer's output:
 *   g = dy_t @ W2_eᵀ                                   phase 1, tiles over ffn columns (W2ᵀ packed: [hidden, ffn])
 *   dh_gate = w g hu silu'(hg), dh_up = w g silu(hg)   the same tile (swiglu.c's backward, from the kept hg, hu)
 *   dw[t, k] = <g, silu(hg) hu>                        the same tile, summed over its column blocks at the end
 *   dx_t += [dh_gate | dh_up] @ W13_eᵀ                 phase 2, tiles over hidden columns (W13ᵀ: [2 ffn, hidden])
 * The engine's backward (host_kernels/host_moe.py) computes the same, tile by tile from Python; it stays for expert
 * LoRA, recomputed pre-activations, float32 and quantized experts.
 *
 * A backward layer is a moe_layer (moe_layer_new) whose w13 are each expert's packed W2ᵀ and whose w2 are its packed
 * W13ᵀ: the weights each phase reads, in the order it reads them.
 */
#include "avx2_kernels.h"
#include "moe_call.h"
#include "moe_forward.h"
#include "runner.h"

void swiglu_backward(const float *hg, int64_t ld_g, const float *hu, int64_t ld_u, const float *grad, int64_t ld_grad,
                     const float *weight, void *dh_gate, void *dh_up, int64_t ld_dh, int bf16, float *dw, int64_t ld_dw,
                     float *act, int64_t ld_a, int64_t m, int64_t n);
void clamped_swiglu_backward(const float *hg, int64_t ld_g, const float *hu, int64_t ld_u, const float *grad,
                             int64_t ld_grad, const float *weight, void *dh_gate, void *dh_up, int64_t ld_dh,
                             int bf16, float *dw, int64_t ld_dw, float *act, int64_t ld_a, int64_t m, int64_t n,
                             float alpha, float limit);

typedef struct {
    call_state call; /* x: dy [tokens, hidden] float32; y: dx, the same; act: [pairs + 16, kp] bfloat16 dh rows */
    const float *kept; /* [pairs, 2 ffn]: gate then up pre-activations, in sorted order */
    float *dw_parts;   /* [pairs, blocks]: each column block's share of dL/dw */
    int64_t blocks;
} backward_state;

/* phase 1: one expert's rows x columns [c0, c1) of ffn: g, then dh (bfloat16, in act) and dw's share */
static void activation_grad_task(void *state, int worker, int64_t task) {
    backward_state *b = state;
    const call_state *s = &b->call;
    const moe_layer *l = s->layer;
    const tile t = s->tiles[task];
    const int64_t r0 = s->offsets[t.expert], m = s->offsets[t.expert + 1] - r0, f = l->ffn;
    float *g = s->runner->scratch[worker].data;
    moe_expert_gemm(l, s->rows + r0 * l->kp_hidden * 2, l->kp_hidden, l->w13[t.expert], g, COLUMN_BLOCK, m, t.c0,
                    t.c1);
    const float *hg = b->kept + r0 * 2 * f + t.c0;
    uint16_t *dh = (uint16_t *)s->act + r0 * s->act_kp + t.c0;
    float *dw = b->dw_parts + r0 * b->blocks + t.c0 / COLUMN_BLOCK;
    const float *weight = s->weight_sorted + r0;
    if (l->glu == MOE_GLU_CLAMPED_SWIGLU) /* (the layer's glu: moe_layer_set_glu, as its forward layer's) */
        (l->avx2 ? clamped_swiglu_backward_avx2 : clamped_swiglu_backward)(
            hg, 2 * f, hg + f, 2 * f, g, COLUMN_BLOCK, weight, dh, dh + f, s->act_kp, 1, dw, b->blocks, NULL, 0, m,
            t.c1 - t.c0, l->glu_alpha, l->glu_limit);
    else
        (l->avx2 ? swiglu_backward_avx2 : swiglu_backward)(hg, 2 * f, hg + f, 2 * f, g, COLUMN_BLOCK, weight, dh, dh + f,
                                                           s->act_kp, 1, dw, b->blocks, NULL, 0, m, t.c1 - t.c0);
}

/* phase 2: one expert's rows x columns [c0, c1) of hidden: dh @ W13ᵀ, per pair (the combine sums a token's) */
static void input_grad_task(void *state, int worker, int64_t task) {
    const call_state *s = &((backward_state *)state)->call;
    (void)worker;
    const moe_layer *l = s->layer;
    const tile t = s->tiles[task];
    const int64_t r0 = s->offsets[t.expert], m = s->offsets[t.expert + 1] - r0, d = l->hidden;
    moe_expert_gemm(l, s->act + r0 * s->act_kp * 2, s->act_kp, l->w2[t.expert], s->out + r0 * d + t.c0, d, m, t.c0,
                    t.c1);
}

static int backward_locked(moe_runner *r, const moe_layer *l, const float *dy, const int32_t *ids,
                           const float *weights, const float *kept, int64_t tokens, int64_t hidden, int64_t top_k,
                           float *dx, float *dweights, char *err, int64_t err_len) {
    if (l->k->format != MOE_FORMAT_BF16)
        return moe_fail(err, err_len, "the fused backward runs bfloat16 kernels only (kernel %lld)", l->kernel, 0);
    if (tokens <= 0 && hidden == l->hidden) return 0;
    backward_state b = {.kept = kept, .blocks = padded(l->ffn, COLUMN_BLOCK) / COLUMN_BLOCK};
    call_state *s = &b.call;
    const int64_t kp_dh = padded(2 * l->ffn, 32); /* W13ᵀ's k: gate and up rows, padded */
    if (moe_open_call(r, l, s, ids, weights, MOE_FLOAT32, tokens, hidden, top_k, 2 * l->ffn, kp_dh, COLUMN_BLOCK, err,
                      err_len))
        return 1;
    b.dw_parts = runner_reserve(&r->dw_parts, (size_t)(s->pairs + 1) * b.blocks * 4);
    if (!b.dw_parts) return moe_fail(err, err_len, "out of memory for %lld pairs (%lld)", s->pairs, 0);
    s->x = dy, s->x_bf16 = 0, s->y = dx;
    runner_open_call(r, NULL);
    runner_run_phase(r, moe_gather_task, s, moe_gather_tasks(s));
    moe_plan_tiles(s, l->ffn);
    runner_run_phase(r, activation_grad_task, &b, s->tile_count);
    moe_plan_tiles(s, l->hidden);
    runner_run_phase(r, input_grad_task, &b, s->tile_count);
    runner_run_phase(r, moe_combine_task, s, moe_combine_tasks(s));
    runner_close_call(r);
    for (int64_t p = 0; p < tokens * top_k; p++) { /* dL/dw of each pair: its column blocks' shares summed */
        const int64_t at = s->position[p];
        float sum = 0.0f;
        for (int64_t j = 0; at < s->pairs && j < b.blocks; j++) sum += b.dw_parts[at * b.blocks + j];
        dweights[p] = sum;
    }
    const int64_t d_bytes = tokens * l->hidden * 4;
    moe_count_call(r, l, s, d_bytes + tokens * top_k * 8 + s->pairs * 2 * l->ffn * 4, d_bytes + tokens * top_k * 4,
                   0);
    return 0;
}

/* dx [tokens, hidden] and dweights [tokens, top_k] (float32) of a layer's routed experts given dy [tokens, hidden]
 * (float32), the forward's ids and weights (float32) and its kept pre-activations (moe_forward_keeping's), for a
 * backward layer (above). On the runner's own threads; 0, or non-zero with a message in err. */
int moe_backward(void *runner, const void *layer, const float *dy, const int32_t *ids, const float *weights,
                 const float *kept, int64_t tokens, int64_t hidden, int64_t top_k, float *dx, float *dweights,
                 char *err, int64_t err_len) {
    moe_runner *r = runner;
    const uint64_t start = runner_now_ns();
    pthread_mutex_lock(&r->one_call);
    const int status =
        backward_locked(r, layer, dy, ids, weights, kept, tokens, hidden, top_k, dx, dweights, err, err_len);
    r->totals[CALLS]++;
    r->totals[NANOSECONDS] += runner_now_ns() - start;
    pthread_mutex_unlock(&r->one_call);
    return status;
}
