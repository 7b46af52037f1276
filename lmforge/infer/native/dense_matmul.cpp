/* Products with the weights as the model stores them (bf16, fp16 or fp32) on a CPU: y[m, n] =
 * sum_k x[m, k] * w[n, k], the weights in the model's own row-major layout (no repacking), with
 * few rows of x (the running rows of a decode step) and, for 16-bit weights, with many (prefill:
 * the blocked GEMM below).
 *
 * Why by hand: decoding reads every weight once a step, so a model decodes at the speed its
 * weights stream from memory. torch's bf16 matmul with one row of activations and oneDNN's fp32
 * GEMM (model/linear.py) at a few rows run well below the read bandwidth (figures:
 * docs/benchmarks.md, `dense_matmul`). The ways here, all summing in fp32 like torch's
 * matmuls (in another order):
 * - bf16 weights and bf16 activations on a CPU with AVX512-BF16 (Zen 4, Cooper Lake, Sapphire
 *   Rapids): vdpbf16ps multiplies 32 pairs into 16 fp32 lanes, one instruction per 32 weights
 *   and no conversion.
 * - otherwise (fp16 weights, fp32 activations, AVX2 CPUs) as llama.cpp's F16 rows: 16 (AVX-512)
 *   or 8 (AVX2 + F16C) weights converted in registers (bf16: widen and shift into a float's top
 *   half; fp16: vcvtph2ps) meet fp32 activations in fused multiply-adds; without AVX2 a loop.
 * - fp32 weights: the same multiply-adds on the weights as loaded.
 * Every row is prefetched PREFETCH_BYTES ahead of the vector being read (once a cache line): with
 * the hardware prefetcher alone the stream fell behind the read bandwidth, for 16-bit weights at
 * one row of x too, and at 8 rows of fp32 weights (8 multiply-adds per weight vector) further.
 *
 * The weights are read one row after another, one stream front to back; each row's vectors of
 * columns in flight go into U accumulators per row of x (a single sum would wait on every add),
 * up to TMAX rows of x share each weight vector loaded, and a row's sums come out of one
 * horizontal add. A row of x is summed in the same order whatever the other rows are, so a
 * sequence's outputs do not depend on the batch it decodes in. (Tiles of 4 weight rows side by
 * side, which would reuse each x vector 4 times, were slower at one row of x: 4 interleaved
 * streams a row apart; x stays in L1 anyway.) OpenMP threads split the rows of
 * weights. */
#include <omp.h>
#include <stdlib.h>

#include <type_traits>

#include "kernels.h"
#include "simd.h"

