/* Products with int8 or int4 weights on a CPU: y[m, n] = sum_k x[m, k] * w[n, k], for decoding
 * (m = the running rows) and prefill (m = the prompt tokens) alike; and the int4 weights
 * dequantised for a GEMM.
 *
 * Why by hand: decoding one token reads every weight once, so a step runs at the speed the
 * weights stream from memory. torch's int8 GEMV (`_weight_int8pack_mm`) and an fp32 GEMV convert
 * every weight to float before multiplying: 3 vector ops per 16 weights, which kept them well
 * below the read bandwidth (issue 19). This file does what llama.cpp does for Q8_0: the
 * activations are quantised to int8 per block of 32 (one scale per block: absmax / 127), and
 * weights and activations are multiplied as integers, 64 or 32 products per instruction
 * (AVX512-VNNI `vpdpbusd`, or AVX2 `vpmaddubsw`), with one float multiply-add per block of 32
 * columns and 16 output rows (the interleaved layout below). Prefill gains too: integer products
 * run 64 to an instruction where the bf16 dot runs 32.
 *
 * vpdpbusd multiplies unsigned by signed bytes. The int8 weights are stored as u = w + 128, so
 * sum_k u q = sum_k w q + 128 sum_k q, and the second term, which depends on the activations
 * only, is subtracted once per row of x (`offset` below). vpmaddubsw saturates 16-bit pair sums,
 * so the AVX2 path flips the weights back to signed and multiplies |w| by q with w's sign
 * (llama.cpp's trick): |pair| <= 2 * 128 * 127 < 32768.
 *
 * int4 is group-wise like llama.cpp's Q4_1: per group of 32 weights a scale d and an offset m
 * (fp16), w = q d + m with codes q in 0..15. Codes are unsigned already, so vpdpbusd and
 * vpmaddubsw take them as they are; y = sum_g d_g sx_g (dot(q_g, xq_g) - 8 sum(xq_g))
 * + sum_g (m_g + 8 d_g) sum(x_g): the codes centred, so the activations' rounding meets q - 8.
 * Symmetric int4 (llama.cpp's Q4_0: w = (q - 8) d, 4.5 bits a weight against 5) is the same
 * kernel with the offset implied, m = -8 d: its blocks hold no offsets, and the second sum,
 * which is zero for it, is skipped. The 5-bit layouts (llama.cpp's Q5_0: w = (q - 16) d, and
 * Q5_1: w = q d + m, codes 0..31) are the same kernels again with a plane of fifth bits after
 * the nibbles, ORed in as bit 4 of each code (the codes centred on 16).
 *
 * Compiled once per instruction-set variant (kernels.h); OpenMP threads split the blocks of
 * output rows.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "kernels.h"
#include "simd.h"

namespace lmforge_kernels::LMFORGE_VARIANT {

#define BLOCK 32 /* activation values sharing one scale */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VNNI512 1
#endif
/* The AVX2 path without VNNI multiplies the signed int8 weights directly; the others multiply
 * u = w + 128 and subtract the activations' share of the 128 once per row of x. */
#if !defined(VNNI512) && defined(__AVX2__)
#define SIGNED_WEIGHTS_INT8 1
#else
#define SIGNED_WEIGHTS_INT8 0
#endif

/* x [k] -> q [k] int8 and one scale per block of 32 (absmax / 127, rounding to nearest even as
 * lrintf does); when not NULL, xsum [k / 32] gets the float sums of x per block (int4's
 * offsets) and qsum [k / 32] the sums of q (the q8 weights' +128 and int4's centring). Returns
 * 128 * sum_b scale_b * sum(q_b): the activations' share of the +128 in unsigned int8 weights.
 * Vectorised: one row of x is quantised once per matrix, and the scalar loop cost 10% of a
 * decoding step's GEMV time. */
static float quantize_row(const float* x, int8_t* q, float* scale, float* xsum, float* qsum,
                          int64_t k) {
  float offset = 0.f;
  for (int64_t b = 0; b < k / BLOCK; b++) {
    const float* xb = x + b * BLOCK;
    int8_t* qb = q + b * BLOCK;
#if defined(__AVX2__)
    __m256 v[4], amax = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int j = 0; j < 4; j++) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], abs_mask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float top = _mm_cvtss_f32(m4);
    const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
    __m256i iq[4];
    __m256 fsum = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
      iq[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)); /* current mode: nearest even */
      fsum = _mm256_add_ps(fsum, v[j]);
    }
    __m256i isum = _mm256_add_epi32(_mm256_add_epi32(iq[0], iq[1]), _mm256_add_epi32(iq[2], iq[3]));
    /* int32 -> int8 in order: packs work per 128-bit lane, the permute puts them back */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iq[0], iq[1]), _mm256_packs_epi32(iq[2], iq[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)qb, p);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    const int32_t sum = _mm_cvtsi128_si32(s4);
    if (xsum) xsum[b] = sum256(fsum);
