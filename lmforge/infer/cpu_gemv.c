/* Few-row products with int8 or int4 weights on a CPU: y[m, n] = sum_k x[m, k] * w[n, k].
 *
 * Why by hand: decoding one token reads every weight once, so a step runs at the speed the
 * weights stream from memory. torch's int8 GEMV (`_weight_int8pack_mm`) and an fp32 GEMV convert
 * every weight to float before multiplying: 3 vector ops per 16 weights, which on one Zen 4 core
 * capped them at 6-10 GB/s against ~20 GB/s of read bandwidth (issue 19). This file does what
 * llama.cpp does for Q8_0: the activations are quantised to int8 per block of 32 (one scale per
 * block: absmax / 127), and weights and activations are multiplied as integers, 32 or 64 products
 * per instruction (AVX512-VNNI / AVX-VNNI `vpdpbusd`, or AVX2 `vpmaddubsw`), with one float
 * multiply-add per block.
 *
 * vpdpbusd multiplies unsigned by signed bytes. The weights are flipped to unsigned in a register
 * (w ^ 0x80 = w + 128), so sum_k (w + 128) q = sum_k w q + 128 sum_k q, and the second term,
 * which depends on the activations only, is subtracted once per row of x (`offset` below).
 * vpmaddubsw saturates 16-bit pair sums, so the AVX2 path instead multiplies |q| by w with q's
 * sign (llama.cpp's trick): |pair| <= 2 * 127 * 127 < 32768.
 *
 * int4 (lmforge_gemv_int4) is group-wise like llama.cpp's Q4_1: per group of 32 weights a scale d
 * and an offset m (fp16), w = q d + m with codes q in 0..15, and byte j of a group holding
 * columns j (low nibble) and j + 16 (high nibble). Codes are unsigned already, so vpdpbusd and
 * vpmaddubsw take them as they are; y = sum_g d_g sx_g dot(q_g, xq_g) + sum_g m_g sum(x_g).
 *
 * Built at first use by lmforge/infer/cpu_gemv.py with the machine's compiler and -march=native,
 * so each CPU gets its own instructions, into a torch extension (cpu_gemv_ops.cpp registers the
 * functions below as torch ops, so the compiled decode step can call them too); a machine
 * without a compiler keeps torch's kernels. OpenMP threads split the output rows.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#ifdef __cplusplus /* torch's extension builder compiles this file as C++ */
extern "C" {
#endif

#define BLOCK 32 /* activation values sharing one scale */
#define ROWS 4   /* output rows a thread takes at a time; prefetching runs ROWS rows ahead */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KERNEL "avx512-vnni"
#elif defined(__AVXVNNI__)
#define KERNEL "avx-vnni"
#elif defined(__AVX2__)
#define KERNEL "avx2"
#else
#define KERNEL "portable"
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VNNI512 1
#endif

/* IEEE half -> float (F16C where the CPU has it) */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);
  else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13);
  else if (man == 0) bits = sign;
  else { /* subnormal: normalise */
    exp = 113;
    while (!(man & 0x400)) { man <<= 1; exp--; }
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
#endif
}

#if defined(__AVX2__)
static inline float hsum256(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}
#endif

const char* lmforge_gemv_kernel(void) { return KERNEL; }

/* x [k] -> q [k] int8 and one scale per block of 32; returns 128 * sum_b scale_b * sum(q_b). */
static float quantize_row(const float* x, int8_t* q, float* scale, int64_t k) {
  float offset = 0.f;
  for (int64_t b = 0; b < k / BLOCK; b++) {
    const float* xb = x + b * BLOCK;
    float amax = 0.f;
    for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
    float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < BLOCK; i++) {
      int32_t v = (int32_t)lrintf(xb[i] * inv);
      q[b * BLOCK + i] = (int8_t)v;
      sum += v;
    }
    scale[b] = d;
    offset += 128.f * d * (float)sum;
  }
  return offset;
}

/* sum_b scale_b * sum_{i in b} u_i q_i over one weight row, u = w + 128 (see the header). */
static inline float dot_row(const int8_t* w, const int8_t* q, const float* scale, int64_t k) {
#if defined(VNNI512)
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  __m512 acc = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 64 <= k; c += 64) { /* two blocks: lanes 0-7 the first, 8-15 the second */
    __m512i u = _mm512_xor_si512(_mm512_loadu_si512((const void*)(w + c)), flip);
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u,
                                    _mm512_loadu_si512((const void*)(q + c)));
    __m512 d = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(scale[c / BLOCK])),
                                  _mm256_set1_ps(scale[c / BLOCK + 1]), 1);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc);
  }
  float total = _mm512_reduce_add_ps(acc);
  if (c < k) { /* one block of 32 left */
    __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + c)),
                                 _mm256_set1_epi8((char)0x80));
    __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u,
                                    _mm256_loadu_si256((const __m256i*)(q + c)));
    total += hsum256(_mm256_cvtepi32_ps(s)) * scale[c / BLOCK];
  }
  return total;