namespace lmforge_kernels::LMFORGE_VARIANT {

enum { WEIGHTS_BF16 = 0, WEIGHTS_F16 = 1, WEIGHTS_F32 = 2 }; /* kernels.h's w_type */

template <int WT>
using weight_t = std::conditional_t<WT == WEIGHTS_F32, float, uint16_t>;

template <int WT>
static inline float weight_at(const weight_t<WT>* w, int64_t j) { /* element j, as a float */
  if constexpr (WT == WEIGHTS_F32) return w[j];
  else return WT == WEIGHTS_F16 ? half_to_float(w[j]) : bf16_to_float(w[j]);
}

/* prefetch this many bytes ahead of the vector being read (a few rows of the
 * decode layers' 576-4,096 columns) */
#define PREFETCH_BYTES 8192

#ifdef SIMD_WIDTH
#define V SIMD_WIDTH
#define TMAX (V == 16 ? 4 : 2) /* AVX2's 16 registers: 2 rows x 4 accumulators, weights, x */
template <int WT>
static inline vec load_weights(const weight_t<WT>* p) {
  if constexpr (WT == WEIGHTS_F32) return vload(p);
  else return WT == WEIGHTS_F16 ? vload_f16(p) : vload_bf16(p);
}
#else
#define TMAX 4
#endif

/* y[t] (+)= x[t] . w for T rows of x (row stride ldx, y row stride n) and `len` columns of one
 * row of weights, U vectors of columns at a time into U accumulators per row of x (a single sum
 * would wait on each add). Each weight vector loaded serves the T rows of x. fp32 weights are
 * prefetched `pf` elements ahead; `add` adds the sums to y (a later block of columns). */
template <int WT, int T, int U>
static inline void dot_row(const float* x, const weight_t<WT>* w, float* y, int64_t len,
                           int64_t ldx, int64_t n, int64_t pf = 0, bool add = false) {
  int64_t j = 0;
  float sums[T];
#ifdef SIMD_WIDTH
  vec acc[T][U];
  for (int t = 0; t < T; t++)
    for (int u = 0; u < U; u++) acc[t][u] = vset(0.f);
  for (; j + U * V <= len; j += U * V)
    for (int u = 0; u < U; u++) {
      if (pf && (WT == WEIGHTS_F32 || (u * V * 2) % 64 == 0)) /* 16-bit: once a cache line */
        __builtin_prefetch(w + j + u * V + pf, 0, 3);
      const vec wv = load_weights<WT>(w + j + u * V);
      for (int t = 0; t < T; t++)
        acc[t][u] = vfma(vload(x + t * ldx + j + u * V), wv, acc[t][u]);
    }
  for (; j + V <= len; j += V) {
    const vec wv = load_weights<WT>(w + j);
    for (int t = 0; t < T; t++) acc[t][0] = vfma(vload(x + t * ldx + j), wv, acc[t][0]);
  }
  for (int t = 0; t < T; t++) {
    for (int u = 1; u < U; u++) acc[t][0] = vadd(acc[t][0], acc[t][u]);
    sums[t] = vsum(acc[t][0]);
  }
#else
  for (int t = 0; t < T; t++) sums[t] = 0.f;
#endif
  for (; j < len; j++) /* the columns after the last whole vector (all of them without AVX2) */
    for (int t = 0; t < T; t++) sums[t] += x[t * ldx + j] * weight_at<WT>(w, j);
  for (int t = 0; t < T; t++) y[t * n] = add ? y[t * n] + sums[t] : sums[t];
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define BF16_DOT 1
/* The same with bf16 weights and bf16 activations through the bf16 dot product (vdpbf16ps: 32
 * products into 16 fp32 lanes, no conversion). */
static inline __m512bh load_bf16(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512((const void*)p);
}
template <int T, int U>
static inline void dot_row_bf16(const uint16_t* x, const uint16_t* w, float* y, int64_t k,
                                int64_t n) {
  __m512 acc[T][U];
  for (int t = 0; t < T; t++)
    for (int u = 0; u < U; u++) acc[t][u] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 * U <= k; j += 32 * U)
    for (int u = 0; u < U; u++) {
      __builtin_prefetch(w + j + 32 * u + PREFETCH_BYTES / 2, 0, 3);
      const __m512bh wv = load_bf16(w + j + 32 * u);
      for (int t = 0; t < T; t++)
        acc[t][u] = _mm512_dpbf16_ps(acc[t][u], load_bf16(x + t * k + j + 32 * u), wv);
    }
  for (; j + 32 <= k; j += 32) {
    const __m512bh wv = load_bf16(w + j);
    for (int t = 0; t < T; t++)
      acc[t][0] = _mm512_dpbf16_ps(acc[t][0], load_bf16(x + t * k + j), wv);
  }
  for (int t = 0; t < T; t++) {
    for (int u = 1; u < U; u++) acc[t][0] = _mm512_add_ps(acc[t][0], acc[t][u]);
    float s = _mm512_reduce_add_ps(acc[t][0]);
    for (int64_t c = j; c < k; c++)
      s += weight_at<WEIGHTS_BF16>(x + t * k, c) * weight_at<WEIGHTS_BF16>(w, c);
    y[t * n] = s;
  }
}

/* bf16 x, more than BF16_GEMV_ROWS rows (a large batch's decode step): the GEMV above ends every
 * (x row, weight row) pair in a horizontal sum and loads x again for each row of weights, and
 * ran below torch's bf16 GEMM. Here x's rows lie along the lanes instead: x is rearranged once
 * per call into [k / 2][16 rows][2 columns] (zeros past the last row), and per pair of columns
 * each of BF16_TILE rows of weights meets that vector through one vdpbf16ps whose other operand
 * is the weight row's own pair of bf16, broadcast from memory: no horizontal sums, no weight
 * conversion or repacking, BF16_TILE multiply-adds per x vector loaded. Each output sums its
 * column pairs in order in one lane, so a row's result does not depend on the other rows. */
#define BF16_GEMV_ROWS 8
#define BF16_TILE 12 /* rows of weights per tile: 12 accumulators */
static inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t pair;
  __builtin_memcpy(&pair, p, 4);
  return (__m512bh)_mm512_set1_epi32(pair);
}