#else
    float top = 0.f;
    for (int i = 0; i < BLOCK; i++) top = fmaxf(top, fabsf(xb[i]));
    const float inv = top > 0.f ? 127.f / top : 0.f;
    int32_t sum = 0;
    float fs = 0.f;
    for (int i = 0; i < BLOCK; i++) {
      int32_t v = (int32_t)lrintf(xb[i] * inv);
      qb[i] = (int8_t)v;
      sum += v;
      fs += xb[i];
    }
    if (xsum) xsum[b] = fs;
#endif
    scale[b] = top / 127.f;
    if (qsum) qsum[b] = (float)sum;
    offset += 128.f * scale[b] * (float)sum;
  }
  return offset;
}

/* ---- the interleaved layout ------------------------------------------------------------------
 * Weights are stored in blocks of 16 output rows (LANES) x one group of 32 columns. Within a
 * block, 4-byte pieces of the 16 rows alternate: piece t of row r sits at byte 64 t + 4 r. One
 * 64-byte load then holds 4 columns of 16 rows, one row per 32-bit lane, and `vpdpbusd` against
 * the 4 matching activations broadcast to every lane adds 4 products to each row's sum: no
 * horizontal sums, one float multiply-add per group for 16 rows, and the scales of 16 rows are
 * one vector. llama.cpp repacks Q4_0 the same way on AVX2 / AVX-512 machines (its 8x8 layout).
 * The layout is one stream read front to back (row blocks, then groups), which the hardware
 * prefetcher follows, and the unpacked weights of a block serve every row of x (batch decoding
 * reads the weights once for up to TILE rows).
 *
 *   int8: 8 pieces per block (512 bytes), weights stored as unsigned u = w + 128;
 *   int4: 4 pieces of codes (256 bytes; byte j of a row's group: column j low nibble, j + 16
 *         high), then the 16 rows' fp16 scales d (32 bytes) and offsets m (32 bytes);
 *   int5: the int4 codes, then one piece (64 bytes) of fifth bits: bit t of byte j of a row
 *         is that of column 4 t + j (the low nibbles of piece t), bit 4 + t that of column
 *         16 + 4 t + j, so one shift and mask per piece lines them up with its nibbles; then the
 *         scales and offsets;
 *   q8 (llama.cpp's Q8_0: w = q d per group of 32): the int8 block, then the 16 rows' fp16
 *         scales d (32 bytes).
 * The packing is done by torch ops in cpu_kernels.py (pack_int8 / pack_int4 / pack_q8).
 */
#define LANES 16
#define TILE 4 /* rows of x multiplied per pass over a block of weights */

/* With more rows of x than one pass takes, a block of weights is read from DRAM by the first
 * pass and from L1 by the others, and the hardware prefetcher, which follows demand misses,
 * idles during those: the weight stream stalls at every block (16 rows take the time of one
 * row's DRAM reads plus the integer products, not the larger of the two). So each pass
 * prefetches its share of the next block: in every group, `bytes` of that group's `stride`. */
typedef struct {
  const uint8_t* next;
  int64_t stride, bytes;
} Prefetch;

static inline void prefetch_part(Prefetch pf, int64_t g) {
#if defined(__x86_64__) || defined(_M_X64)
  for (int64_t j = 0; j < pf.bytes; j += 64)
    _mm_prefetch((const char*)(pf.next + g * pf.stride + j), _MM_HINT_T0);
#else
  (void)pf, (void)g;
#endif
}

/* Pass `pass` of `passes` over a block: its share of the next block (groups of `stride`
 * bytes at `next`; none when there is a single pass, which the hardware prefetcher serves). */
static inline Prefetch prefetch_share(const uint8_t* next, int64_t stride, int64_t pass,
                                      int64_t passes) {
  Prefetch pf = {next, stride, 0};
  if (passes > 1 && next) {
    const int64_t per = (stride / 64 + passes - 1) / passes * 64;
    pf.next = next + pass * per;
    pf.bytes = pass * per >= stride ? 0 : (stride - pass * per < per ? stride - pass * per : per);
  }
  return pf;
}
#define INT8_BLOCK_BYTES (LANES * BLOCK)
#define INT4_CODE_BYTES (LANES * BLOCK / 2)
#define INT5_HIGH_BYTES (LANES * 4) /* the fifth bits: one 4-byte piece per row */
/* a group-wise layout's block: codes, fifth bits (FIVE), scales, offsets (unless SYM) */
#define GROUP_BLOCK_BYTES(SYM, FIVE) \
  (INT4_CODE_BYTES + ((FIVE) ? INT5_HIGH_BYTES : 0) + ((SYM) ? 2 : 4) * LANES)
/* int6 (Q6_K): codes, two planes of high bits, fp16 d and two int8 scales per row */
#define INT6_BLOCK_BYTES (INT4_CODE_BYTES + 2 * INT5_HIGH_BYTES + 4 * LANES)
#define INT4_BLOCK_BYTES GROUP_BLOCK_BYTES(false, false)
#define INT4_SYM_BLOCK_BYTES GROUP_BLOCK_BYTES(true, false)
#define Q8_BLOCK_BYTES (LANES * BLOCK + 2 * LANES)

static inline int32_t piece(const int8_t* q, int64_t c) {
  int32_t v;
  memcpy(&v, q + c, 4);
  return v;
}

