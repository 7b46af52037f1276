/* Causal prefill attention on a CPU: T queries per row and head over the same T keys.
 *
 * Why by hand: torch's CPU flash attention took ~480 us per SmolLM2 layer at 128 tokens (one
 * prompt, 9 query and 3 KV heads of 64) at one thread, 13-15% of a BF16 prefill. Here the query
 * heads that share a KV head (GQA) run against one transposed copy of its keys, and the products
 * are register-tiled like a GEMM: 4 query rows x 4 vectors of keys for the scores, 4 rows x up to
 * 4 vectors of the head for the weighted values, only over the keys a row sees.
 *
 * Pass 1 transposes each (row, KV head)'s keys into kt [D, S padded to 4 vectors] (zeros past
 * S); pass 2 splits (row, KV head, block of BLOCK positions) into tasks, longest first: a task's
 * query rows are ordered (position, head of the group), so 4 consecutive ones span at most two
 * positions and share nearly all their keys. Per tile of 4 rows: scores q.kt, softmax per row over
 * its keys (simd.h's vexp; unnormalised, the sum's inverse scales the output), then p.v. fp32
 * throughout; results match torch's SDPA to float rounding (tests/infer/test_cpu_kernels.py).
 * head_dim a multiple of the vector width takes the vector loops, else the scalar ones.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd.h"

namespace lmforge_kernels::LMFORGE_VARIANT {

enum { BLOCK = 16, ROWS = 4 };

#ifdef SIMD_WIDTH
#define W SIMD_WIDTH
#define KEYS (4 * W) /* keys per score tile */
#else
#define KEYS 16
#endif

/* Softmax of one row's n visible scores (times `scale`) in place, unnormalised (simd.h), zeros
 * on [n, upto); returns 1 / sum. */
static float softmax_row(float* s, int64_t n, int64_t upto, float scale) {
  const float inv = softmax_unnormalised(s, n, scale);
  for (int64_t l = n; l < upto; l++) s[l] = 0.f;
  return inv;
}

#ifdef W
/* scores[r][j0..j0 + KEYS) = q_r . kt[:, j0..] for 4 query rows (pointers q[r], unit stride) */
static inline void score_tile(const float* const* q, const float* kt, int64_t ld, int64_t d,
                              float* scores, int64_t sld, int64_t j0) {
  vec acc[ROWS][4];
  for (int r = 0; r < ROWS; r++)
    for (int v = 0; v < 4; v++) acc[r][v] = vset(0.f);
  for (int64_t c = 0; c < d; c++) {
    const float* k = kt + c * ld + j0;
    const vec k0 = vload(k), k1 = vload(k + W), k2 = vload(k + 2 * W), k3 = vload(k + 3 * W);
    for (int r = 0; r < ROWS; r++) {
      const vec x = vset(q[r][c]);
      acc[r][0] = vfma(x, k0, acc[r][0]);
      acc[r][1] = vfma(x, k1, acc[r][1]);
      acc[r][2] = vfma(x, k2, acc[r][2]);
      acc[r][3] = vfma(x, k3, acc[r][3]);
    }
  }
  for (int r = 0; r < ROWS; r++)
    for (int v = 0; v < 4; v++) vstore(scores + r * sld + j0 + v * W, acc[r][v]);
}

/* out[r][c0..c0 + N W) = inv[r] sum_{j < len} p[r][j] v_j[c0..] for 4 rows */
template <int N>
static inline void value_tile(const float* p, int64_t sld, const float* v, int64_t vs,
                              int64_t len, int64_t c0, const float* inv, float* const* out) {
  vec acc[ROWS][N];
  for (int r = 0; r < ROWS; r++)
    for (int n = 0; n < N; n++) acc[r][n] = vset(0.f);
  for (int64_t j = 0; j < len; j++) {
    vec x[N];
    for (int n = 0; n < N; n++) x[n] = vload(v + j * vs + c0 + n * W);
    for (int r = 0; r < ROWS; r++) {
      const vec pr = vset(p[r * sld + j]);
      for (int n = 0; n < N; n++) acc[r][n] = vfma(pr, x[n], acc[r][n]);
    }
  }
  for (int r = 0; r < ROWS; r++)
    if (out[r])
      for (int n = 0; n < N; n++) vstore(out[r] + c0 + n * W, vmul(acc[r][n], vset(inv[r])));
}
#endif

/* out [B, H, T, D] fp32 (element strides os) = causal softmax(q k^T scale) v, with q [B, H, T,
 * D] (strides qs), k / v [B, KV, T, D] (strides ks / vs), all fp32 with unit stride along D;
 * query position i sees keys 0..i. H % KV == 0. Returns 0, or -1 when the scratch cannot be
 * allocated (nothing written). */