template <int R>
static inline void bf16_tile(const uint32_t* xt, const uint16_t* w, float* y, int64_t k,
                             int64_t n, int64_t rows) {
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= k; c += 32) {
    for (int r = 0; r < R; r++) __builtin_prefetch(w + r * k + c + 512, 0, 3);
    for (int p = 0; p < 16; p++) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(xt + (c / 2 + p) * 16));
      for (int r = 0; r < R; r++)
        acc[r] = _mm512_dpbf16_ps(acc[r], xv, broadcast_pair(w + r * k + c + 2 * p));
    }
  }
  for (; c < k; c += 2) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(xt + c / 2 * 16));
    for (int r = 0; r < R; r++)
      acc[r] = _mm512_dpbf16_ps(acc[r], xv, broadcast_pair(w + r * k + c));
  }
  alignas(64) float tile[R][16];
  for (int r = 0; r < R; r++) _mm512_store_ps(tile[r], acc[r]);
  for (int64_t i = 0; i < rows; i++)
    for (int r = 0; r < R; r++) y[i * n + r] = tile[r][i];
}

/* y = x w^T for bf16 x (m rows, k even) and bf16 weights: 16 rows of x at a time, the groups of
 * BF16_TILE weight rows split between the threads. Returns -1 when memory runs out. */
static int bf16_rows_times_weights(const uint16_t* x, const uint16_t* w, float* y, int64_t m,
                                   int64_t n, int64_t k, int threads) {
  const size_t bytes = (sizeof(uint32_t) * (size_t)(k / 2 * 16) + 63) / 64 * 64;
  uint32_t* xt = (uint32_t*)aligned_alloc(64, bytes); /* (a size aligned_alloc takes everywhere) */
  if (!xt) return -1;
  for (int64_t i0 = 0; i0 < m; i0 += 16) {
    const int64_t rows = m - i0 < 16 ? m - i0 : 16;
    for (int64_t c = 0; c < k / 2; c++) /* column pair c of row i: one 32-bit lane */
      for (int64_t i = 0; i < 16; i++) {
        uint32_t pair = 0;
        if (i < rows) __builtin_memcpy(&pair, x + (i0 + i) * k + 2 * c, 4);
        xt[c * 16 + i] = pair;
      }
    const int64_t groups = n / BF16_TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++)
      bf16_tile<BF16_TILE>(xt, w + g * BF16_TILE * k, y + i0 * n + g * BF16_TILE, k, n, rows);
    for (int64_t r = groups * BF16_TILE; r < n; r++)
      bf16_tile<1>(xt, w + r * k, y + i0 * n + r, k, n, rows);
  }
  free(xt);
  return 0;
}
#endif

/* One row of weights against every row of x, TMAX rows at a time (x fp32, or bf16 for the bf16
 * dot: XT = uint16_t). */
template <int WT, typename XT>
static void weight_row(const XT* x, const weight_t<WT>* w, float* y, int64_t m, int64_t n,
                       int64_t k) {
  int64_t i = 0;
#ifdef BF16_DOT
  if constexpr (sizeof(XT) == 2) {
    for (; i + TMAX <= m; i += TMAX) dot_row_bf16<TMAX, 4>(x + i * k, w, y + i * n, k, n);
    for (; i < m; i++) dot_row_bf16<1, 4>(x + i * k, w, y + i * n, k, n);
    return;
  }
#endif
  if constexpr (sizeof(XT) == 4) {
    const int64_t pf = PREFETCH_BYTES / (int64_t)sizeof(weight_t<WT>);
    for (; i + TMAX <= m; i += TMAX) dot_row<WT, TMAX, 4>(x + i * k, w, y + i * n, k, k, n, pf);
    for (; i < m; i++) dot_row<WT, 1, 4>(x + i * k, w, y + i * n, k, k, n, pf);
  }
}