#if defined(__AVX2__)
/* 8 rows' 32-bit sums of 4 products: u (unsigned weights) times 4 broadcast activations */
static inline __m256i dot4_u8(__m256i acc, __m256i u, __m256i q) {
#if defined(VNNI512)
  return _mm256_dpbusd_epi32(acc, u, q);
#else /* int8 weights u = w + 128: signed w times q through llama.cpp's sign trick, which keeps
         vpmaddubsw's 16-bit pair sums below saturation (|w| <= 128, |q| <= 127) */
  __m256i w = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));
  __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(q, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}
/* the same for int4 codes (0..15): pair sums stay far below saturation without the trick */
static inline __m256i dot4_u4(__m256i acc, __m256i u, __m256i q) {
#if defined(VNNI512)
  return dot4_u8(acc, u, q);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, q),
                                                 _mm256_set1_epi16(1)));
#endif
}
/* T rows' sums, 16 lanes each as two 8-float halves, to out [T][LANES] */
template <int T>
static inline void store_halves(const __m256 (*acc)[2], float* out) {
  for (int i = 0; i < T; i++) {
    _mm256_storeu_ps(out + i * LANES, acc[i][0]);
    _mm256_storeu_ps(out + i * LANES + 8, acc[i][1]);
  }
}
#endif

/* The int8 sums of one block for T rows of x: acc[i] += sx_i,g * sum(u q) per lane (row); with
 * Q8 (llama.cpp's Q8_0 blocks, an fp16 scale d per row and group after the codes)
 * acc[i] += d_g sx_i,g (sum(u q) - 128 sum(q)), `qs` holding sum(q) per group of x (the shift is
 * 0 where the weights are multiplied signed). */
#define Q8_SHIFT (SIGNED_WEIGHTS_INT8 ? 0.f : 128.f)
template <int T, bool Q8 = false>
static inline void int8_block(const uint8_t* w, const int8_t* q, const float* sx, const float* qs,
                              int64_t k, int64_t groups, Prefetch pf, float* out /* [T][LANES] */) {
  constexpr int64_t bytes = Q8 ? Q8_BLOCK_BYTES : INT8_BLOCK_BYTES;
#if defined(VNNI512)
  __m512 acc[T];
  for (int i = 0; i < T; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++, w += bytes) {
    prefetch_part(pf, g);
    __m512i s[T];
    for (int i = 0; i < T; i++) s[i] = _mm512_setzero_si512();
    for (int t = 0; t < 8; t++) {
      __m512i u = _mm512_loadu_si512((const void*)(w + 64 * t));
      for (int i = 0; i < T; i++)
        s[i] = _mm512_dpbusd_epi32(s[i], u, _mm512_set1_epi32(piece(q + i * k, g * BLOCK + 4 * t)));
    }
    for (int i = 0; i < T; i++) {
      const __m512 sxi = _mm512_set1_ps(sx[i * groups + g]);
      if constexpr (Q8) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + LANES * BLOCK)));
        const __m512 v = _mm512_sub_ps(_mm512_cvtepi32_ps(s[i]),
                                       _mm512_set1_ps(Q8_SHIFT * qs[i * groups + g]));
        acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(v, sxi), d, acc[i]);
      } else {
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), sxi, acc[i]);
      }
    }
  }
  for (int i = 0; i < T; i++) _mm512_storeu_ps(out + i * LANES, acc[i]);
#elif defined(__AVX2__) && defined(__F16C__)
  __m256 acc[T][2];
  for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++, w += bytes) {
    prefetch_part(pf, g);
    __m256i s[T][2];
    for (int i = 0; i < T; i++) s[i][0] = s[i][1] = _mm256_setzero_si256();
    for (int t = 0; t < 8; t++) {
      __m256i u0 = _mm256_loadu_si256((const __m256i*)(w + 64 * t));
      __m256i u1 = _mm256_loadu_si256((const __m256i*)(w + 64 * t + 32));
      for (int i = 0; i < T; i++) {
        __m256i qv = _mm256_set1_epi32(piece(q + i * k, g * BLOCK + 4 * t));
        s[i][0] = dot4_u8(s[i][0], u0, qv);
        s[i][1] = dot4_u8(s[i][1], u1, qv);
      }
    }
    for (int h = 0; h < 2; h++)
      for (int i = 0; i < T; i++) {
        const __m256 sxi = _mm256_set1_ps(sx[i * groups + g]);
        if constexpr (Q8) {
          const __m256 d =
              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + LANES * BLOCK + 16 * h)));
          const __m256 v = _mm256_sub_ps(_mm256_cvtepi32_ps(s[i][h]),
                                         _mm256_set1_ps(Q8_SHIFT * qs[i * groups + g]));
          acc[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(v, sxi), d, acc[i][h]);
        } else {
          acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i][h]), sxi, acc[i][h]);
        }
      }
  }
  store_halves<T>(acc, out);
