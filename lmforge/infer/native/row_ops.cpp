/* Per-row passes of a decode step: RMSNorm, RoPE's rotation and the greedy argmax.
 *
 * Why by hand: at a decode step's few rows each is little work, and torch's eager ops cost
 * several times that per call: torch.rms_norm on a CPU runs as six ops (square, mean, add,
 * rsqrt and two products), called 2 n_layer + 1 times a step; RoPE's rotate-half as five (a
 * negation, a concatenation, two products and a sum); torch.max(dim=-1) over a batch's logits
 * is slow for what two passes over them do. Here each is one call and one pass (two for the
 * argmax), in fp32 as torch's ops compute (docs/inference.md; docs/benchmarks.md,
 * eager_step_overhead). */
#include <math.h>
#include <omp.h>

#include "kernels.h"
#include "simd.h"

namespace lmforge_kernels::LMFORGE_VARIANT {

/* rows lo..hi of y = x / sqrt(mean(x^2) + eps) * w: x and y fp32 or bf16 (`BF16`), w fp32 or
 * bf16 (`W_BF16`); multiplied in torch's order, (x * r) * w */
template <bool BF16, bool W_BF16>
static void rms_norm_rows(const void* x, const void* w, void* y, int64_t lo, int64_t hi,
                          int64_t d, float eps) {
  for (int64_t row = lo; row < hi; row++) {
    const auto* x16 = (const uint16_t*)x + row * d;
    const auto* x32 = (const float*)x + row * d;
    const auto at = [&](int64_t i) { return BF16 ? bf16_to_float(x16[i]) : x32[i]; };
    const auto weight = [&](int64_t i) {
      return W_BF16 ? bf16_to_float(((const uint16_t*)w)[i]) : ((const float*)w)[i];
    };
    float squares = 0.f;
    int64_t i = 0;
#ifdef SIMD_WIDTH
    const auto load = [&](int64_t j) { return BF16 ? vload_bf16(x16 + j) : vload(x32 + j); };
    vec acc = vset(0.f);
    for (; i + SIMD_WIDTH <= d; i += SIMD_WIDTH) {
      const vec v = load(i);
      acc = vfma(v, v, acc);
    }
    squares = vsum(acc);
#endif
    for (; i < d; i++) squares += at(i) * at(i);
    const float r = 1.f / sqrtf(squares / (float)d + eps);
    i = 0;
#ifdef SIMD_WIDTH
    for (; i + SIMD_WIDTH <= d; i += SIMD_WIDTH) {
      const vec wv = W_BF16 ? vload_bf16((const uint16_t*)w + i) : vload((const float*)w + i);
      const vec out = vmul(vmul(load(i), vset(r)), wv);
      if constexpr (BF16) vstore_bf16((uint16_t*)y + row * d + i, out);
      else vstore((float*)y + row * d + i, out);
    }
#endif
    for (; i < d; i++) {
      const float out = at(i) * r * weight(i);
      if constexpr (BF16) ((uint16_t*)y)[row * d + i] = float_to_bf16(out);
      else ((float*)y)[row * d + i] = out;
    }
  }
}

void rms_norm(const void* x, const void* w, int bf16, int w_bf16, void* y, int64_t rows,
              int64_t d, float eps, int threads) {
  auto run = bf16 ? (w_bf16 ? rms_norm_rows<true, true> : rms_norm_rows<true, false>)
                  : (w_bf16 ? rms_norm_rows<false, true> : rms_norm_rows<false, false>);
  const int64_t per_task = (65536 + d - 1) / d; /* rows: enough to outweigh a thread's start */
  const int64_t tasks = (rows + per_task - 1) / per_task;
  if (tasks <= 1 || threads <= 1) return run(x, w, y, 0, rows, d, eps);
#pragma omp parallel for num_threads(tasks < threads ? (int)tasks : threads) schedule(static)
  for (int64_t t = 0; t < tasks; t++)
    run(x, w, y, t * per_task, t + 1 < tasks ? (t + 1) * per_task : rows, d, eps);
}

/* out = x cos + rotate_half(x) sin for every (batch, head, position) row of x [b, h, t, d]
 * (element strides xs per batch, head and position, unit along d) with cos / sin rows [b, t, d]
 * (strides cs per batch and position, 0 where broadcast), out contiguous: rotate_half(x) =
 * (-x[d/2:], x[:d/2]) (Hugging Face's pairing). Multiplied and added as torch's eager ops do,
 * each product rounded (no fused multiply-add): the same bits. */
void rope_rotate_half(const float* x, const int64_t* xs, const float* cos, const float* sin,
                      const int64_t* cs, float* out, int64_t b, int64_t h, int64_t t, int64_t d,
                      int threads) {
  const int64_t half = d / 2, rows = b * h * t;
  const auto row = [&](int64_t r) {
    const int64_t i = r / (h * t), j = r / t % h, p = r % t;
    const float* xr = x + i * xs[0] + j * xs[1] + p * xs[2];
    const float* c = cos + i * cs[0] + p * cs[1];
    const float* s = sin + i * cs[0] + p * cs[1];
    float* o = out + r * d;
    int64_t e = 0;
#ifdef SIMD_WIDTH
    for (; e + SIMD_WIDTH <= half; e += SIMD_WIDTH) {
      const vec lo = vload(xr + e), hi = vload(xr + half + e);
      vec p[4] = {vmul(lo, vload(c + e)), vmul(hi, vload(s + e)), vmul(hi, vload(c + half + e)),
                  vmul(lo, vload(s + half + e))};
      for (vec& q : p) asm("" : "+v"(q)); /* rounded: not fused into the sums by the compiler */
      vstore(o + e, vsub(p[0], p[1]));
      vstore(o + half + e, vadd(p[2], p[3]));
    }
#endif
    for (; e < half; e++) {
      const float lo = xr[e], hi = xr[half + e];
      float p[4] = {lo * c[e], hi * s[e], hi * c[half + e], lo * s[half + e]};
      for (float& q : p) asm("" : "+x"(q));
      o[e] = p[0] - p[1];
      o[half + e] = p[2] + p[3];
    }
  };
  const int64_t per_task = (16384 + d - 1) / d; /* rows: enough to outweigh a thread's start */
  const int64_t tasks = (rows + per_task - 1) / per_task;
  if (tasks <= 1 || threads <= 1) {
    for (int64_t r = 0; r < rows; r++) row(r);
    return;
  }
#pragma omp parallel for num_threads(tasks < threads ? (int)tasks : threads) schedule(static)
  for (int64_t task = 0; task < tasks; task++)
    for (int64_t r = task * per_task; r < rows && r < (task + 1) * per_task; r++) row(r);
}

/* The index of each row's largest value, the first of equals (torch's rule); a NaN counts as
 * the largest (torch.max propagates it), the first NaN then. Two passes: the largest value (and
 * whether a NaN is there), then where it first is. */
void argmax_rows(const float* x, int64_t* out, int64_t rows, int64_t n) {
  for (int64_t row = 0; row < rows; row++) {
    const float* p = x + row * n;
    float best = p[0];
    int nan = 0;
    int64_t i = 0, found = -1;
#ifdef SIMD_WIDTH
    if (n >= SIMD_WIDTH) {
      vec top = vload(p);
      for (i = 0; i + SIMD_WIDTH <= n; i += SIMD_WIDTH) {
        const vec v = vload(p + i);
        top = vmax(top, v);
        nan |= vnan(v);
      }
      best = vtop(top);
    }
#endif
    for (; i < n; i++) {
      best = p[i] > best ? p[i] : best;
      nan |= p[i] != p[i];
    }
    i = 0;
#ifdef SIMD_WIDTH
    for (; found < 0 && i + SIMD_WIDTH <= n; i += SIMD_WIDTH) {
      const vec v = vload(p + i);
      const int hits = nan ? vnan(v) : vequal(v, best);
      if (hits) found = i + __builtin_ctz(hits);
    }
#endif
    for (; found < 0 && i < n; i++)
      if (nan ? p[i] != p[i] : p[i] == best) found = i;
    out[row] = found;
  }
}

}  // namespace lmforge_kernels::LMFORGE_VARIANT