/* fp32 weights: at most this many columns at a time, so that a tile's rows of x stay in L1
 * across its rows of weights (with all 1,536 columns of SmolLM2's down projection, 48 KB at 8
 * rows, x came from L2 for each row of weights and the step ran at half the bandwidth) */
#define F32_BLOCK 1024

#if defined(SIMD_WIDTH) && SIMD_WIDTH == 16
/* fp32 weights on AVX-512, any number of rows of x: T rows of x meet R rows of weights, T R
 * multiply-adds for T + R vector loads (each held in a register for its uses; left to itself the
 * compiler reloads it from memory for each). A sum's order is fixed by k alone: two accumulators
 * per (x row, weight row) over alternate vectors of columns (the odd last vector into the first),
 * added, the 16 lanes met in simd.h's vsum4 tree (vsum1: the same tree for one sum), then the
 * scalar tail; so a row's outputs are the same bits in every tile, alone or in a batch. With
 * R = 4 the four sums of a row of x come out of one vsum4 (fewer shuffles than four horizontal
 * sums, one per output). Not the GEMM below with x's rows along the lanes and each weight
 * broadcast: it keeps more multiply-adds busy at 16 rows, but sums each output's columns in
 * order in one lane, and a row alone (the lane sums and vsum tree here, or that order reached
 * through in-register transposes of 16 weight rows, which stream slower from memory at one
 * row) would no longer come out as the same bits in a batch. */
#define F32_TILE_ROWS 3    /* rows of x */
#define F32_TILE_WEIGHTS 4 /* rows of weights: 3 x 4 x 2 accumulators + 4 + 1 of 32 registers */
template <int T, int R>
static inline void f32_tile(const float* x, const float* w, float* y, int64_t len, int64_t k,
                            int64_t n, int64_t pf, bool add) {
  vec acc[T][R][2];
  for (int t = 0; t < T; t++)
    for (int r = 0; r < R; r++) acc[t][r][0] = acc[t][r][1] = vset(0.f);
  int64_t j = 0;
  for (; j + 2 * V <= len; j += 2 * V)
    for (int u = 0; u < 2; u++) {
      vec wv[R];
      for (int r = 0; r < R; r++) {
        if (pf) __builtin_prefetch(w + r * k + j + u * V + pf, 0, 3);
        wv[r] = vload(w + r * k + j + u * V);
        if constexpr (T > 1) asm("" : "+v"(wv[r]));
      }
      for (int t = 0; t < T; t++) {
        vec xv = vload(x + t * k + j + u * V);
        if constexpr (R > 1) asm("" : "+v"(xv));
        for (int r = 0; r < R; r++) acc[t][r][u] = vfma(xv, wv[r], acc[t][r][u]);
      }
    }
  for (; j + V <= len; j += V)
    for (int t = 0; t < T; t++)
      for (int r = 0; r < R; r++)
        acc[t][r][0] = vfma(vload(x + t * k + j), vload(w + r * k + j), acc[t][r][0]);
  for (int t = 0; t < T; t++) {
    float s[R];
    vec sum[R];
    for (int r = 0; r < R; r++) sum[r] = vadd(acc[t][r][0], acc[t][r][1]);
    if constexpr (R == 4) _mm_storeu_ps(s, vsum4(sum[0], sum[1], sum[2], sum[3]));
    else
      for (int r = 0; r < R; r++) s[r] = vsum1(sum[r]);
    for (int r = 0; r < R; r++) {
      for (int64_t c = j; c < len; c++) s[r] += x[t * k + c] * w[r * k + c];
      y[t * n + r] = add ? y[t * n + r] + s[r] : s[r];
    }
  }
}

/* R rows of fp32 weights against every row of x: tiles of T rows, then the rest. */
template <int T, int R>
static void f32_weight_rows(const float* x, const float* w, float* y, int64_t m, int64_t n,
                            int64_t len, int64_t k, int64_t pf, bool add) {
  for (int64_t i = 0; i < m;) {
    const int64_t left = m - i, t = left >= T ? T : left;
    if (t == T) f32_tile<T, R>(x + i * k, w, y + i * n, len, k, n, pf, add);
    else if (t == 3) f32_tile<3, R>(x + i * k, w, y + i * n, len, k, n, pf, add);
    else if (t == 2) f32_tile<2, R>(x + i * k, w, y + i * n, len, k, n, pf, add);
    else f32_tile<1, R>(x + i * k, w, y + i * n, len, k, n, pf, add);
    i += t;
  }
}