#else
  for (int i = 0; i < T * LANES; i++) out[i] = 0.f;
  for (int64_t g = 0; g < groups; g++, w += bytes) {
    const uint16_t* d = (const uint16_t*)(w + LANES * BLOCK);
    for (int i = 0; i < T; i++)
      for (int r = 0; r < LANES; r++) {
        int32_t s = 0;
        for (int t = 0; t < 8; t++)
          for (int j = 0; j < 4; j++)
            s += (int32_t)w[64 * t + 4 * r + j] * q[i * k + g * BLOCK + 4 * t + j];
        const float sxi = sx[i * groups + g];
        out[i * LANES + r] += Q8 ? half_to_float(d[r]) * sxi * ((float)s - Q8_SHIFT * qs[i * groups + g])
                                 : sxi * (float)s;
      }
  }
#endif
}

#if defined(__AVX2__)
/* Byte-wise bit operations on 256- and 512-bit vectors, by overloading, so that the code
 * unpacking below is written once for both widths. */
static inline __m256i vand(__m256i a, __m256i b) { return _mm256_and_si256(a, b); }
static inline __m256i vor(__m256i a, __m256i b) { return _mm256_or_si256(a, b); }
static inline __m256i vshl(__m256i a, int n) { return _mm256_slli_epi16(a, n); }
static inline __m256i vshr(__m256i a, int n) { return _mm256_srli_epi16(a, n); }
static inline __m256i vbytes(__m256i, int b) { return _mm256_set1_epi8((char)b); }
#if defined(VNNI512)
static inline __m512i vand(__m512i a, __m512i b) { return _mm512_and_si512(a, b); }
static inline __m512i vor(__m512i a, __m512i b) { return _mm512_or_si512(a, b); }
static inline __m512i vshl(__m512i a, int n) { return _mm512_slli_epi16(a, n); }
static inline __m512i vshr(__m512i a, int n) { return _mm512_srli_epi16(a, n); }
static inline __m512i vbytes(__m512i, int b) { return _mm512_set1_epi8((char)b); }
#endif

/* The codes of piece t of a block: `lo` those of columns 4 t..4 t + 3 (the low nibbles of the
 * bytes c), `hi` those of columns 16 + 4 t.. (the high nibbles); with a plane h4 of bits 4 (int5,
 * int6) and h5 of bits 5 (int6) ORed in: bit t of a plane's byte is the low nibble's, bit 4 + t
 * the high one's, so one shift and mask lines each up with its nibble. */
template <class V>
static inline void piece_codes(V c, const V* h4, const V* h5, int t, V& lo, V& hi) {
  const V low = vbytes(c, 0x0f), bit4 = vbytes(c, 0x10), bit5 = vbytes(c, 0x20);
  lo = vand(c, low);
  hi = vand(vshr(c, 4), low);
  if (h4) {
    lo = vor(lo, vand(vshl(*h4, 4 - t), bit4));
    hi = vor(hi, vand(vshr(*h4, t), bit4));
  }
  if (h5) {
    lo = vor(lo, vand(vshl(*h5, 5 - t), bit5));
    hi = vor(hi, vand(t == 0 ? vshl(*h5, 1) : vshr(*h5, t - 1), bit5));
  }
}
#endif

/* The int4 sums of one block for T rows of x:
 *   acc[i] += d sx_i,g (sum(c q) - 8 sum(q)) + (m + 8 d) sum(x_g),
 * i.e. w = (c - 8) d + (m + 8 d): the activations' rounding error meets the centred codes c - 8
 * (as in llama.cpp's Q4_0 dot) instead of c, about half the error for the same arithmetic.
 * SYM: the symmetric layout (no offsets: m = -8 d), where the second term is zero and skipped.
 * FIVE: 5-bit codes (the fifth bits' plane after the nibbles), centred on 16 instead of 8. */
template <int T, bool SYM = false, bool FIVE = false>
static inline void int4_block(const uint8_t* w, const int8_t* q, const float* sx,
                              const float* xsum, const float* qs, int64_t k, int64_t groups,
                              Prefetch pf, float* out) {
  constexpr int64_t bytes = GROUP_BLOCK_BYTES(SYM, FIVE);
  constexpr int64_t at_d = INT4_CODE_BYTES + (FIVE ? INT5_HIGH_BYTES : 0), at_m = at_d + 32;
  constexpr float centre = FIVE ? 16.f : 8.f;
#if defined(VNNI512)
  __m512 acc[T];
  for (int i = 0; i < T; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++, w += bytes) {
    prefetch_part(pf, g);
    __m512i s[T], high = _mm512_setzero_si512();
    for (int i = 0; i < T; i++) s[i] = _mm512_setzero_si512();
    if constexpr (FIVE) high = _mm512_loadu_si512((const void*)(w + INT4_CODE_BYTES));
    for (int t = 0; t < 4; t++) {
      __m512i lo, hi;
      piece_codes<__m512i>(_mm512_loadu_si512((const void*)(w + 64 * t)), FIVE ? &high : NULL, NULL, t,
                  lo, hi);
      for (int i = 0; i < T; i++) {
        const int8_t* qg = q + i * k + g * BLOCK + 4 * t;
        s[i] = _mm512_dpbusd_epi32(s[i], lo, _mm512_set1_epi32(piece(qg, 0)));
        s[i] = _mm512_dpbusd_epi32(s[i], hi, _mm512_set1_epi32(piece(qg, 16)));
      }
    }
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + at_d)));
    __m512 m = _mm512_setzero_ps();
    if constexpr (!SYM) {
      m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + at_m)));
      m = _mm512_fmadd_ps(_mm512_set1_ps(centre), d, m);
    }
    for (int i = 0; i < T; i++) {
      __m512 c = _mm512_sub_ps(_mm512_cvtepi32_ps(s[i]),
                               _mm512_set1_ps(centre * qs[i * groups + g]));
      __m512 v = _mm512_mul_ps(c, _mm512_set1_ps(sx[i * groups + g]));
      acc[i] = _mm512_fmadd_ps(v, d, acc[i]);
      if constexpr (!SYM) acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[i * groups + g]), acc[i]);
    }
  }
  for (int i = 0; i < T; i++) _mm512_storeu_ps(out + i * LANES, acc[i]);
