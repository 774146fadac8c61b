/* bfloat16 GEMM on Intel AMX tiles, for the host expert engine (loaded with ctypes; see host_kernels/amx.py,
 * which calls it only where the CPU has AMX: this file alone is compiled for it).
 *
 * C[m, n] (float32) = A[m, k] (bfloat16, row-major) @ B[k, n] (bfloat16, pre-packed), float32 accumulation.
 *
 * B is packed once per weight matrix into the layout TDPBF16PS reads: blocks of 32 k-rows x 16 columns, each a
 * 16 x 64-byte tile whose row r holds the pairs (B[2r, c], B[2r + 1, c]) for its 16 columns c ("VNNI" layout),
 * ordered column block by column block, k blocks contiguous within one:  packed[nb][kb][16][16][2].
 * So one column block's weights are one contiguous stream, which is what a weight-bound (decode) call reads.
 *
 * A is passed padded: rows to a multiple of 16 (their values only reach output rows that are never stored),
 * k to a multiple of 32 with zeros (they meet B's zero padding). bf16_pack_rows() makes such a buffer.
 *
 * Register blocking: 2 x 2 output tiles (32 rows x 32 columns) from 2 A tiles and 2 B tiles per k step, which
 * uses all 8 tile registers. Loops, outermost first: chunks of A's rows small enough to stay in L2 (A_CHUNK_BYTES),
 * 32-column strips of B (k x 64 bytes, in L1), 32-row blocks of the chunk. Without the chunks, a large A is
 * re-read from L3 for every strip.
 */
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_gemm.h"
#include "bf16_gemm.h"

#define A_CHUNK_BYTES (512 * 1024)
/* amx_gemm_4_streams asks for each stream's weights this many 1 KiB tiles ahead of the one it loads: its tile
 * loads alone read no faster than amx_gemm's two streams; two tiles ahead was the fastest of 1-4 */
