/* A row's greedy token: the index of the first maximum of float32 logits (a NaN counts as the maximum, the first NaN
 * winning, as in jnp.argmax), on AVX-512 (avx512 = 1) or AVX2; for the argmax and sampling handlers. */
#ifndef MOE_JAX_XLA_ARGMAX_H
#define MOE_JAX_XLA_ARGMAX_H

#include <stdint.h>

int32_t row_argmax(const float *x, int64_t n, int avx512);

#endif