#elif defined(__AVXVNNI__) || defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (int64_t c = 0; c < k; c += BLOCK) {
    __m256i wv = _mm256_loadu_si256((const __m256i*)(w + c));
    __m256i qv = _mm256_loadu_si256((const __m256i*)(q + c));
#if defined(__AVXVNNI__)
    __m256i u = _mm256_xor_si256(wv, _mm256_set1_epi8((char)0x80));
    __m256i s = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, qv);
#else /* |q| * (w with q's sign), pairs summed in 16 bits, then in 32 */
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(qv, qv), _mm256_sign_epi8(wv, qv));
    __m256i s = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(scale[c / BLOCK]), acc);
  }
  return hsum256(acc);
#else
  float total = 0.f;
  for (int64_t b = 0; b < k / BLOCK; b++) {
    int32_t s = 0;
    for (int i = 0; i < BLOCK; i++) s += ((int32_t)w[b * BLOCK + i] + 128) * q[b * BLOCK + i];
    total += scale[b] * (float)s;
  }
  return total;
#endif
}

/* The signed-weights form of dot_row's result: the AVX2 path multiplies signed weights directly,
 * the others add 128 to every weight and subtract the activations' share once per row. */
#if !defined(VNNI512) && !defined(__AVXVNNI__) && defined(__AVX2__)
#define SIGNED_WEIGHTS 1
#else
#define SIGNED_WEIGHTS 0
#endif

/* y [m, n] (fp32) = x [m, k] (fp32) times int8 w [n, k] scaled per output row; k % 32 == 0.
 * Returns 0, or -1 when k is not a multiple of 32 or memory runs out (nothing written). */
int lmforge_gemv_int8(const float* x, const int8_t* w, const float* w_scale, float* y,
                      int64_t m, int64_t n, int64_t k, int threads) {
  if (k % BLOCK != 0 || m <= 0) return -1;
  int8_t* q = (int8_t*)malloc((size_t)(m * k));
  float* x_scale = (float*)malloc(sizeof(float) * (size_t)(m * (k / BLOCK) + m));
  if (!q || !x_scale) { free(q); free(x_scale); return -1; }
  float* offset = x_scale + m * (k / BLOCK);
  for (int64_t i = 0; i < m; i++) {
    offset[i] = quantize_row(x + i * k, q + i * k, x_scale + i * (k / BLOCK), k);
    if (SIGNED_WEIGHTS) offset[i] = 0.f;
  }
  int64_t blocks = (n + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    int64_t r0 = b * ROWS, r1 = r0 + ROWS < n ? r0 + ROWS : n;
    for (int64_t r = r0; r < r1; r++) {
      const int8_t* wr = w + r * k;
#if defined(__x86_64__) || defined(_M_X64)
      /* the rows ROWS ahead: the hardware prefetcher misses these short interleaved streams */
      for (int64_t c = 0; c < k && r + ROWS < n; c += 64)
        _mm_prefetch((const char*)(wr + ROWS * k + c), _MM_HINT_T0);
#endif
      for (int64_t i = 0; i < m; i++)
        y[i * n + r] = w_scale[r] * (dot_row(wr, q + i * k, x_scale + i * (k / BLOCK), k) -
                                     offset[i]);
    }
  }
  free(q);
  free(x_scale);
  return 0;
}

/* ds[g] = d_g sx_g for one row's groups; returns sum_g m_g sum(x_g) (the offsets' share) */
static inline float row_scales(const uint16_t* d, const uint16_t* offset, const float* x_scale,
                               const float* x_sum, float* ds, int64_t groups) {
  int64_t g = 0;
  float shift = 0.f;
#if defined(__F16C__) && defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; g + 8 <= groups; g += 8) {
    __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d + g)));
    _mm256_storeu_ps(ds + g, _mm256_mul_ps(dv, _mm256_loadu_ps(x_scale + g)));
    __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(offset + g)));
    acc = _mm256_fmadd_ps(mv, _mm256_loadu_ps(x_sum + g), acc);
  }
  shift = hsum256(acc);
#endif
  for (; g < groups; g++) {
    ds[g] = half_to_float(d[g]) * x_scale[g];
    shift += half_to_float(offset[g]) * x_sum[g];
  }
  return shift;
}

/* sum_g ds_g dot(q_g, xq_g) over one int4 row (k / 2 bytes of codes, G = k / 32 groups) */
static inline float dot_row_int4(const uint8_t* codes, const float* ds, const int8_t* q,
                                 int64_t groups) {
  float total = 0.f;
  int64_t g = 0;
#if defined(VNNI512)
  const __m256i low = _mm256_set1_epi8(0x0f);
  __m512 acc = _mm512_setzero_ps();
  for (; g + 2 <= groups; g += 2) { /* two groups: 32 bytes of codes, 64 products */
    __m256i c = _mm256_loadu_si256((const __m256i*)(codes + g * 16));
    __m256i lo = _mm256_and_si256(c, low), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
    __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); /* lo0 lo1 hi0 hi1 */
    u = _mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 2, 0));           /* lo0 hi0 lo1 hi1 */
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u,
                                    _mm512_loadu_si512((const void*)(q + g * BLOCK)));
    __m512 sc = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_broadcast_ss(ds + g)),
                                   _mm256_broadcast_ss(ds + g + 1), 1);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc);
  }
  total = _mm512_reduce_add_ps(acc);