#elif defined(__AVX2__) && defined(__F16C__)
  __m256 acc[T][2];
  for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++, w += bytes) {
    prefetch_part(pf, g);
    __m256i s[T][2];
    for (int i = 0; i < T; i++) s[i][0] = s[i][1] = _mm256_setzero_si256();
    for (int t = 0; t < 4; t++) {
      for (int h = 0; h < 2; h++) {
        __m256i lo, hi, high = _mm256_setzero_si256();
        if constexpr (FIVE) high = _mm256_loadu_si256((const __m256i*)(w + INT4_CODE_BYTES + 32 * h));
        piece_codes<__m256i>(_mm256_loadu_si256((const __m256i*)(w + 64 * t + 32 * h)),
                    FIVE ? &high : NULL, NULL, t, lo, hi);
        for (int i = 0; i < T; i++) {
          const int8_t* qg = q + i * k + g * BLOCK + 4 * t;
          s[i][h] = dot4_u4(s[i][h], lo, _mm256_set1_epi32(piece(qg, 0)));
          s[i][h] = dot4_u4(s[i][h], hi, _mm256_set1_epi32(piece(qg, 16)));
        }
      }
    }
    for (int h = 0; h < 2; h++) {
      __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + at_d + 16 * h)));
      __m256 m = _mm256_setzero_ps();
      if constexpr (!SYM) {
        m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + at_m + 16 * h)));
        m = _mm256_fmadd_ps(_mm256_set1_ps(centre), d, m);
      }
      for (int i = 0; i < T; i++) {
        __m256 c = _mm256_sub_ps(_mm256_cvtepi32_ps(s[i][h]),
                                 _mm256_set1_ps(centre * qs[i * groups + g]));
        __m256 v = _mm256_mul_ps(c, _mm256_set1_ps(sx[i * groups + g]));
        acc[i][h] = _mm256_fmadd_ps(v, d, acc[i][h]);
        if constexpr (!SYM)
          acc[i][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[i * groups + g]), acc[i][h]);
      }
    }
  }
  store_halves<T>(acc, out);
#else
  for (int i = 0; i < T * LANES; i++) out[i] = 0.f;
  for (int64_t g = 0; g < groups; g++, w += bytes) {
    const uint16_t* d = (const uint16_t*)(w + at_d);
    const uint16_t* m = SYM ? NULL : (const uint16_t*)(w + at_m);
    for (int i = 0; i < T; i++)
      for (int r = 0; r < LANES; r++) {
        int32_t s = 0;
        for (int t = 0; t < 4; t++)
          for (int j = 0; j < 4; j++) {
            const int32_t c = w[64 * t + 4 * r + j];
            const int32_t h = FIVE ? w[INT4_CODE_BYTES + 4 * r + j] : 0;
            const int8_t* qg = q + i * k + g * BLOCK + 4 * t + j;
            s += ((c & 15) | (h >> t & 1) << 4) * qg[0] + ((c >> 4) | (h >> (4 + t) & 1) << 4) * qg[16];
          }
        const float dr = half_to_float(d[r]);
        out[i * LANES + r] += dr * sx[i * groups + g] * ((float)s - centre * qs[i * groups + g]);
        if (!SYM) out[i * LANES + r] += (half_to_float(m[r]) + centre * dr) * xsum[i * groups + g];
      }
  }
#endif
}

/* The int6 sums of one block for T rows of x (llama.cpp's Q6_K: w = d sc (c - 32) with codes
 * 0..63, an fp16 d per row and group, an int8 scale sc per 16 columns): the low and high 16
 * columns of a group (the low and high nibbles) are summed apart, each meets its own scale:
 *   acc[i] += d sx_i,g (sc_lo (sum_lo(c q) - 32 sum_lo(q)) + sc_hi (sum_hi(c q) - 32 sum_hi(q))).
 * The codes' bits 4 and 5 are two planes laid out as int5's fifth bits. */
