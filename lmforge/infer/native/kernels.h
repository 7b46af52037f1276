/* The entry points of the native CPU kernels, declared once: quantized_matmul.cpp,
 * dense_matmul.cpp, decode_attention.cpp, prefill_attention.cpp, activations.cpp and
 * row_ops.cpp define them, torch_ops.cpp calls them.
 *
 * Every source is compiled once per instruction-set variant (cpu_kernels.py: VARIANTS, each
 * with its -m flags and -DLMFORGE_VARIANT=<name>), into the namespace lmforge_kernels::<name>,
 * and variant_table.cpp collects a variant's entry points into its `Kernels` table. One library
 * thus holds code for every x86-64 (AVX2-only Zen 3, AVX-512, AVX512-VNNI/BF16 and AMX
 * machines), and cpu_kernels.py picks the table this CPU runs at load time (runtime dispatch, as
 * llama.cpp's GGML_CPU_ALL_VARIANTS builds do); `portable` is plain C++ for any x86-64.
 *
 * Conventions: row-major contiguous buffers, k % 32 == 0 for the quantised products; `threads`
 * OpenMP threads split the output rows (or the (row, KV head) pairs); a returned int is 0, or -1
 * when scratch memory could not be allocated (nothing written). */
#pragma once
#include <stdint.h>