/* fp32 weights, a block of columns at a time (F32_BLOCK; equal blocks, whole vectors). Up to
 * F32_STREAM_ROWS rows of x the product waits on the weights streaming in: the rows of weights
 * stream one after another (all the rows of x against one row of weights), each prefetched
 * PREFETCH_BYTES ahead or, with several blocks, two rows ahead at the same columns (two rows
 * read side by side, two interleaved streams, read slower). Above, the multiply-adds set the
 * pace: groups of F32_TILE_WEIGHTS rows of weights, in tiles of F32_TILE_ROWS rows of x, every
 * tile prefetching the next group's rows at the same columns (from the first tile alone, the
 * step ran slower). Threads split the rows of weights. */
#define F32_STREAM_ROWS 4
static void f32_rows_times_weights(const float* x, const float* w, float* y, int64_t m,
                                   int64_t n, int64_t k, int threads) {
  constexpr int R = F32_TILE_WEIGHTS, T = F32_TILE_ROWS;
  const int64_t blocks = (k + F32_BLOCK - 1) / F32_BLOCK;
  const int64_t width = ((k + blocks - 1) / blocks + 31) / 32 * 32;
  const int64_t groups = m > F32_STREAM_ROWS ? n / R : 0;
  const int64_t pf = blocks > 1 ? 2 * k : PREFETCH_BYTES / (int64_t)sizeof(float);
  for (int64_t j0 = 0; j0 < k; j0 += width) {
    const int64_t len = k - j0 < width ? k - j0 : width;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++)
      f32_weight_rows<T, R>(x + j0, w + g * R * k + j0, y + g * R, m, n, len, k, R * k, j0 > 0);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = groups * R; r < n; r++)
      f32_weight_rows<4, 1>(x + j0, w + r * k + j0, y + r, m, n, len, k, pf, j0 > 0);
  }
}
#else
/* `len` columns of one row of fp32 weights against every row of x (row stride k): tiles of 4
 * rows, then 1, with 2 accumulators per row in each (the same U everywhere, and blocks of columns
 * set by k alone: a row's sum runs in one order in any batch). */
static void f32_weight_row(const float* x, const float* w, float* y, int64_t m, int64_t n,
                           int64_t len, int64_t k, int64_t pf, bool add) {
  constexpr int F = WEIGHTS_F32;
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) dot_row<F, 4, 2>(x + i * k, w, y + i * n, len, k, n, pf, add);
  for (; i < m; i++) dot_row<F, 1, 2>(x + i * k, w, y + i * n, len, k, n, pf, add);
}

/* fp32 weights, a block of columns at a time (F32_BLOCK; equal blocks, whole vectors): within a
 * block the rows of weights stream one after another, each prefetched PREFETCH_BYTES ahead, or,
 * with several blocks, two rows ahead at the same columns. */
static void f32_rows_times_weights(const float* x, const float* w, float* y, int64_t m,
                                   int64_t n, int64_t k, int threads) {
  const int64_t blocks = (k + F32_BLOCK - 1) / F32_BLOCK;
  const int64_t width = ((k + blocks - 1) / blocks + 31) / 32 * 32;
  const int64_t pf = blocks > 1 ? 2 * k : PREFETCH_BYTES / (int64_t)sizeof(float);
  for (int64_t j0 = 0; j0 < k; j0 += width) {
    const int64_t len = k - j0 < width ? k - j0 : width;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++)
      f32_weight_row(x + j0, w + r * k + j0, y + r, m, n, len, k, pf, j0 > 0);
  }
}
#endif

/* Every row of weights against x, one after another (the header says why). */
template <int WT, typename XT>
static void rows_times_weights(const XT* x, const weight_t<WT>* w, float* y, int64_t m,
                               int64_t n, int64_t k, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < n; r++) weight_row<WT>(x, w + r * k, y + r, m, n, k);
}

