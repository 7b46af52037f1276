/* Decode attention on a CPU: one query per row and head over that row's KV cache.
 *
 * Why by hand: at batch 16 attention was a large share of SmolLM2's decode step, reading the
 * cache far below the memory bandwidth: inductor's fused loop (model/attention.py) and SDPA both
 * take several times the time the cache needs to stream in. Here each (row, KV head) runs once over its keys for all the
 * query heads that share them (GQA: the cache is read once, not once per query head), converts
 * fp16 / bf16 keys to fp32 in registers, and takes exp with a polynomial on whole vectors
 * (simd.h's vexp).
 *
 * Three passes over one (row, KV head): scores q.k * scale for every key, 4 keys at a time
 * (masked keys then set to -inf), softmax per query head (max, exp, sum), and the probability-
 * weighted sum of the values, each value converted once for up to 4 query heads. Scores of one
 * (row, KV head) live in a per-thread scratch of G x (L + 1) floats. The arithmetic is fp32
 * throughout; results match torch's SDPA on the upcast cache to float rounding
 * (tests/infer/test_cpu_kernels.py).
 *
 * Vector width by the variant's instruction set (simd.h: AVX-512 16 floats, AVX2 + F16C 8, else
 * scalar); head_dim a multiple of the width (up to 16 of them) takes the vector loops, any other
 * the scalar one. OpenMP threads split the (row, KV head) pairs.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd.h"

namespace lmforge_kernels::LMFORGE_VARIANT {

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

static inline float scalar_load(const void* p, int64_t i, int dtype) {
  if (dtype == KV_F32) return ((const float*)p)[i];
  const uint16_t h = ((const uint16_t*)p)[i];
  return dtype == KV_F16 ? half_to_float(h) : bf16_to_float(h);
}

#ifdef SIMD_WIDTH
#define W SIMD_WIDTH
/* W elements from i on of a cache row in `dtype`, as floats */
static inline vec vload_kv(const void* p, int64_t i, int dtype) {
  if (dtype == KV_F32) return vload((const float*)p + i);
  const uint16_t* h = (const uint16_t*)p + i;
  return dtype == KV_F16 ? vload_f16(h) : vload_bf16(h);
}
#endif

/* Softmax of each query head's scores in place (simd.h: masked keys hold -inf and come out 0),
 * with 1 / sum in inv[g] (0 when every key is masked, never in a decode step: the head then
 * attends to nothing). The value pass scales its G x D sums by inv, not the G x L
 * probabilities. */
static void softmax_rows(float* scores, int64_t g_count, int64_t len, float* inv) {
  for (int64_t g = 0; g < g_count; g++) inv[g] = softmax_unnormalised(scores + g * len, len, 1.f);
}

/* One (row, KV head): q [G, D] fp32 (contiguous), keys and values [L, D] (row stride ks / vs
 * elements), key mask [L] or NULL, out [G, D] fp32; scores: scratch of G x (L + 1) floats.
 * This is the loop for any head_dim, one float at a time. */
static void attend_scalar(const float* q, const char* k, const char* v, int64_t ks, int64_t vs,
                          const uint8_t* mask, float* out, int64_t g_count, int64_t len,
                          int64_t d, float scale, int dtype, float* scores) {
  const int64_t elem = dtype == KV_F32 ? 4 : 2;
  for (int64_t l = 0; l < len; l++)
    for (int64_t g = 0; g < g_count; g++) {
      float s = 0.f;
      for (int64_t c = 0; c < d && (!mask || mask[l]); c++)
        s += q[g * d + c] * scalar_load(k + l * ks * elem, c, dtype);
      scores[g * len + l] = mask && !mask[l] ? -INFINITY : s * scale;
    }
  float* inv = scores + g_count * len;
  softmax_rows(scores, g_count, len, inv);
  for (int64_t g = 0; g < g_count; g++) {
    const float* p = scores + g * len;
    for (int64_t c = 0; c < d; c++) out[g * d + c] = 0.f;
    for (int64_t l = 0; l < len; l++) {
      if (mask && !mask[l]) continue;
      for (int64_t c = 0; c < d; c++)
        out[g * d + c] += p[l] * scalar_load(v + l * vs * elem, c, dtype);
    }
    for (int64_t c = 0; c < d; c++) out[g * d + c] *= inv[g];
  }
}