namespace lmforge_kernels {

/* The entry points' types: every variant defines one function of each. */
/* y [m, n] fp32 = x [m, k] fp32 times int8 weights [n, k] in the interleaved layout
 * (quantized_matmul.cpp), w_scale fp32 per (padded) output row; x is quantised to int8 per
 * block of 32 inside */
using Int8Matmul = int(const float* x, const uint8_t* w, const float* w_scale, float* y,
                       int64_t m, int64_t n, int64_t k, int threads);
/* the same for llama.cpp's Q8_0 blocks (int8 codes, an fp16 scale per group of 32: w = q d) */
using BlockMatmul = int(const float* x, const uint8_t* w, float* y, int64_t m, int64_t n,
                        int64_t k, int threads);
/* and for the group-wise layouts: int4 codes with an fp16 scale d and offset m per group of 32
 * (w = q d + m), or, when `symmetric`, an fp16 scale d only (w = (q - 8) d: llama.cpp's Q4_0);
 * with `bits` 5, their 5-bit versions (llama.cpp's Q5_1, and Q5_0: w = (q - 16) d); with 6,
 * symmetric int6 (llama.cpp's Q6_K: w = d sc (q - 32), an int8 sc per 16 columns) */
using GroupMatmul = int(const float* x, const uint8_t* w, float* y, int64_t m, int64_t n,
                        int64_t k, int symmetric, int bits, int threads);
/* the interleaved int4 weights [n, k] (symmetric ones when `symmetric`, 5-bit ones when
 * `five`) as fp32, or bf16 when `bf16` (the prefill GEMM's) */
using DequantizeInt4 = void(const uint8_t* w, void* out, int64_t n, int64_t k, int symmetric,
                            int five, int bf16, int threads);
/* y [m, n] fp32 = x [m, k] (fp32, or bf16 when x_bf16) times w [n, k] as the model stores it:
 * bf16, fp16 or fp32 (w_type 0, 1, 2) (dense_matmul.cpp) */
using DenseMatmul = int(const void* x, int x_bf16, const void* w, int w_type, float* y,
                        int64_t m, int64_t n, int64_t k, int threads);
/* out [b, h, d] fp32 = softmax(q k^T scale) v, one query per row and head over k / v
 * [b, kv, len, d] (fp32 / fp16 / bf16: dtype 0 / 1 / 2; element strides per batch, head and
 * key, unit along d), mask [b, len] of 0/1 bytes (row stride mask_sb) or NULL
 * (decode_attention.cpp) */
using DecodeAttention = int(const float* q, const void* k, const void* v, int dtype,
                            const int64_t* k_strides, const int64_t* v_strides,
                            const uint8_t* mask, int64_t mask_sb, float* out, int64_t b,
                            int64_t h, int64_t kv, int64_t len, int64_t d, float scale,
                            int threads);
/* out [b, h, t, d] fp32 = causal softmax(q k^T scale) v over k / v [b, kv, t, d], all fp32 with
 * element strides per batch, head and position (qs, ks, vs, os) and unit stride along d: query
 * position i sees keys 0..i (prefill_attention.cpp) */
using PrefillAttention = int(const float* q, const float* k, const float* v, const int64_t* qs,
                             const int64_t* ks, const int64_t* vs, float* out, const int64_t* os,
                             int64_t b, int64_t h, int64_t kv, int64_t t, int64_t d, float scale,
                             int threads);
/* out [n] = silu(gate) * up elementwise in fp32, gate / up fp32 or bf16 (in_bf16), out fp32 or
 * bf16 (out_bf16) (activations.cpp) */
using SiluMul = void(const void* gate, const void* up, int in_bf16, void* out, int out_bf16,
                     int64_t n, int threads);
/* y [rows, d] = x / sqrt(mean(x^2) + eps) * w per row in fp32 (RMSNorm), x and y fp32 or bf16
 * (bf16), w [d] fp32 or bf16 (w_bf16) (row_ops.cpp) */
using RmsNorm = void(const void* x, const void* w, int bf16, int w_bf16, void* y, int64_t rows,
                     int64_t d, float eps, int threads);
/* out [rows] = the index of each row's largest value in x [rows, n] fp32, the first of equals,
 * the first NaN if any (torch.max's indices) (row_ops.cpp) */
using ArgmaxRows = void(const float* x, int64_t* out, int64_t rows, int64_t n);
/* out [b, h, t, d] = x cos + rotate_half(x) sin (RoPE, Hugging Face's pairing), x fp32 with
 * element strides xs per batch, head and position, cos / sin [b, t, d] with strides cs per batch
 * and position (0: broadcast), unit stride along d everywhere (row_ops.cpp) */
using RopeRotateHalf = void(const float* x, const int64_t* xs, const float* cos, const float* sin,
                            const int64_t* cs, float* out, int64_t b, int64_t h, int64_t t,
                            int64_t d, int threads);

/* One variant's entry points (variant_table.cpp fills it). */
struct Kernels {
  const char* variant;
  Int8Matmul* int8_matmul;
  GroupMatmul* group_matmul;
  BlockMatmul* q8_matmul;
  DequantizeInt4* dequantize_int4;
  DenseMatmul* dense_matmul;
  DecodeAttention* decode_attention;
  PrefillAttention* prefill_attention;
  SiluMul* silu_mul;
  RmsNorm* rms_norm;
  ArgmaxRows* argmax_rows;
  RopeRotateHalf* rope_rotate_half;
};

/* The variants compiled into the library, best first; cpu_kernels.py VARIANTS gives each its
 * compiler flags and the CPU flags it needs (and checks this list against its own). */
#define LMFORGE_VARIANTS(X) X(avx512_bf16) X(avx512_vnni) X(avx512) X(avx2) X(portable)
#define LMFORGE_DECLARE_TABLE(name) \
  namespace name {                  \
  extern const Kernels table;       \
  }
LMFORGE_VARIANTS(LMFORGE_DECLARE_TABLE)
#undef LMFORGE_DECLARE_TABLE

#ifdef LMFORGE_VARIANT /* compiling one variant: its entry points */
namespace LMFORGE_VARIANT {
Int8Matmul int8_matmul;
GroupMatmul group_matmul;
BlockMatmul q8_matmul;
DequantizeInt4 dequantize_int4;
DenseMatmul dense_matmul;
DecodeAttention decode_attention;
PrefillAttention prefill_attention;
SiluMul silu_mul;
RmsNorm rms_norm;
ArgmaxRows argmax_rows;
RopeRotateHalf rope_rotate_half;
}  // namespace LMFORGE_VARIANT
#endif

}  // namespace lmforge_kernels