template <int T>
static inline void int6_block(const uint8_t* w, const int8_t* q, const float* sx,
                              const float* qs, const float* ql, int64_t k, int64_t groups,
                              Prefetch pf, float* out) {
  constexpr int64_t at_d = INT4_CODE_BYTES + 2 * INT5_HIGH_BYTES, at_sc = at_d + 2 * LANES;
#if defined(VNNI512)
  __m512 acc[T];
  for (int i = 0; i < T; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++, w += INT6_BLOCK_BYTES) {
    prefetch_part(pf, g);
    __m512i slo[T], shi[T];
    for (int i = 0; i < T; i++) slo[i] = shi[i] = _mm512_setzero_si512();
    const __m512i h4 = _mm512_loadu_si512((const void*)(w + INT4_CODE_BYTES));
    const __m512i h5 = _mm512_loadu_si512((const void*)(w + INT4_CODE_BYTES + INT5_HIGH_BYTES));
    for (int t = 0; t < 4; t++) {
      __m512i lo, hi;
      piece_codes<__m512i>(_mm512_loadu_si512((const void*)(w + 64 * t)), &h4, &h5, t, lo, hi);
      for (int i = 0; i < T; i++) {
        const int8_t* qg = q + i * k + g * BLOCK + 4 * t;
        slo[i] = _mm512_dpbusd_epi32(slo[i], lo, _mm512_set1_epi32(piece(qg, 0)));
        shi[i] = _mm512_dpbusd_epi32(shi[i], hi, _mm512_set1_epi32(piece(qg, 16)));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + at_d)));
    const __m512 sc_lo = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + at_sc))));
    const __m512 sc_hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + at_sc + LANES))));
    for (int i = 0; i < T; i++) {
      const float qlo = ql[i * groups + g], qhi = qs[i * groups + g] - qlo;
      __m512 v = _mm512_mul_ps(
          _mm512_sub_ps(_mm512_cvtepi32_ps(slo[i]), _mm512_set1_ps(32.f * qlo)), sc_lo);
      v = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(shi[i]), _mm512_set1_ps(32.f * qhi)),
                          sc_hi, v);
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(v, _mm512_set1_ps(sx[i * groups + g])), d, acc[i]);
    }
  }
  for (int i = 0; i < T; i++) _mm512_storeu_ps(out + i * LANES, acc[i]);
#elif defined(__AVX2__) && defined(__F16C__)
  __m256 acc[T][2];
  for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++, w += INT6_BLOCK_BYTES) {
    prefetch_part(pf, g);
    for (int h = 0; h < 2; h++) {
      __m256i slo[T], shi[T];
      for (int i = 0; i < T; i++) slo[i] = shi[i] = _mm256_setzero_si256();
      const __m256i h4 = _mm256_loadu_si256((const __m256i*)(w + INT4_CODE_BYTES + 32 * h));
      const __m256i h5 =
          _mm256_loadu_si256((const __m256i*)(w + INT4_CODE_BYTES + INT5_HIGH_BYTES + 32 * h));
      for (int t = 0; t < 4; t++) {
        __m256i lo, hi;
        piece_codes<__m256i>(_mm256_loadu_si256((const __m256i*)(w + 64 * t + 32 * h)), &h4, &h5, t, lo,
                    hi);
        for (int i = 0; i < T; i++) {
          const int8_t* qg = q + i * k + g * BLOCK + 4 * t;
          slo[i] = dot4_u4(slo[i], lo, _mm256_set1_epi32(piece(qg, 0)));
          shi[i] = dot4_u4(shi[i], hi, _mm256_set1_epi32(piece(qg, 16)));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + at_d + 16 * h)));
      const __m256 sc_lo = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + at_sc + 8 * h))));
      const __m256 sc_hi = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + at_sc + LANES + 8 * h))));
      for (int i = 0; i < T; i++) {
        const float qlo = ql[i * groups + g], qhi = qs[i * groups + g] - qlo;
        __m256 v = _mm256_mul_ps(
            _mm256_sub_ps(_mm256_cvtepi32_ps(slo[i]), _mm256_set1_ps(32.f * qlo)), sc_lo);
        v = _mm256_fmadd_ps(
            _mm256_sub_ps(_mm256_cvtepi32_ps(shi[i]), _mm256_set1_ps(32.f * qhi)), sc_hi, v);
        acc[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(v, _mm256_set1_ps(sx[i * groups + g])), d,
                                    acc[i][h]);
      }
    }
  }
  store_halves<T>(acc, out);
#else
  for (int i = 0; i < T * LANES; i++) out[i] = 0.f;
  for (int64_t g = 0; g < groups; g++, w += INT6_BLOCK_BYTES) {
    const uint16_t* d = (const uint16_t*)(w + at_d);
    const int8_t* sc = (const int8_t*)(w + at_sc);
    for (int i = 0; i < T; i++)
      for (int r = 0; r < LANES; r++) {
        int32_t slo = 0, shi = 0;
        for (int t = 0; t < 4; t++)
          for (int j = 0; j < 4; j++) {
            const int32_t c = w[64 * t + 4 * r + j], h4 = w[INT4_CODE_BYTES + 4 * r + j],
                          h5 = w[INT4_CODE_BYTES + INT5_HIGH_BYTES + 4 * r + j];
            const int8_t* qg = q + i * k + g * BLOCK + 4 * t + j;
            slo += ((c & 15) | (h4 >> t & 1) << 4 | (h5 >> t & 1) << 5) * qg[0];
            shi += ((c >> 4) | (h4 >> (4 + t) & 1) << 4 | (h5 >> (4 + t) & 1) << 5) * qg[16];
          }
        const float qlo = ql[i * groups + g], qhi = qs[i * groups + g] - qlo;
        const float v = ((float)slo - 32.f * qlo) * (float)sc[r] +
                        ((float)shi - 32.f * qhi) * (float)sc[LANES + r];
        out[i * LANES + r] += v * sx[i * groups + g] * half_to_float(d[r]);
      }
  }