/* Each (row, KV head) reads two short streams (keys, values: 18 KB each at 140 keys of 64
 * fp16), cold from DRAM in a decode step (the GEMVs between layers evict them): the hardware
 * prefetcher barely ramps up within one, and a step reads far below the bandwidth. So pass 1 prefetches the
 * keys AHEAD rows on into L1 and the values pass 3 will read into L2, and pass 3 the next pair's
 * keys into L2. Into L2, not L1, for the reads a pass does not consume itself: L1 prefetches of
 * those fill the L1's miss buffers and stall the loads the products wait on. */
#define AHEAD 8
#if defined(__x86_64__) || defined(_M_X64)
#define PREFETCH_LINES(p, bytes, hint) \
  for (int64_t j = 0; j < (bytes); j += 64) _mm_prefetch((p) + j, hint)
#else
#define PREFETCH_LINES(p, bytes, hint) (void)(p), (void)(bytes)
#endif
/* the cache lines of [p, p + bytes): into L1 for this pass, into L2 for a later one */
static inline void prefetch_l1(const char* p, int64_t bytes) {
  PREFETCH_LINES(p, bytes, _MM_HINT_T0);
}
static inline void prefetch_l2(const char* p, int64_t bytes) {
  PREFETCH_LINES(p, bytes, _MM_HINT_T1);
}

#ifdef W
/* Pass 3 for N query heads: out[n] = inv[n] sum_l p[n][l] v_l over the unmasked keys, with
 * p [N, L] (row stride len). A value's C vectors are converted once and serve the N heads (one
 * head at a time converted the fp16 cache N times: the conversions cost as much as the
 * products); N x C accumulators stay in registers. It also prefetches the next pair's keys
 * (next_k, row stride ks; NULL for none). */
template <int C, int N>
static inline void weigh_values(const float* p, const float* inv, const char* v, int64_t vs,
                                const uint8_t* mask, float* out, int64_t len, int dtype,
                                const char* next_k, int64_t ks) {
  const int64_t d = C * W, elem = dtype == KV_F32 ? 4 : 2;
  vec acc[N][C];
  for (int n = 0; n < N; n++)
    for (int c = 0; c < C; c++) acc[n][c] = vset(0.f);
  for (int64_t l = 0; l < len; l++) {
    if (next_k) prefetch_l2(next_k + l * ks * elem, d * elem);
    if (mask && !mask[l]) continue;
    const char* val = v + l * vs * elem;
    vec pl[N];
    for (int n = 0; n < N; n++) pl[n] = vset(p[n * len + l]);
    for (int c = 0; c < C; c++) {
      const vec x = vload_kv(val, c * W, dtype);
      for (int n = 0; n < N; n++) acc[n][c] = vfma(pl[n], x, acc[n][c]);
    }
  }
  for (int n = 0; n < N; n++)
    for (int c = 0; c < C; c++) vstore(out + n * d + c * W, vmul(acc[n][c], vset(inv[n])));
}

/* The same on whole vectors, for head_dim = C x W: a key's C vectors are converted once and
 * serve every query head; the C output accumulators of a query head stay in registers. */
template <int C>
static void attend_vec(const float* q, const char* k, const char* v, int64_t ks, int64_t vs,
                       const uint8_t* mask, float* out, int64_t g_count, int64_t len,
                       float scale, int dtype, float* scores, const char* next_k) {
  const int64_t d = C * W, elem = dtype == KV_F32 ? 4 : 2;
  int64_t l = 0;
  /* 4 keys at a time: their 4 dot products per query head are summed across lanes together */
  for (; l + 4 <= len; l += 4) {
    for (int j = 0; j < 4; j++) { /* keys AHEAD rows on; the values pass 3 will read */
      if (l + j + AHEAD < len) prefetch_l1(k + (l + j + AHEAD) * ks * elem, d * elem);
      prefetch_l2(v + (l + j) * vs * elem, d * elem);
    }
    vec kc[4][C];
    for (int j = 0; j < 4; j++)
      for (int c = 0; c < C; c++) kc[j][c] = vload_kv(k + (l + j) * ks * elem, c * W, dtype);
    for (int64_t g = 0; g < g_count; g++) {
      vec acc[4];
      for (int j = 0; j < 4; j++) {
        acc[j] = vmul(vload(q + g * d), kc[j][0]);
        for (int c = 1; c < C; c++) acc[j] = vfma(vload(q + g * d + c * W), kc[j][c], acc[j]);
      }
      _mm_storeu_ps(scores + g * len + l,
                    _mm_mul_ps(vsum4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(scale)));
    }
  }
  for (; l < len; l++) {
    prefetch_l2(v + l * vs * elem, d * elem);
    vec kc[C];
    for (int c = 0; c < C; c++) kc[c] = vload_kv(k + l * ks * elem, c * W, dtype);
    for (int64_t g = 0; g < g_count; g++) {
      vec acc = vmul(vload(q + g * d), kc[0]);
      for (int c = 1; c < C; c++) acc = vfma(vload(q + g * d + c * W), kc[c], acc);
      scores[g * len + l] = vsum(acc) * scale;
    }
  }
  if (mask) /* masked keys were multiplied like the others (cheaper than branching); drop them */
    for (l = 0; l < len; l++)
      if (!mask[l])
        for (int64_t g = 0; g < g_count; g++) scores[g * len + l] = -INFINITY;
  float* inv = scores + g_count * len;
  softmax_rows(scores, g_count, len, inv);
  /* pass 3 for up to HEADS query heads at a time (N x C accumulators within the registers) */
  constexpr int64_t HEADS = C <= 4 ? 4 : C <= 8 ? 2 : 1;
  for (int64_t g = 0; g < g_count; g += HEADS) {
    const int64_t n = g_count - g < HEADS ? g_count - g : HEADS;
    const char* pf = g == 0 ? next_k : NULL;
#define WEIGH(N) weigh_values<C, N>(scores + g * len, inv + g, v, vs, mask, out + g * d, len, \
                                    dtype, pf, ks)
    if (n >= 4) WEIGH(4);
    else if (n == 3) WEIGH(3);
    else if (n == 2) WEIGH(2);
    else WEIGH(1);
#undef WEIGH
  }
}
#endif

