/* The one SIMD mapping of the native kernels (quantized_matmul.cpp, dense_matmul.cpp,
 * decode_attention.cpp): scalar 16-bit float conversions, and a float vector `vec` of SIMD_WIDTH
 * lanes with the operations the kernels use, mapped onto the instruction set this variant is
 * compiled for (AVX-512: 16 lanes; AVX2 + FMA + F16C: 8; otherwise SIMD_WIDTH is undefined and
 * the kernels take their scalar loops). As llama.cpp's ggml-cpu/simd-mappings.h does, so that a
 * kernel is written once for every width. Each variant is one compilation with its own -m flags
 * (cpu_kernels.py). */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

/* ---- scalars -------------------------------------------------------------------------------- */
static inline float half_to_float(uint16_t h) { /* IEEE half: F16C where present, else bits */
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

static inline float bf16_to_float(uint16_t h) { /* bf16: the top half of a float */
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even */
  uint32_t bits;
  memcpy(&bits, &f, 4);
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#if defined(__AVX2__)
static inline float sum256(__m256 a) { /* the sum of 8 floats */
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
/* the sums of four 8-float vectors, as one 4-float vector */
static inline __m128 sum4x256(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

/* ---- the float vector ----------------------------------------------------------------------- */
/* The operations both widths spell alike, from the intrinsics' prefix P (_mm512 / _mm256), the
 * integer vector's suffix SI (si512 / si256) and HALF, the load of SIMD_WIDTH 16-bit values. */
#define SIMD_OPS(P, SI, HALF)                                                                \
  static inline vec vload(const float* p) { return P##_loadu_ps(p); }                       \
  static inline vec vload_f16(const uint16_t* p) { return P##_cvtph_ps(HALF(p)); }          \
  static inline vec vload_bf16(const uint16_t* p) { /* bf16: a float's top half */          \
    return P##_castsi##SI##_ps(P##_slli_epi32(P##_cvtepu16_epi32(HALF(p)), 16));             \
  }                                                                                         \
  static inline void vstore(float* p, vec a) { P##_storeu_ps(p, a); }                       \
  static inline vec vset(float x) { return P##_set1_ps(x); }                                \
  static inline vec vadd(vec a, vec b) { return P##_add_ps(a, b); }                         \
  static inline vec vsub(vec a, vec b) { return P##_sub_ps(a, b); }                         \
  static inline vec vmul(vec a, vec b) { return P##_mul_ps(a, b); }                         \
  static inline vec vdiv(vec a, vec b) { return P##_div_ps(a, b); }                         \
  static inline vec vfma(vec a, vec b, vec c) { return P##_fmadd_ps(a, b, c); }             \
  static inline vec vmax(vec a, vec b) { return P##_max_ps(a, b); }                         \
  static inline vec vmin(vec a, vec b) { return P##_min_ps(a, b); }

#if defined(__AVX512F__)
#define SIMD_WIDTH 16
typedef __m512 vec;
#define SIMD_HALF(p) _mm256_loadu_si256((const __m256i*)(p))
SIMD_OPS(_mm512, 512, SIMD_HALF)
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
static inline float vtop(vec a) { return _mm512_reduce_max_ps(a); }
static inline int vequal(vec a, float x) { /* lanes equal to x, as bits */
  return _mm512_cmp_ps_mask(a, _mm512_set1_ps(x), _CMP_EQ_OQ);
}
static inline int vnan(vec a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); } /* NaN lanes */
static inline vec vround(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT); }
static inline vec vpow2(vec p, vec n) { return _mm512_scalef_ps(p, n); } /* p * 2^n */
static inline __m256 halves(__m512 a) { /* the two 8-float halves of a, added */
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
static inline __m128 vsum4(vec a, vec b, vec c, vec d) { /* four sums as one 4-float vector */
  return sum4x256(halves(a), halves(b), halves(c), halves(d));
}
static inline float vsum1(vec a) { /* one sum, added in vsum4's order */
  const __m256 h = halves(a);
  return _mm_cvtss_f32(sum4x256(h, h, h, h));
}
static inline __m512i bf16_bits(__m512i b) { /* round to nearest even, as float_to_bf16 */
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
}
static inline void vstore_bf16(uint16_t* p, vec a) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(bf16_bits(_mm512_castps_si512(a))));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SIMD_WIDTH 8
typedef __m256 vec;
#define SIMD_HALF(p) _mm_loadu_si128((const __m128i*)(p))
SIMD_OPS(_mm256, 256, SIMD_HALF)
static inline float vsum(vec a) { return sum256(a); }
static inline float vtop(vec a) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
static inline int vequal(vec a, float x) { /* lanes equal to x, as bits */
  return _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(x), _CMP_EQ_OQ));
}
static inline int vnan(vec a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
static inline vec vround(vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT); }
static inline vec vpow2(vec p, vec n) { /* n in [-126, 127] here: 2^n's exponent bits */
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
static inline __m128 vsum4(vec a, vec b, vec c, vec d) { return sum4x256(a, b, c, d); }
static inline void vstore_bf16(uint16_t* p, vec a) { /* round to nearest even, as float_to_bf16 */
  const __m256i b = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
}
#endif

#ifdef SIMD_WIDTH
/* exp(x): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p the degree-6 Taylor polynomial (relative
 * error < 2e-7), x clamped to [-87, 88]: below, 0 (as expf's underflow; a masked key's -inf
 * score turns into 0), above, e^88 (silu's x / (1 + e^-x) is then 0 anyway). */
static inline vec vexp(vec x) {
  x = vmin(vmax(x, vset(-87.0f)), vset(88.0f));
  vec n = vround(vmul(x, vset(1.44269504088896341f)));
  vec r = vfma(n, vset(-0.693145751953125f), x);
  r = vfma(n, vset(-1.428606765330187e-06f), r);
  vec p = vset(1.f / 720);
  p = vfma(p, r, vset(1.f / 120));
  p = vfma(p, r, vset(1.f / 24));
  p = vfma(p, r, vset(1.f / 6));
  p = vfma(p, r, vset(0.5f));
  p = vfma(p, r, vset(1.f));
  p = vfma(p, r, vset(1.f));
  return vpow2(p, n);
}
#endif

/* Softmax of n scores s (times `scale`) in place, left unnormalised: exp(scale (s - max)); returns
 * 1 / sum, or 0 with zeros written when every score is -inf (masked keys: no key at all). The
 * attention kernels scale their outputs by it rather than the n probabilities. */
static inline float softmax_unnormalised(float* s, int64_t n, float scale) {
  float top = -INFINITY, sum = 0.f;
  int64_t l = 0;
#ifdef SIMD_WIDTH
  vec vt = vset(-INFINITY);
  for (; l + SIMD_WIDTH <= n; l += SIMD_WIDTH) vt = vmax(vt, vload(s + l));
  top = vtop(vt);
#endif
  for (; l < n; l++) top = fmaxf(top, s[l]);
  if (top == -INFINITY) {
    for (l = 0; l < n; l++) s[l] = 0.f;
    return 0.f;
  }
  l = 0;
#ifdef SIMD_WIDTH
  vec vsum_ = vset(0.f), vtop_ = vset(top * scale), vscale = vset(scale);
  for (; l + SIMD_WIDTH <= n; l += SIMD_WIDTH) {
    vec e = vexp(vsub(vmul(vload(s + l), vscale), vtop_));
    vstore(s + l, e);
    vsum_ = vadd(vsum_, e);
  }
  sum = vsum(vsum_);
#endif
  for (; l < n; l++) {
    s[l] = expf(s[l] * scale - top * scale);
    sum += s[l];
  }
  return 1.f / sum;
}