#endif
}

/* Quantised rows of x: q [m, k] int8, scales [m, k / 32], per row the share of the +128 in the
 * int8 weights (`offset`) and, per group, the float sums of x (`xsum`) and of q (`qsum`), and
 * of q's first 16 (`qlow`: int6's scales are per 16 columns). */
typedef struct {
  int8_t* q;
  float* scale;
  float* offset; /* [m] */
  float* xsum;   /* [m, k / 32] */
  float* qsum;   /* [m, k / 32] */
  float* qlow;   /* [m, k / 32] */
} QuantX;

/* sums: 0 none, 1 xsum and qsum, 2 also qlow */
static int quantize_x(const float* x, int64_t m, int64_t k, int sums, QuantX* out) {
  const int64_t groups = k / BLOCK;
  out->q = (int8_t*)malloc((size_t)(m * k) + 64);
  out->scale = (float*)malloc(sizeof(float) * (size_t)(4 * m * groups + m));
  if (!out->q || !out->scale) { free(out->q); free(out->scale); return -1; }
  out->xsum = out->scale + m * groups;
  out->qsum = out->xsum + m * groups;
  out->qlow = out->qsum + m * groups;
  out->offset = out->qlow + m * groups;
  for (int64_t i = 0; i < m; i++) {
    out->offset[i] = quantize_row(x + i * k, out->q + i * k, out->scale + i * groups,
                                  sums ? out->xsum + i * groups : NULL,
                                  sums ? out->qsum + i * groups : NULL, k);
    if (SIGNED_WEIGHTS_INT8) out->offset[i] = 0.f;
    for (int64_t g = 0; sums == 2 && g < groups; g++) {
      int32_t low = 0;
      for (int j = 0; j < BLOCK / 2; j++) low += out->q[i * k + g * BLOCK + j];
      out->qlow[i * groups + g] = (float)low;
    }
  }
  return 0;
}

/* One block of 16 output rows for rows [i0, i0 + t) of x: CALL(T) runs the T-row kernel. */
#define TILE_DISPATCH(t, CALL) \
  switch (t) {                 \
    case 4: CALL(4); break;    \
    case 3: CALL(3); break;    \
    case 2: CALL(2); break;    \
    default: CALL(1); break;   \
  }

enum Kind { INT8 = 0, GROUP = 1, Q8 = 2, INT6 = 3 };

/* y [m, n] (fp32) = x [m, k] (fp32) times the interleaved weights (n rounded up to 16 rows):
 * int8 (`w_scale` [that many] per output row, zero for the padding), the group-wise layouts
 * (GROUP: int4 codes, fp16 scales d and offsets m per group, w = q d + m; SYM: symmetric, codes
 * and fp16 scales d, w = (q - 8) d; FIVE: their 5-bit versions, w = q d + m, w = (q - 16) d) or
 * q8 (codes and an fp16 scale d per group, w = q d); k % 32 == 0. They differ only in the block
 * kernel and the store: a template, so each is compiled as its own loop (a version taking
 * lambdas ran slower at one row: the kernels were no longer inlined in the OpenMP loop).
 * Returns 0, or -1 when memory runs out (nothing written). */
