/* cache_attention_block.h's attend_block for both cache types, ISA_attend_block_bf16 and ISA_attend_block_f32:
 * xla_cache_attention.c includes this once per instruction set, with that set's ISA, V and W defined. */
#define ELEM bf16
#define ELEM_T uint16_t
#define ELEM_IS_BF16 1
#include "cache_attention_block.h"
#undef ELEM_IS_BF16
#undef ELEM_T
#undef ELEM

#define ELEM f32
#define ELEM_T float
#define ELEM_IS_BF16 0
#include "cache_attention_block.h"
#undef ELEM_IS_BF16
#undef ELEM_T
#undef ELEM
