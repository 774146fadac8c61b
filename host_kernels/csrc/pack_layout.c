/* The bfloat16 tile layout (host_kernels/amx.py's pack_layout: [n blocks][k blocks][16 pairs][16 columns][2], zero
 * padded) written from a [k, n] bfloat16 weight of any strides. It is read tile by tile, 32 k-rows x 16 columns,
 * along whichever axis is contiguous: for a transposed weight (the backward's W^T, a view of W) 16 runs of 64
 * bytes. numpy's strided copies of the same moves were slow (a transposed weight most), paid for every expert when a
 * layer is first used. Compiled for the baseline: every CPU packs. */
#include <stdint.h>
#include <string.h>

/* dst: [ceil(n / 16)][kp / 32][512] uint16 (kp = k rounded up to 32); src element (i, j) at src[i * ks + j * ns] */
void pack_bf16_tiles(const uint16_t *src, int64_t ks, int64_t ns, int64_t k, int64_t n, uint16_t *dst) {
    const int64_t kb_count = (k + 31) / 32, nb_count = (n + 15) / 16;
    const int rows_major = ns < ks; /* then a band of 32 k-rows is read across all columns before the next */
    for (int64_t outer = 0; outer < (rows_major ? kb_count : nb_count); outer++)
        for (int64_t inner = 0; inner < (rows_major ? nb_count : kb_count); inner++) {
            const int64_t kb = rows_major ? outer : inner, nb = rows_major ? inner : outer;
            uint16_t *tile = dst + (nb * kb_count + kb) * 512;
            const int64_t rows = k - kb * 32 < 32 ? k - kb * 32 : 32, cols = n - nb * 16 < 16 ? n - nb * 16 : 16;
            if (rows < 32 || cols < 16) memset(tile, 0, 512 * 2);
            const uint16_t *corner = src + (kb * 32) * ks + (nb * 16) * ns;
            if (rows_major) /* 16 columns of two k-rows at a time, interleaved into their pairs */
                for (int64_t r = 0; r < rows; r += 2) {
                    const uint16_t *even = corner + r * ks, *odd = r + 1 < rows ? even + ks : NULL;
                    uint16_t *pairs = tile + (r / 2) * 32;
                    for (int64_t c = 0; c < cols; c++)
                        pairs[2 * c] = even[c * ns], pairs[2 * c + 1] = odd ? odd[c * ns] : 0;
                }
            else /* a transposed weight: 32 k-rows of one column, contiguous */
                for (int64_t c = 0; c < cols; c++)
                    for (int64_t r = 0; r < rows; r++) tile[(r / 2) * 32 + c * 2 + (r & 1)] = corner[r * ks + c * ns];
        }
}