/* ---- many rows (prefill, large batches): a blocked GEMM ------------------------------------ */
/* Above GEMV_ROWS rows of x the products are compute-bound, and the GEMV, which converts every
 * weight again for each tile of x rows and ends every (row, weight row) pair in a horizontal sum,
 * falls far behind the multiply-add units. So, as BLIS's and llama.cpp's tinyBLAS micro-kernels
 * do, a tile of WR rows of weights times XR = XV vectors of x rows (2, or 1 up to one vector's
 * rows) stays in WR x XV accumulators over a block of KC columns: per column, XV vector loads
 * of x (transposed once per call into [KC][XR]: rows of x along the lanes), and per row of
 * weights one broadcast of its fp32 value into XV multiply-adds. The weights' block of columns
 * is converted to fp32 once per call into a per-thread buffer of WR rows (fp16: vcvtph2ps, bf16:
 * a shift; exact, as in the GEMV), prefetching the next group's rows meanwhile (with few rows of
 * x the conversion waited on memory), and serves every tile of x rows. Each output is one sum
 * over k in column order (blocks of KC in turn), whatever the number of rows and XV: a row's
 * result does not depend on its batch here either. */
#define GEMV_ROWS 10 /* up to here the GEMV (memory-bound), above it the GEMM (compute-bound) */
#ifdef SIMD_WIDTH
#define WR (V == 16 ? 12 : 6) /* rows of weights per tile: 24 of 32 / 12 of 16 registers */
#define KC 768 /* at most this many columns per block: the weight buffer, WR x KC fp32, in L1 */
#define MC 256 /* rows of x per pass: their transposed block, KC x MC fp32, in L2 */

/* y[i * n + r] (+)= x block [kc][XR] times weight rows wb [WR][kc], for the `rows` valid rows
 * of x and `wrows` valid rows of weights */
template <int XV>
static inline void gemm_tile(const float* xt, const float* wb, int64_t kc, float* y, int64_t n,
                             int64_t rows, int64_t wrows, bool add) {
  constexpr int XR = XV * V;
  vec acc[WR][XV];
  for (int r = 0; r < WR; r++)
    for (int v = 0; v < XV; v++) acc[r][v] = vset(0.f);
  for (int64_t c = 0; c < kc; c++) {
    vec xv[XV];
    for (int v = 0; v < XV; v++) xv[v] = vload(xt + c * XR + v * V);
    for (int r = 0; r < WR; r++) {
      const vec b = vset(wb[r * kc + c]);
      for (int v = 0; v < XV; v++) acc[r][v] = vfma(xv[v], b, acc[r][v]);
    }
  }
  alignas(64) float tile[WR][XR];
  for (int r = 0; r < WR; r++)
    for (int v = 0; v < XV; v++) vstore(tile[r] + v * V, acc[r][v]);
  for (int64_t i = 0; i < rows; i++)
    for (int64_t r = 0; r < wrows; r++) y[i * n + r] = add ? y[i * n + r] + tile[r][i] : tile[r][i];
}

/* The GEMM: MC rows of x at a time, KC columns at a time (equal blocks); within, the groups of WR
 * weight rows are split between the threads, each converting its group's block into its buffer
 * and running it against every tile of XR rows of x. */