template <int KIND, bool SYM = false, bool FIVE = false>
static int quantized_matmul(const float* x, const uint8_t* w, const float* w_scale, float* y, int64_t m,
                int64_t n, int64_t k, int threads) {
  constexpr int64_t block_bytes = KIND == Q8     ? Q8_BLOCK_BYTES
                                  : KIND == INT8 ? INT8_BLOCK_BYTES
                                  : KIND == INT6 ? INT6_BLOCK_BYTES
                                                 : GROUP_BLOCK_BYTES(SYM, FIVE);
  if (k % BLOCK != 0 || m <= 0) return -1;
  const int64_t groups = k / BLOCK, blocks = (n + LANES - 1) / LANES;
  QuantX qx;
  if (quantize_x(x, m, k, KIND == INT6 ? 2 : KIND != INT8, &qx)) return -1;
  const int64_t passes = (m + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t* wb = w + b * groups * block_bytes;
    const uint8_t* next = b + 1 < blocks ? wb + groups * block_bytes : NULL;
    float acc[TILE * LANES];
    for (int64_t i0 = 0; i0 < m; i0 += TILE) {
      const int t = (int)(m - i0 < TILE ? m - i0 : TILE);
      const Prefetch pf = prefetch_share(next, block_bytes, i0 / TILE, passes);
      const int8_t* q = qx.q + i0 * k;
      const float *sx = qx.scale + i0 * groups, *qs = qx.qsum + i0 * groups;
#define GROUP_CALL(T) \
  int4_block<T, SYM, FIVE>(wb, q, sx, qx.xsum + i0 * groups, qs, k, groups, pf, acc)
#define INT8_CALL(T) int8_block<T, KIND == Q8>(wb, q, sx, qs, k, groups, pf, acc)
#define INT6_CALL(T) int6_block<T>(wb, q, sx, qs, qx.qlow + i0 * groups, k, groups, pf, acc)
      if constexpr (KIND == GROUP) {
        TILE_DISPATCH(t, GROUP_CALL)
      } else if constexpr (KIND == INT6) {
        TILE_DISPATCH(t, INT6_CALL)
      } else {
        TILE_DISPATCH(t, INT8_CALL)
      }
#undef GROUP_CALL
#undef INT8_CALL
#undef INT6_CALL
      for (int i = 0; i < t; i++)
        for (int r = 0; r < LANES && b * LANES + r < n; r++)
          y[(i0 + i) * n + b * LANES + r] =
              KIND != INT8 ? acc[i * LANES + r]
                           : w_scale[b * LANES + r] * (acc[i * LANES + r] - qx.offset[i0 + i]);
    }
  }
  free(qx.q);
  free(qx.scale);
  return 0;
}

int int8_matmul(const float* x, const uint8_t* w, const float* w_scale, float* y, int64_t m,
                int64_t n, int64_t k, int threads) {
  return quantized_matmul<INT8>(x, w, w_scale, y, m, n, k, threads);
}

int group_matmul(const float* x, const uint8_t* w, float* y, int64_t m, int64_t n, int64_t k,
                 int symmetric, int bits, int threads) {
  if (bits == 6) return quantized_matmul<INT6>(x, w, NULL, y, m, n, k, threads);
  if (bits == 5)
    return symmetric ? quantized_matmul<GROUP, true, true>(x, w, NULL, y, m, n, k, threads)
                     : quantized_matmul<GROUP, false, true>(x, w, NULL, y, m, n, k, threads);
  return symmetric ? quantized_matmul<GROUP, true>(x, w, NULL, y, m, n, k, threads)
                   : quantized_matmul<GROUP>(x, w, NULL, y, m, n, k, threads);
}

int q8_matmul(const float* x, const uint8_t* w, float* y, int64_t m, int64_t n, int64_t k,
              int threads) {
  return quantized_matmul<Q8>(x, w, NULL, y, m, n, k, threads);
}

/* w = q d + m for the rows [n, k] of interleaved int4 or int5 weights (`five`), w = (q - 8) d
 * or (q - 16) d when `symmetric`: exact in fp32, as llama.cpp's Q4_0 / Q5_0 dequantisation
 * computes it, written as fp32, or as bf16 (round to nearest even) when `bf16`: the weights the
 * prefill GEMM multiplies by. */
void dequantize_int4(const uint8_t* w, void* out, int64_t n, int64_t k, int symmetric, int five,
                     int bf16, int threads) {
  const int64_t groups = k / BLOCK, blocks = (n + LANES - 1) / LANES;
  const int64_t bytes = GROUP_BLOCK_BYTES(symmetric, five);
  const int64_t at_d = INT4_CODE_BYTES + (five ? INT5_HIGH_BYTES : 0);
  const float centre = five ? 16.f : 8.f;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    for (int r = 0; r < LANES && b * LANES + r < n; r++) {
      float row[k]; /* one row in fp32, then stored */
      for (int64_t g = 0; g < groups; g++) {
        const uint8_t* wg = w + (b * groups + g) * bytes;
        const float dg = half_to_float(((const uint16_t*)(wg + at_d))[r]);
        const float mg = symmetric ? 0.f : half_to_float(((const uint16_t*)(wg + at_d + 32))[r]);
        for (int t = 0; t < 4; t++)
          for (int j = 0; j < 4; j++) {
            const int c = wg[64 * t + 4 * r + j], h = five ? wg[INT4_CODE_BYTES + 4 * r + j] : 0;
            const int lo = (c & 15) | (h >> t & 1) << 4, hi = (c >> 4) | (h >> (4 + t) & 1) << 4;
            float* dst = row + g * BLOCK + 4 * t + j;
            if (symmetric) { /* (q - centre) d: exact, as llama.cpp computes it */
              dst[0] = (float)(lo - (int)centre) * dg;
              dst[16] = (float)(hi - (int)centre) * dg;
            } else {
              dst[0] = (float)lo * dg + mg;
              dst[16] = (float)hi * dg + mg;
            }
          }
      }
      const int64_t o = b * LANES + r;
      if (bf16) {
        uint16_t* dst = (uint16_t*)out + o * k;
        for (int64_t j = 0; j < k; j++) dst[j] = float_to_bf16(row[j]);
      } else {
        memcpy((float*)out + o * k, row, sizeof(float) * (size_t)k);
      }
    }
  }
}

}  // namespace lmforge_kernels::LMFORGE_VARIANT
