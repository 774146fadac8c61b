/* GEMMs on AVX512-BF16 (VDPBF16PS), for CPUs with those instructions but no AMX (AMD Zen 4/5, Intel Cooper Lake):
 * the fused expert forward there (moe_forward.c) and host_kernels/bf16_gemm.py, int8_gemm.py. Only this file is
 * compiled for avx512bf16; its callers check the CPU first.
 *
 * C[m, n] (float32) = A[m, k] (bfloat16, row-major, k padded with zeros to kp) @ B[k, n], float32 accumulation,
 * for two kinds of B:
 * - bf16_gemm: bfloat16 weights in the AMX kernel's packed layout (amx_gemm.c): per 16-column block, k-pair rows
 *   of 64 bytes holding (B[2r, c], B[2r + 1, c]) for its 16 columns c, the block's rows contiguous. That is exactly
 *   one VDPBF16PS operand: one load gives a k-pair for 16 columns, and the A row's matching pair is broadcast as
 *   one 32-bit value. So both bfloat16 kernels share one packing and one weight stream per column block.
 * - int8_gemm: int8 weights Q with a float32 scale per column, B = Q * scale: per 16-column block, k-pair rows of
 *   32 bytes in the same pair order, then the block's 16 scales (one stream of kp * 16 + 64 bytes). A weight-bound
 *   (decode) product reads 1 byte per weight and runs int8_vnni_gemm.c's integer products; larger ones widen the
 *   weights to bfloat16 (exact) and multiply as bf16_gemm does, the scale applied once per output. int8_gemm's
 *   CPUs need AVX512-VNNI too (every CPU with AVX512-BF16 has it).
 *
 * Register blocking: up to 6 rows x 4 column blocks (64 columns) of C in 24 accumulators, four weight streams read
 * side by side, prefetched ahead. Larger m re-reads a 64-column strip (from L2) once per 6 rows. A bfloat16
 * product of at most STREAM_ROWS rows is bound by reading B, and reads it as one sequential stream instead: block
 * after block, each k-pair row multiplied into one of four accumulators per row (so no row waits on the latency of
 * one chain). Two threads from DRAM on an AMD Zen 5, against a plain read of the same bytes in the same rounds: one
 * stream 0.96 (m 1), 0.94 (m 2), 0.96 (m 4); four streams 0.88, 0.90, 0.91; at 6 rows four streams win (0.89 vs
 * 0.81: one stream re-reads its block per 4 rows and broadcasts each row's pair once per block).
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16_gemm.h"
#include "simd.h"
#include "int8_vnni_gemm.h"

#define PREFETCH_BYTES 2048 /* ahead of the k-pair row loaded, per stream */

/* bytes of one 16-column block of packed B, and of one k-pair row in it */
static inline int64_t block_bytes(int64_t kp, const int int8) { return int8 ? kp * 16 + 64 : kp * 32; }

/* one k-pair row of 16 columns as 32 bfloat16: loaded, or widened from 32 int8 */
static inline __attribute__((always_inline)) __m512bh load_pairs(const char *row, const int int8) {
    if (!int8) return (__m512bh)_mm512_load_si512((const void *)row);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)row)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* A product of more than TILE_ROWS rows reads each strip once from memory (its first pass over 6 rows) and again from
 * L2 per further 6 rows; alone, that first pass waits on memory while the others wait on nothing. So the further passes
 * also bring the next strip into L2, each a share of its k-pair rows (`every`-th row from `phase`). For that a strip
 * must stay in L2 between passes, beside the next: a bfloat16 product over more than K_CHUNK k-rows runs in k-chunks of
 * at most that (256 KB strips), each after the first adding to C (a [512, 32768] x [32768, 64] strip would be 4 MB,
 * re-read from L3 or memory per 6 rows). */
#define K_CHUNK 2048
typedef struct {
    const char *b; /* NULL: nothing to prefetch in this pass */
    int blocks, every, phase;
} next_strip;

/* c rows [0, rows) x `blocks` 16-column blocks = A @ B over k-pairs [0, pairs) of the blocks at b (stride bytes
 * apart), added to c where `add`. `rows`, `blocks` and `int8` are constants at each call site below, so the
 * accumulators stay in registers. cols: valid columns of the last block (1..16). */