static void attend(const float* q, const char* k, const char* v, int64_t ks, int64_t vs,
                   const uint8_t* mask, float* out, int64_t g_count, int64_t len, int64_t d,
                   float scale, int dtype, float* scores, const char* next_k) {
#ifdef W
#define ATTEND_VEC(c)                                                                         \
  case c:                                                                                     \
    return attend_vec<c>(q, k, v, ks, vs, mask, out, g_count, len, scale, dtype, scores,      \
                         next_k);
  if (d % W == 0) switch (d / W) {
      ATTEND_VEC(1) ATTEND_VEC(2) ATTEND_VEC(3) ATTEND_VEC(4) ATTEND_VEC(5) ATTEND_VEC(6)
      ATTEND_VEC(8) ATTEND_VEC(10) ATTEND_VEC(12) ATTEND_VEC(16)
    }
#undef ATTEND_VEC
#endif
  attend_scalar(q, k, v, ks, vs, mask, out, g_count, len, d, scale, dtype, scores);
}

/* out [B, H, D] fp32 = softmax(q k^T * scale) v per row and head, with q [B, H, D] fp32
 * contiguous, k / v [B, KV, L, D] in `dtype` with element strides (sb, sh, sl) and unit stride
 * along D, mask [B, L] (row stride mask_sb) of 0/1 bytes or NULL. H % KV == 0. Returns 0, or -1
 * when the scratch cannot be allocated (nothing written). */
int decode_attention(const float* q, const void* k, const void* v, int dtype,
                     const int64_t* k_strides, const int64_t* v_strides, const uint8_t* mask,
                     int64_t mask_sb, float* out, int64_t b, int64_t h, int64_t kv, int64_t len,
                     int64_t d, float scale, int threads) {
  const int64_t group = h / kv, tasks = b * kv, elem = dtype == KV_F32 ? 4 : 2;
  if (threads > tasks) threads = (int)tasks;
  if (threads < 1) threads = 1;
  float* scratch = (float*)malloc(sizeof(float) * (size_t)(threads * group * (len + 1)));
  if (!scratch) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tasks; t++) {
    const int64_t row = t / kv, head = t % kv;
    float* scores = scratch + (int64_t)omp_get_thread_num() * group * (len + 1);
    const char* kp = (const char*)k + (row * k_strides[0] + head * k_strides[1]) * elem;
    const char* vp = (const char*)v + (row * v_strides[0] + head * v_strides[1]) * elem;
    const int64_t after = t + 1 < tasks ? t + 1 : t; /* the next pair this thread runs */
    const char* next_k = (const char*)k +
                         ((after / kv) * k_strides[0] + (after % kv) * k_strides[1]) * elem;
    attend(q + (row * h + head * group) * d, kp, vp, k_strides[2], v_strides[2],
           mask ? mask + row * mask_sb : NULL, out + (row * h + head * group) * d, group, len,
           d, scale, dtype, scores, after == t ? NULL : next_k);
  }
  free(scratch);
  return 0;
}

}  // namespace lmforge_kernels::LMFORGE_VARIANT
