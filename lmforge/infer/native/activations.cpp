/* SwiGLU's activation, silu(gate) * up = gate / (1 + e^-gate) * up, as one pass in fp32 over
 * gate and up (fp32, or bf16: the output of torch's bf16 GEMM) into fp32 or bf16 (rounded to
 * nearest even, as torch's conversion). Eagerly torch takes a pass for silu, one for the
 * product and, around a bf16 GEMM, one per conversion: five passes over the [rows, d_ff]
 * activations of a prefill, which leave a core's L2 cache, where this takes one
 * (infer/quantize.py SwiGLU). exp is simd.h's polynomial; OpenMP threads split the elements. */
#include <math.h>
#include <omp.h>

#include "kernels.h"
#include "simd.h"

namespace lmforge_kernels::LMFORGE_VARIANT {

static inline float silu_mul_one(float g, float u) { return g / (1.f + expf(-g)) * u; }

template <bool IN_BF16, bool OUT_BF16>
static void silu_mul_range(const void* gate, const void* up, void* out, int64_t lo, int64_t hi) {
  const auto* g16 = (const uint16_t*)gate;
  const auto* u16 = (const uint16_t*)up;
  const auto* g32 = (const float*)gate;
  const auto* u32 = (const float*)up;
  int64_t i = lo;
#ifdef SIMD_WIDTH
  for (; i + SIMD_WIDTH <= hi; i += SIMD_WIDTH) {
    const vec g = IN_BF16 ? vload_bf16(g16 + i) : vload(g32 + i);
    const vec u = IN_BF16 ? vload_bf16(u16 + i) : vload(u32 + i);
    const vec y = vmul(vdiv(g, vadd(vset(1.f), vexp(vsub(vset(0.f), g)))), u);
    if constexpr (OUT_BF16) vstore_bf16((uint16_t*)out + i, y);
    else vstore((float*)out + i, y);
  }
#endif
  for (; i < hi; i++) {
    const float y = IN_BF16 ? silu_mul_one(bf16_to_float(g16[i]), bf16_to_float(u16[i]))
                            : silu_mul_one(g32[i], u32[i]);
    if constexpr (OUT_BF16) ((uint16_t*)out)[i] = float_to_bf16(y);
    else ((float*)out)[i] = y;
  }
}

void silu_mul(const void* gate, const void* up, int in_bf16, void* out, int out_bf16, int64_t n,
              int threads) {
  constexpr int64_t CHUNK = 16384; /* elements per task: enough to outweigh a thread's start */
  const int64_t chunks = (n + CHUNK - 1) / CHUNK;
  auto run = in_bf16 ? (out_bf16 ? silu_mul_range<true, true> : silu_mul_range<true, false>)
                     : (out_bf16 ? silu_mul_range<false, true> : silu_mul_range<false, false>);
#pragma omp parallel for num_threads(chunks < threads ? (int)chunks : threads) schedule(static)
  for (int64_t c = 0; c < chunks; c++) run(gate, up, out, c * CHUNK, c + 1 < chunks ? (c + 1) * CHUNK : n);
}

}  // namespace lmforge_kernels::LMFORGE_VARIANT