static inline __attribute__((always_inline)) void block_rows(const uint16_t *a, int64_t lda, const char *b,
                                                             int64_t stride, int64_t pairs, float *c, int64_t ldc,
                                                             const int rows, const int blocks, int cols,
                                                             const int int8, int add, const next_strip next) {
    __m512 acc[TILE_ROWS][TILE_BLOCKS];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < blocks; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t row_bytes = int8 ? 32 : 64;
    int turn = next.phase;
    for (int64_t r = 0; r < pairs; r++) {
        if (next.b && turn-- == 0) { /* the next strip's k-pair row r, every `every`-th row of this pass */
            turn = next.every - 1;
            for (int j = 0; j < next.blocks; j++) _mm_prefetch(next.b + j * stride + r * row_bytes, _MM_HINT_T1);
        }
        __m512bh w[TILE_BLOCKS];
        for (int j = 0; j < blocks; j++) {
            const char *row = b + j * stride + r * row_bytes;
            _mm_prefetch(row + PREFETCH_BYTES, _MM_HINT_T0);
            w[j] = load_pairs(row, int8);
        }
        for (int i = 0; i < rows; i++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32(((const int32_t *)(a + i * lda))[r]);
            for (int j = 0; j < blocks; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, w[j]);
        }
    }
    const __mmask16 last = tail_mask(cols);
    for (int j = 0; j < blocks; j++) { /* int8: the scales follow the block's pairs (never chunked) */
        const __m512 scale = int8 ? _mm512_loadu_ps((const float *)(b + j * stride + pairs * 32)) : _mm512_set1_ps(1);
        for (int i = 0; i < rows; i++) {
            const __mmask16 k = j == blocks - 1 ? last : (__mmask16)0xFFFF;
            float *out = c + i * ldc + j * 16;
            __m512 v = int8 ? _mm512_mul_ps(acc[i][j], scale) : acc[i][j];
            if (add) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, out));
            _mm512_mask_storeu_ps(out, k, v);
        }
    }
}

/* What the pass over rows [r0, r0 + 6) of the strip at block nb (at b) prefetches: a share of the next strip in
 * [.., n1), for every pass but the first */
static inline next_strip next_strip_of(const char *b, int64_t stride, int64_t m, int64_t r0, int64_t n1,
                                       int64_t nb) {
    const int64_t left = (n1 - (nb + TILE_BLOCKS) * 16 + 15) / 16; /* blocks after this strip */
    if (r0 < TILE_ROWS || left <= 0) return (next_strip){0, 0, 1, 0};
    return (next_strip){b + TILE_BLOCKS * stride, left > TILE_BLOCKS ? TILE_BLOCKS : (int)left,
                        (int)((m - 1) / TILE_ROWS), (int)(r0 / TILE_ROWS - 1)};
}

/* rows [r0, r0 + R) x B blocks of the strip at b (TILES_6X4), over the k-chunk [k0, k0 + kc) */
#define TILE_CASE(R, B)                                                                                          \
    block_rows(a + r0 * lda + k0, lda, b, stride, kc / 2, c + r0 * ldc + nb * 16 - n0, ldc, R, B, cols, int8,     \
               k0 > 0, next_strip_of(b, stride, m, r0, n1, nb))

/* Columns [n0, n1) of C, written to c (which points at column n0 of row 0; row stride ldc floats). n0 must be a
 * multiple of 16; kp (the packed k: a multiple of 32) is also the row length A is read over (lda >= kp). */
static inline __attribute__((always_inline)) void gemm(const uint16_t *a, int64_t lda, const char *b_packed,
                                                       int64_t kp, float *c, int64_t ldc, int64_t m, int64_t n0,
                                                       int64_t n1, const int int8) {
    const int64_t stride = block_bytes(kp, int8);
    const int64_t chunks = int8 ? 1 : (kp + K_CHUNK - 1) / K_CHUNK;
    const int64_t chunk = (kp / 32 + chunks - 1) / chunks * 32; /* even chunks, each a multiple of 32 */
    for (int64_t k0 = 0; k0 < kp; k0 += chunk) {
        const int64_t kc = kp - k0 < chunk ? kp - k0 : chunk;
        const char *b_chunk = b_packed + k0 / 2 * 64; /* its first k-pair row in every block */
        TILES_6X4(m, n0, n1, b_chunk, stride, TILE_CASE)
    }
}

#define STREAM_ROWS 4
#define STREAM_CHAINS 4 /* accumulators per row: consecutive k-pair rows go to each in turn */

/* c rows [0, rows) x one 16-column block (its first `cols` stored) = A @ the block at b, read front to back */
static inline __attribute__((always_inline)) void stream_block(const uint16_t *a, int64_t lda, const char *b,
                                                               int64_t kp, float *c, int64_t ldc, const int rows,
                                                               int cols) {
    __m512 acc[STREAM_ROWS][STREAM_CHAINS];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < STREAM_CHAINS; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t r = 0; r < kp / 2; r += STREAM_CHAINS) { /* kp / 2 is a multiple of 16 */
        const char *rows_at = b + r * 64;
        for (int j = 0; j < STREAM_CHAINS; j++) _mm_prefetch(rows_at + j * 64 + PREFETCH_BYTES, _MM_HINT_T0);
        for (int j = 0; j < STREAM_CHAINS; j++) {
            const __m512bh w = (__m512bh)_mm512_load_si512((const void *)(rows_at + j * 64));
            for (int i = 0; i < rows; i++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32(((const int32_t *)(a + i * lda))[r + j]);
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, w);
            }
        }
    }
    const __mmask16 mask = tail_mask(cols);
    for (int i = 0; i < rows; i++) {
        __m512 sum = acc[i][0];
        for (int j = 1; j < STREAM_CHAINS; j++) sum = _mm512_add_ps(sum, acc[i][j]);
        _mm512_mask_storeu_ps(c + i * ldc, mask, sum);
    }
}

