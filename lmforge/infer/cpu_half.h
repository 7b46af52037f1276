/* IEEE half -> float for the native kernels (cpu_gemv.c, cpu_attention.c): F16C where the CPU
 * has it, else the bit manipulation. Included by both: the extension builder compiles each
 * source on its own. */
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

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
