// One variant's table of entry points (kernels.h), compiled with the others of its variant.
#include "kernels.h"

#define LMFORGE_STRING(x) #x
#define LMFORGE_NAME(x) LMFORGE_STRING(x)

namespace lmforge_kernels::LMFORGE_VARIANT {
extern const Kernels table = {LMFORGE_NAME(LMFORGE_VARIANT),
                              int8_matmul,
                              group_matmul,
                              q8_matmul,
                              dequantize_int4,
                              dense_matmul,
                              decode_attention,
                              prefill_attention,
                              silu_mul,
                              rms_norm,
                              argmax_rows,
                              rope_rotate_half};
}