void bf16_gemm(const uint16_t *a, int64_t lda, const uint16_t *b_packed, int64_t kp, float *c, int64_t ldc,
               int64_t m, int64_t n0, int64_t n1) {
    if (m > STREAM_ROWS) {
        gemm(a, lda, (const char *)b_packed, kp, c, ldc, m, n0, n1, 0);
        return;
    }
    for (int64_t nb = n0 / 16; nb * 16 < n1; nb++) {
        const char *b = (const char *)b_packed + nb * block_bytes(kp, 0);
        float *out = c + nb * 16 - n0;
        const int cols = n1 - nb * 16 < 16 ? (int)(n1 - nb * 16) : 16;
        switch (m) {
            case 1: stream_block(a, lda, b, kp, out, ldc, 1, cols); break;
            case 2: stream_block(a, lda, b, kp, out, ldc, 2, cols); break;
            case 3: stream_block(a, lda, b, kp, out, ldc, 3, cols); break;
            case 4: stream_block(a, lda, b, kp, out, ldc, 4, cols); break;
            default: break; /* m = 0 */
        }
    }
}

/* int8: a product of at most WIDEN_ROWS rows takes int8_vnni_gemm.c's integer products (its rows quantized to int16:
 * bound by reading the weights at a few rows, and up to here faster than widening them); more rows widen each strip
 * of TILE_BLOCKS column blocks to bfloat16 once (exact) and multiply it as bf16_gemm does, then scale its columns.
 * Where memory for either buffer runs out, the weights are widened in registers as they stream (block_rows), which
 * needs none. */
#define WIDEN_ROWS 24

void int8_gemm(const uint16_t *a, int64_t lda, const int8_t *b_packed, int64_t kp, float *c, int64_t ldc, int64_t m,
               int64_t n0, int64_t n1) {
    static __thread uint16_t *wide; /* TILE_BLOCKS column blocks in bfloat16, per thread (grown, never shrunk) */
    static __thread int64_t wide_kp;
    if (m <= WIDEN_ROWS) {
        if (int8_vnni_gemm(a, lda, b_packed, kp, c, ldc, m, n0, n1))
            gemm(a, lda, (const char *)b_packed, kp, c, ldc, m, n0, n1, 1);
        return;
    }
    if (wide_kp < kp) {
        free(wide);
        wide = aligned_alloc(64, (size_t)kp * 16 * 2 * TILE_BLOCKS);
        wide_kp = wide ? kp : 0;
    }
    if (!wide) {
        gemm(a, lda, (const char *)b_packed, kp, c, ldc, m, n0, n1, 1);
        return;
    }
    for (int64_t nb = n0 / 16; nb * 16 < n1; nb += TILE_BLOCKS) {
        const int64_t width = n1 - nb * 16 < TILE_BLOCKS * 16 ? n1 - nb * 16 : TILE_BLOCKS * 16;
        int8_widen_blocks(b_packed, kp, nb, (width + 15) / 16, wide);
        float *strip = c + nb * 16 - n0;
        gemm(a, lda, (const char *)wide, kp, strip, ldc, m, 0, width, 0);
        int8_scale_columns(b_packed, kp, nb, width, strip, ldc, m);
    }
}

void int8_widen_blocks(const int8_t *b_packed, int64_t kp, int64_t nb, int64_t count, uint16_t *dst) {
    for (int64_t j = 0; j < count; j++) {
        const char *q = (const char *)b_packed + (nb + j) * block_bytes(kp, 1);
        for (int64_t i = 0; i < kp * 16; i += 32)
            _mm512_store_si512((void *)(dst + j * kp * 16 + i), (__m512i)load_pairs(q + i, 1));
    }
}

void int8_scale_columns(const int8_t *b_packed, int64_t kp, int64_t nb, int64_t width, float *c, int64_t ldc,
                        int64_t m) {
    for (int64_t j = 0; j * 16 < width; j++) {
        const char *block = (const char *)b_packed + (nb + j) * block_bytes(kp, 1);
        const __m512 scale = _mm512_loadu_ps((const float *)(block + kp * 16));
        const __mmask16 mask = tail_mask(width - j * 16);
        for (int64_t r = 0; r < m; r++) {
            float *out = c + r * ldc + j * 16;
            _mm512_mask_storeu_ps(out, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, out), scale));
        }
    }
}