#define PREFETCH_KB 2
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* The kernel runs only after the OS has granted this process the AMX tile state. 0 on success. */
int amx_request_permission(void) {
    return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

static void load_config(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Stores one 16 x 16 float32 tile, keeping only `rows` x `cols` of it. */
#define STORE_TILE(T, dst, ldc, rows, cols)                                          \
    do {                                                                             \
        if ((rows) == 16 && (cols) == 16) {                                          \
            _tile_stored(T, (dst), (ldc) * 4);                                       \
        } else {                                                                     \
            _tile_stored(T, scratch, 64);                                            \
            for (int r_ = 0; r_ < (rows); r_++)                                      \
                memcpy((dst) + (int64_t)r_ * (ldc), scratch + r_ * 16, (cols) * 4); \
        }                                                                            \
    } while (0)

/* 16-row blocks of A (k padded to kp) in one chunk that stays in L2: an even number, at least 2 */
static int64_t row_chunk_blocks(int64_t kp) {
    const int64_t blocks = A_CHUNK_BYTES / (kp * 2 * 16) / 2 * 2;
    return blocks < 2 ? 2 : blocks;
}

/* C's block at c (row stride ldc) of up to 32 rows x 32 columns = the A rows at a (row stride lda; `rows` of them
 * from here, the second 16 present when two_m) times the column blocks b0 and b1 (NULL: one block), over kb_count
 * k blocks: the 1-4 tiles present, from 2 A and 2 B tiles per k step. cols0, cols1: valid columns of each block. */
static inline __attribute__((always_inline)) void tile_block(const uint16_t *a, int64_t lda, const uint16_t *b0,
                                                             const uint16_t *b1, int64_t kb_count, int64_t rows,
                                                             int two_m, float *c, int64_t ldc, int cols0, int cols1) {
    float scratch[16 * 16];
    const int two_n = b1 != NULL;
    const uint16_t *a1 = a + 16 * lda;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    /* one loop for the 1-4 tiles present; the conditions are loop-invariant (gcc -O3 unswitches) */
    for (int64_t kb = 0; kb < kb_count; kb++) {
        _tile_loadd(4, a + kb * 32, lda * 2);
        _tile_loadd(6, b0 + kb * 512, 64);
        if (two_m) _tile_loadd(5, a1 + kb * 32, lda * 2);
        if (two_n) _tile_loadd(7, b1 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_n) _tile_dpbf16ps(1, 4, 7);
        if (two_m) _tile_dpbf16ps(2, 5, 6);
        if (two_n && two_m) _tile_dpbf16ps(3, 5, 7);
    }
    const int rows0 = rows < 16 ? (int)rows : 16, rows1 = two_m ? (rows - 16 < 16 ? (int)(rows - 16) : 16) : 0;
    float *c1 = c + 16 * ldc;
    STORE_TILE(0, c, ldc, rows0, cols0);
    if (two_n) STORE_TILE(1, c + 16, ldc, rows0, cols1);
    if (two_m) STORE_TILE(2, c1, ldc, rows1, cols0);
    if (two_n && two_m) STORE_TILE(3, c1 + 16, ldc, rows1, cols1);
}

/* Columns [n0, n1) of C = A @ B, written to c (which points at column n0 of row 0; row stride ldc floats).
 * n0 must be a multiple of 16. kp: padded k (multiple of 32); m: rows of A and C (A has them padded to 16). */
void amx_gemm(const uint16_t *a, int64_t lda, const uint16_t *b_packed, int64_t kp, float *c, int64_t ldc,
              int64_t m, int64_t n0, int64_t n1) {
    const int64_t kb_count = kp / 32;
    const int64_t mb_count = (m + 15) / 16;
    const int64_t nb0 = n0 / 16, nb1 = (n1 + 15) / 16;
    const int64_t chunk_blocks = row_chunk_blocks(kp);
    load_config();
    for (int64_t mc = 0; mc < mb_count; mc += chunk_blocks) {
        const int64_t mc_end = mc + chunk_blocks < mb_count ? mc + chunk_blocks : mb_count;
        for (int64_t nb = nb0; nb < nb1; nb += 2) {
            const int two_n = nb + 1 < nb1;
            const uint16_t *b0 = b_packed + nb * kb_count * 512;
            const uint16_t *b1 = b0 + kb_count * 512;
            const int cols0 = (int)((n1 - nb * 16) < 16 ? (n1 - nb * 16) : 16);
            const int cols1 = two_n ? (int)((n1 - (nb + 1) * 16) < 16 ? (n1 - (nb + 1) * 16) : 16) : 0;
            float *c0 = c + (nb - nb0) * 16;
            for (int64_t mb = mc; mb < mc_end; mb += 2)
                tile_block(a + mb * 16 * lda, lda, b0, two_n ? b1 : NULL, kb_count, m - mb * 16, mb + 1 < mc_end,
                           c0 + mb * 16 * ldc, ldc, cols0, cols1);
        }
    }
    _tile_release();
}

/* Four whole 16-column blocks of C = A @ B for an A of at most 16 rows (a decode step's rows of one expert), each block
 * from its own packed weight: b[i] is block i's k-contiguous stream (amx_block), c[i] where its 16 columns go (row
 * stride ldc). At decode sizes the product is bound by reading the weights, and one core reads four streams faster than
 * two, so this reads four blocks side by side where amx_gemm reads two, and prefetches each stream ahead of its tile
 * loads. Each block's tile sees the same products in the same order as in amx_gemm: the results are the same bits. */
void amx_gemm_4_streams(const uint16_t *a, int64_t lda, int64_t kp, const uint16_t *const b[4], float *const c[4],
                        int64_t ldc, int64_t m) {
    float scratch[16 * 16];
    const int64_t kb_count = kp / 32;
    load_config();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kb_count; kb++) {
        if (kb + PREFETCH_KB < kb_count)
            for (int i = 0; i < 4; i++)
                for (int line = 0; line < 16; line++)
                    _mm_prefetch((const char *)(b[i] + (kb + PREFETCH_KB) * 512) + line * 64, _MM_HINT_T0);
        _tile_loadd(4, a + kb * 32, lda * 2);
        _tile_loadd(5, b[0] + kb * 512, 64);
        _tile_loadd(6, b[1] + kb * 512, 64);
        _tile_loadd(7, b[2] + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b[3] + kb * 512, 64); /* eight tiles in all: the fourth block reuses the first's */
        _tile_dpbf16ps(3, 4, 5);
    }
    STORE_TILE(0, c[0], ldc, m, 16);
    STORE_TILE(1, c[1], ldc, m, 16);
    STORE_TILE(2, c[2], ldc, m, 16);
    STORE_TILE(3, c[3], ldc, m, 16);
    _tile_release();
}

/* C[:, n0:n1] = A @ (Q * scale) for int8 weights Q with a float32 scale per column (int8_gemm.py's layout: per
 * 16-column block kp / 2 k-pair rows of 16 x 2 int8 in the tile layout's order, then 16 scales) on AMX tiles:
 * each pair of column blocks is widened once to bfloat16 (exact: |Q| <= 127) into a tile-layout buffer, every
 * 32-row block of A (in chunks that stay in L2, as amx_gemm's) multiplied on the tiles, and the columns scaled.
 * The sums are int8_gemm's (bf16_gemm.c) up to their order. Prefill-sized rows: a product of at most 16 rows is
 * bound by reading the weights, which int8_gemm streams at 1 byte a weight. */
void int8_gemm_amx(const uint16_t *a, int64_t lda, const int8_t *b_packed, int64_t kp, float *c, int64_t ldc,
                   int64_t m, int64_t n0, int64_t n1) {
    if (m <= 16) {
        int8_gemm(a, lda, b_packed, kp, c, ldc, m, n0, n1);
        return;
    }
    static __thread uint16_t *wide;  /* two column blocks in bfloat16, per thread (grown, never shrunk) */
    static __thread int64_t wide_kp;
    if (wide_kp < kp) {
        free(wide);
        wide = aligned_alloc(64, (size_t)kp * 16 * 2 * 2);
        wide_kp = wide ? kp : 0;
        if (!wide) { /* no memory for the buffer: the streaming kernel needs none */
            int8_gemm(a, lda, b_packed, kp, c, ldc, m, n0, n1);
            return;
        }
    }
    const int64_t kb_count = kp / 32, mb_count = (m + 15) / 16;
    const int64_t nb0 = n0 / 16, nb1 = (n1 + 15) / 16;
    const int64_t chunk_blocks = row_chunk_blocks(kp);
    load_config();
    for (int64_t mc = 0; mc < mb_count; mc += chunk_blocks) {
        const int64_t mc_end = mc + chunk_blocks < mb_count ? mc + chunk_blocks : mb_count;
        for (int64_t nb = nb0; nb < nb1; nb += 2) {
            const int two_n = nb + 1 < nb1;
            int8_widen_blocks(b_packed, kp, nb, 1 + two_n, wide); /* already in the tile layout's order */
            const uint16_t *b0 = wide, *b1 = wide + kp * 16;
            const int cols0 = (int)((n1 - nb * 16) < 16 ? (n1 - nb * 16) : 16);
            const int cols1 = two_n ? (int)((n1 - (nb + 1) * 16) < 16 ? (n1 - (nb + 1) * 16) : 16) : 0;
            float *c0 = c + (nb - nb0) * 16;
            for (int64_t mb = mc; mb < mc_end; mb += 2) {
                const int two_m = mb + 1 < mc_end;
                float *r0 = c0 + mb * 16 * ldc;
                tile_block(a + mb * 16 * lda, lda, b0, two_n ? b1 : NULL, kb_count, m - mb * 16, two_m, r0, ldc, cols0,
                           cols1);
                const int rows = m - mb * 16 < 32 ? (int)(m - mb * 16) : 32;
                int8_scale_columns(b_packed, kp, nb, cols0 + cols1, r0, ldc, rows);
            }
        }
    }
    _tile_release();
}

/* dst[i, :k] = bfloat16(src[rows[i], :k]) (rows == NULL: row i), round to nearest even; dst[i, k:kp] = 0 and
 * rows m..mp of dst are zero. src row stride lds floats; dst row stride kp. */
void bf16_pack_rows(const float *src, int64_t lds, const int64_t *rows, int64_t m, int64_t k, uint16_t *dst,
                    int64_t kp, int64_t mp) {
    for (int64_t i = 0; i < mp; i++) {
        uint16_t *out = dst + i * kp;
        if (i >= m) {
            memset(out, 0, kp * 2);
            continue;
        }
        const float *in = src + (rows ? rows[i] : i) * lds;
        int64_t j = 0;
        for (; j + 16 <= k; j += 16) {
            __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(in + j));
            _mm256_storeu_si256((__m256i *)(out + j), (__m256i)v);
        }
        if (j < k) {
            __mmask16 mask = (__mmask16)((1u << (k - j)) - 1);
            __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, in + j));
            _mm256_mask_storeu_epi16(out + j, mask, (__m256i)v);
        }
        memset(out + k, 0, (kp - k) * 2);
    }
}