int prefill_attention(const float* q, const float* k, const float* v, const int64_t* qs,
                      const int64_t* ks, const int64_t* vs, float* out, const int64_t* os,
                      int64_t b, int64_t h, int64_t kv, int64_t t, int64_t d, float scale,
                      int threads) {
  const int64_t group = h / kv, pairs = b * kv, blocks = (t + BLOCK - 1) / BLOCK;
  const int64_t ld = (t + KEYS - 1) / KEYS * KEYS, tasks = pairs * blocks;
  if (threads > tasks) threads = (int)tasks;
  if (threads < 1) threads = 1;
  float* kt = (float*)malloc(sizeof(float) * (size_t)(pairs * d * ld));
  float* scratch = (float*)malloc(sizeof(float) * (size_t)(threads * ROWS * ld));
  if (!kt || !scratch) {
    free(kt);
    free(scratch);
    return -1;
  }
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
      const float* kp = k + (p / kv) * ks[0] + (p % kv) * ks[1];
      float* dst = kt + p * d * ld;
      for (int64_t c = 0; c < d; c++)
        for (int64_t j = 0; j < ld; j++) dst[c * ld + j] = j < t ? kp[j * ks[2] + c] : 0.f;
    }
    float* scores = scratch + (int64_t)omp_get_thread_num() * ROWS * ld;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; task++) {
      /* the last blocks (the most keys) first */
      const int64_t blk = blocks - 1 - task / pairs, p = task % pairs;
      const int64_t row = p / kv, head = p % kv;
      const int64_t lo = blk * BLOCK * group, hi = (blk * BLOCK + BLOCK < t ? blk * BLOCK + BLOCK : t) * group;
      const float* kp = kt + p * d * ld;
      const float* vp = v + row * vs[0] + head * vs[1];
      for (int64_t r0 = lo; r0 < hi; r0 += ROWS) {
        const float* qr[ROWS];
        float* orow[ROWS];
        int64_t n[ROWS];
        for (int r = 0; r < ROWS; r++) {
          const int64_t rr = r0 + r < hi ? r0 + r : r0; /* past the block: row r0 again */
          const int64_t pos = rr / group, hd = head * group + rr % group;
          qr[r] = q + row * qs[0] + hd * qs[1] + pos * qs[2];
          orow[r] = r0 + r < hi ? out + row * os[0] + hd * os[1] + pos * os[2] : NULL;
          n[r] = pos + 1;
        }
        int64_t len = 0; /* the keys the tile sees */
        for (int r = 0; r < ROWS; r++) len = n[r] > len ? n[r] : len;
        const int64_t upto = (len + KEYS - 1) / KEYS * KEYS;
        float inv[ROWS];
#ifdef W
        if (d % W == 0) {
          for (int64_t j0 = 0; j0 < upto; j0 += KEYS) score_tile(qr, kp, ld, d, scores, ld, j0);
          for (int r = 0; r < ROWS; r++) inv[r] = softmax_row(scores + r * ld, n[r], len, scale);
          int64_t c0 = 0;
          for (; c0 + 4 * W <= d; c0 += 4 * W) value_tile<4>(scores, ld, vp, vs[2], len, c0, inv, orow);
          switch ((d - c0) / W) {
            case 3: value_tile<3>(scores, ld, vp, vs[2], len, c0, inv, orow); break;
            case 2: value_tile<2>(scores, ld, vp, vs[2], len, c0, inv, orow); break;
            case 1: value_tile<1>(scores, ld, vp, vs[2], len, c0, inv, orow); break;
          }
          continue;
        }
#endif
        for (int r = 0; r < ROWS; r++) {
          float* s = scores + r * ld;
          for (int64_t j = 0; j < n[r]; j++) {
            float acc = 0.f;
            for (int64_t c = 0; c < d; c++) acc += qr[r][c] * kp[c * ld + j];
            s[j] = acc;
          }
          inv[r] = softmax_row(s, n[r], n[r], scale);
          if (!orow[r]) continue;
          for (int64_t c = 0; c < d; c++) orow[r][c] = 0.f;
          for (int64_t j = 0; j < n[r]; j++)
            for (int64_t c = 0; c < d; c++) orow[r][c] += s[j] * vp[j * vs[2] + c];
          for (int64_t c = 0; c < d; c++) orow[r][c] *= inv[r];
        }
      }
    }
  }
  free(kt);
  free(scratch);
  return 0;
}

}  // namespace lmforge_kernels::LMFORGE_VARIANT