#endif
#if defined(__AVX2__)
  const __m128i low4 = _mm_set1_epi8(0x0f);
  __m256 acc8 = _mm256_setzero_ps();
  for (; g < groups; g++) { /* one group: 16 bytes of codes, 32 products */
    __m128i c = _mm_loadu_si128((const __m128i*)(codes + g * 16));
    __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(c, 4), low4),
                                 _mm_and_si128(c, low4));
    __m256i qv = _mm256_loadu_si256((const __m256i*)(q + g * BLOCK));
#if defined(VNNI512)
    __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, qv);
#elif defined(__AVXVNNI__)
    __m256i s = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, qv);
#else /* codes <= 15: pair sums stay far below 16-bit saturation */
    __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(u, qv), _mm256_set1_epi16(1));
#endif
    acc8 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(ds + g), acc8);
  }
  total += hsum256(acc8);
#else
  for (; g < groups; g++) {
    int32_t s = 0;
    for (int i = 0; i < 16; i++)
      s += (codes[g * 16 + i] & 15) * q[g * BLOCK + i] +
           (codes[g * 16 + i] >> 4) * q[g * BLOCK + 16 + i];
    total += ds[g] * (float)s;
  }
#endif
  return total;
}

/* y [m, n] (fp32) = x [m, k] (fp32) times int4 codes [n, k / 2] with fp16 scales d and offsets
 * `offset` [n, k / 32] (w = q d + m); k % 32 == 0. Returns 0, or -1 (nothing written). */
int lmforge_gemv_int4(const float* x, const uint8_t* codes, const uint16_t* d,
                      const uint16_t* offset, float* y, int64_t m, int64_t n, int64_t k,
                      int threads) {
  if (k % BLOCK != 0 || m <= 0) return -1;
  int64_t groups = k / BLOCK;
  int8_t* q = (int8_t*)malloc((size_t)(m * k));
  float* x_scale = (float*)malloc(sizeof(float) * (size_t)(2 * m * groups));
  if (!q || !x_scale) { free(q); free(x_scale); return -1; }
  float* x_sum = x_scale + m * groups; /* the float sums of x per group, for the offsets */
  for (int64_t i = 0; i < m; i++) {
    quantize_row(x + i * k, q + i * k, x_scale + i * groups, k);
    for (int64_t g = 0; g < groups; g++) {
      float s = 0.f;
      for (int j = 0; j < BLOCK; j++) s += x[i * k + g * BLOCK + j];
      x_sum[i * groups + g] = s;
    }
  }
  int64_t blocks = (n + ROWS - 1) / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    int64_t r0 = b * ROWS, r1 = r0 + ROWS < n ? r0 + ROWS : n;
    for (int64_t r = r0; r < r1; r++) {
      const uint8_t* cr = codes + r * (k / 2);
#if defined(__x86_64__) || defined(_M_X64)
      for (int64_t c = 0; c < k / 2 && r + ROWS < n; c += 64)
        _mm_prefetch((const char*)(cr + ROWS * (k / 2) + c), _MM_HINT_T0);
#endif
      for (int64_t i = 0; i < m; i++) {
        float ds[groups]; /* k / 32 floats */
        float shift = row_scales(d + r * groups, offset + r * groups, x_scale + i * groups,
                                 x_sum + i * groups, ds, groups);
        y[i * n + r] = dot_row_int4(cr, ds, q + i * k, groups) + shift;
      }
    }
  }
  free(q);
  free(x_scale);
  return 0;
}

/* w = q d + m for rows [n, k] of int4 codes, written as fp32, or as bf16 (round to nearest
 * even) when `bf16`: the weights the prefill GEMM multiplies by, a chunk of rows at a time. */
void lmforge_dequant_int4(const uint8_t* codes, const uint16_t* d, const uint16_t* offset,
                          void* out, int64_t n, int64_t k, int bf16, int threads) {
  const int64_t groups = k / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < n; r++) {
    float row[k]; /* one row in fp32, then stored */
    for (int64_t g = 0; g < groups; g++) {
      const float dg = half_to_float(d[r * groups + g]), mg = half_to_float(offset[r * groups + g]);
      const uint8_t* c = codes + r * (k / 2) + g * 16;
      float* w = row + g * BLOCK;
      for (int j = 0; j < 16; j++) {
        w[j] = (float)(c[j] & 15) * dg + mg;
        w[16 + j] = (float)(c[j] >> 4) * dg + mg;
      }
    }
    if (bf16) {
      uint16_t* o = (uint16_t*)out + r * k;
      for (int64_t j = 0; j < k; j++) {
        uint32_t bits;
        memcpy(&bits, &row[j], 4);
        o[j] = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
      }
    } else {
      memcpy((float*)out + r * k, row, sizeof(float) * (size_t)k);
    }
  }
}

#ifdef __cplusplus
}
#endif