template <int WT, int XV>
static int gemm(const float* x, const uint16_t* w, float* y, int64_t m, int64_t n, int64_t k,
                int threads) {
  constexpr int XR = XV * V;
  const int64_t blocks = (k + KC - 1) / KC, width = (k + blocks - 1) / blocks;
  const int64_t mc = m < MC ? (m + XR - 1) / XR * XR : MC;
  float* xt = (float*)aligned_alloc(64, sizeof(float) * (size_t)(width * mc));
  const size_t wbytes = (sizeof(float) * (size_t)(threads * WR * width) + 63) / 64 * 64;
  float* wbuf = (float*)aligned_alloc(64, wbytes); /* (a size aligned_alloc takes everywhere) */
  if (!xt || !wbuf) {
    free(xt);
    free(wbuf);
    return -1;
  }
  for (int64_t i0 = 0; i0 < m; i0 += mc) {
    const int64_t rows = m - i0 < mc ? m - i0 : mc;
    for (int64_t c0 = 0; c0 < k; c0 += width) {
      const int64_t kc = k - c0 < width ? k - c0 : width;
      /* x's block transposed per tile of XR rows: [tile][column][XR], zeros past the last row */
      for (int64_t t = 0; t < rows; t += XR)
        for (int64_t i = 0; i < XR; i++)
          for (int64_t c = 0; c < kc; c++)
            xt[t * kc + c * XR + i] = t + i < rows ? x[(i0 + t + i) * k + c0 + c] : 0.f;
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t r0 = 0; r0 < n; r0 += WR) {
        const int64_t wrows = n - r0 < WR ? n - r0 : WR;
        float* wb = wbuf + (int64_t)omp_get_thread_num() * WR * width;
        for (int64_t r = 0; r < WR; r++) { /* zeros for the rows past the last */
          const uint16_t* src = w + (r0 + r) * k + c0;
          int64_t c = 0;
          if (r < wrows)
            for (; c + V <= kc; c += V) {
              if ((c * 2) % 64 == 0) __builtin_prefetch(src + c + WR * k, 0, 3); /* next group */
              vstore(wb + r * kc + c, load_weights<WT>(src + c));
            }
          for (; c < kc; c++) wb[r * kc + c] = r < wrows ? weight_at<WT>(src, c) : 0.f;
        }
        for (int64_t t = 0; t < rows; t += XR)
          gemm_tile<XV>(xt + t * kc, wb, kc, y + (i0 + t) * n + r0, n, rows - t < XR ? rows - t : XR,
                    wrows, c0 > 0);
      }
    }
  }
  free(xt);
  free(wbuf);
  return 0;
}
#endif

/* y [m, n] fp32 = x [m, k] times w [n, k]^T, both contiguous: w bf16, fp16 or fp32 (`w_type`
 * 0, 1, 2), x fp32 or bf16 (`x_bf16`). Returns 0, or -1 when memory runs out (nothing
 * written). */
int dense_matmul(const void* x, int x_bf16, const void* w, int w_type, float* y, int64_t m,
                 int64_t n, int64_t k, int threads) {
#ifdef BF16_DOT
  if (x_bf16 && w_type == WEIGHTS_BF16) {
    if (m > BF16_GEMV_ROWS && k % 2 == 0)
      return bf16_rows_times_weights((const uint16_t*)x, (const uint16_t*)w, y, m, n, k, threads);
    rows_times_weights<WEIGHTS_BF16>((const uint16_t*)x, (const uint16_t*)w, y, m, n, k,
                                     threads);
    return 0;
  }
#endif
  const float* xf = (const float*)x;
  float* widened = NULL;
  if (x_bf16) { /* no bf16 dot here (or other weights): the activations in fp32 */
    widened = (float*)malloc(sizeof(float) * (size_t)(m * k) + 1);
    if (!widened) return -1;
    const uint16_t* xb = (const uint16_t*)x;
    for (int64_t i = 0; i < m * k; i++) widened[i] = bf16_to_float(xb[i]);
    xf = widened;
  }
  int status = 0;
#ifdef SIMD_WIDTH
  if (m > GEMV_ROWS && w_type != WEIGHTS_F32)
    status = (w_type == WEIGHTS_F16 ? m > V ? gemm<WEIGHTS_F16, 2> : gemm<WEIGHTS_F16, 1>
                                    : m > V ? gemm<WEIGHTS_BF16, 2> : gemm<WEIGHTS_BF16, 1>)(
        xf, (const uint16_t*)w, y, m, n, k, threads);
  else
#endif
  if (w_type == WEIGHTS_F32) f32_rows_times_weights(xf, (const float*)w, y, m, n, k, threads);
  else if (w_type == WEIGHTS_F16)
    rows_times_weights<WEIGHTS_F16>(xf, (const uint16_t*)w, y, m, n, k, threads);
  else rows_times_weights<WEIGHTS_BF16>(xf, (const uint16_t*)w, y, m, n, k, threads);
  free(widened);
  return status;
}

}  // namespace lmforge_kernels::LMFORGE_VARIANT
