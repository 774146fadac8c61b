/* What the fused forward (moe_forward.c) and the fused backward (moe_backward.c) share (and the stream worker,
 * stream_worker.c, which calls both and sizes what a forward keeps from a layer's ffn): one
 * layer's packed weights (`moe_layer`), one call's state, and the parts of a call both run: the routing (pairs
 * sorted by expert) with the call's buffers, the gather of each pair's input row, the tiles of a phase, the GEMM
 * of one expert's rows and the combine of each token's pairs. */
#ifndef MOE_CALL_H
#define MOE_CALL_H
#include <stdint.h>

#include "kernel_table.h"
#include "runner.h"

#define COLUMN_BLOCK 128   /* output columns per tile: a multiple of the AMX tile's 16 */
#define NOT_ROUTED (-1) /* an expert id: this pair is computed elsewhere (host_kernels/schedule.py) */

static inline int64_t padded(int64_t n, int64_t block) { return (n + block - 1) / block * block; }

typedef struct {
    int64_t experts, hidden, ffn;
    int f32;                   /* weights: float32 (f32_gemm.c) or bfloat16, and so the rows' type */
    int kernel;                /* MOE_KERNEL_*: which GEMM reads the packed weights (bfloat16 rows unless f32) */
    const moe_kernel *k;       /* its row of the kernel table: the GEMM, and the row quantizer where it reads records */
    int avx2;                  /* the AVX2 kernels (SwiGLU too), else AVX-512 ones */
    int records;               /* its GEMMs read quantized row records (k->quantize) */
    int64_t group;             /* int4: k-rows per scale */
    int64_t weight_bits;       /* bits per packed weight: 32, 16, 8 or 4 (scales aside) */
    int64_t row_bytes;         /* bytes per element of the gathered inputs and activations: 4 or 2 */
    int64_t kp_hidden, kp_ffn; /* row strides of the gathered inputs and activations: k padded to the AMX tile (32) */
    int64_t ffn_padded;        /* up columns start here in packed w13 (a 16-column AMX tile or 32-column f32 block) */
    const void **w13;          /* [experts] packed [hidden, 2 * ffn_padded]: gate at [0, ffn), up at [ffn_padded, ...) */
    const void **w2;           /* [experts] packed [ffn, hidden] */
    int64_t *routed;           /* [experts] pairs routed to each expert, accumulated over calls (owner reads them) */
    int glu;                   /* the gated activation (MOE_GLU_*; moe_layer_set_glu) */
    float glu_alpha, glu_limit; /* MOE_GLU_CLAMPED_SWIGLU's sigmoid gain and clamp */
    const float *b13;          /* NULL, or [experts, 2 * ffn] gate/up biases (gate then up), owned by the caller */
} moe_layer;

/* host_kernels.activations.GLU's kinds: silu(g) * u, and GPT-OSS's (clip(u, +-limit) + 1) * g' sigmoid(alpha g'),
 * g' = min(g, limit) */
enum { MOE_GLU_SWIGLU = 0, MOE_GLU_CLAMPED_SWIGLU = 1 };

typedef struct {
    int32_t expert;
    int32_t c0, c1; /* output columns */
} tile;

typedef struct {
    moe_runner *runner;
    const moe_layer *layer;
    const void *x;
    int x_bf16;
    int64_t tokens, top_k, pairs;
    int64_t *offsets;       /* [experts + 1] start of each expert's rows in sorted order */
    int64_t *token_of;      /* [pairs] token of each sorted row */
    int64_t *position;      /* [tokens * top_k] sorted row of each pair */
    float *weight_sorted;   /* [pairs] */
    char *rows;             /* [pairs + 16, kp_hidden] inputs in sorted order, bfloat16 or float32 (row_bytes) */
    char *act;              /* [pairs + 16, act_kp] SwiGLU outputs (backward: gate/up gradients), the same */
    int64_t act_width, act_kp; /* values of an act row, and its stride (the rest zeros) */
    char *rows_q, *act_q;   /* layers whose GEMMs read records: both quantized (record_bytes a row) */
    float *out;             /* [pairs, hidden] weighted expert outputs */
    float *keep;            /* NULL, or [pairs, 2 * ffn]: the gate/up pre-activations, for a backward */
    void *y;
    tile *tiles;
    int64_t tile_count;
    int64_t *sizes;         /* [experts] pairs of each expert */
    int32_t *by_size;       /* [experts] the experts, most pairs first */
} call_state;


/* Checks ids (and hidden) against the layer, sorts the routed pairs by expert (stable: host_kernels/schedule.py's
 * order) and reserves the call's buffers on the runner: act rows of `act_width` values, `act_kp` apart; `scratch`
 * floats per row of the largest expert for each thread. Fills s; returns 0, or 1 with a message in err. */
int moe_open_call(moe_runner *r, const moe_layer *l, call_state *s, const int32_t *ids, const void *weights,
                  int w_dtype, int64_t tokens, int64_t hidden, int64_t top_k, int64_t act_width, int64_t act_kp,
                  int64_t scratch, char *err, int64_t err_len);
int moe_fail(char *err, int64_t err_len, const char *message, long long a, long long b);
void moe_gather_task(void *state, int worker, int64_t task); /* GATHER_BLOCK pairs' input rows a task */
void moe_combine_task(void *state, int worker, int64_t task); /* TOKEN_BLOCK tokens a task */
int64_t moe_gather_tasks(const call_state *s);
int64_t moe_combine_tasks(const call_state *s);
/* the tiles of a phase over `width` output columns: every routed expert's rows x COLUMN_BLOCK columns */
void moe_plan_tiles(call_state *s, int64_t width);
/* columns [n0, n1) of m rows at a (the layer's row type, row stride kp; or their records) times packed w */
void moe_expert_gemm(const moe_layer *l, const char *a, int64_t kp, const void *w, float *c, int64_t ldc, int64_t m,
                     int64_t n0, int64_t n1);
/* The entry points the stream worker (stream_worker.c) calls besides moe_call's forward: a training forward that
 * keeps its gate/up pre-activations (moe_forward.c) and the fused backward (moe_backward.c). */
int moe_forward_keeping(void *runner, const void *layer, const void *x, int x_dtype, const int32_t *ids,
                        const void *weights, int w_dtype, int64_t tokens, int64_t hidden, int64_t top_k, void *y,
                        float *keep, char *err, int64_t err_len);
int moe_backward(void *runner, const void *layer, const float *dy, const int32_t *ids, const float *weights,
                 const float *kept, int64_t tokens, int64_t hidden, int64_t top_k, float *dx, float *dweights,
                 char *err, int64_t err_len);
/* adds a finished call to the runner's totals: its FLOPs and bytes, and (a forward's) tokens and routed pairs */
void moe_count_call(moe_runner *r, const moe_layer *l, const call_state *s, int64_t bytes_in, int64_t bytes_out,
                    int forward);

#endif
