// cpu_gemv.c's, cpu_gemv_half.c's and cpu_attention.c's kernels as torch ops (namespace
// LMFORGE_NS, "lmforge" unless a test builds a variant under its own name): eager calls go
// through torch's dispatcher, and an ahead-of-time compiled decode step (exported_step.py)
// calls them like any other op.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>

#ifndef LMFORGE_NS
#define LMFORGE_NS lmforge
#endif

extern "C" {
const char* lmforge_gemv_kernel(void);
int lmforge_gemv_int8(const float* x, const uint8_t* w, const float* w_scale, float* y, int64_t m,
                      int64_t n, int64_t k, int threads);
int lmforge_gemv_int4(const float* x, const uint8_t* w, float* y, int64_t m, int64_t n, int64_t k,
                      int threads);
int lmforge_gemv_q8(const float* x, const uint8_t* w, float* y, int64_t m, int64_t n, int64_t k,
                    int threads);
void lmforge_dequant_int4(const uint8_t* w, void* out, int64_t n, int64_t k, int bf16,
                          int threads);
int lmforge_gemv_half(const void* x, int x_bf16, const uint16_t* w, int w_f16, float* y,
                      int64_t m, int64_t n, int64_t k, int threads);
int lmforge_decode_attention(const float* q, const void* k, const void* v, int dtype,
                             const int64_t* k_strides, const int64_t* v_strides,
                             const uint8_t* mask, int64_t mask_sb, float* out, int64_t b,
                             int64_t h, int64_t kv, int64_t len, int64_t d, float scale,
                             int threads);
}

namespace {

constexpr int64_t kLanes = 16, kBlock = 32, kInt8Bytes = kLanes * kBlock,
                  kInt4Bytes = kLanes * kBlock / 2 + 4 * kLanes,
                  kQ8Bytes = kLanes * kBlock + 2 * kLanes;

void check(const at::Tensor& t, at::ScalarType type, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.dim() == dim &&
                  t.is_contiguous(),
              "lmforge GEMV: ", what, " must be a contiguous ", dim, "-d CPU ", toString(type),
              " tensor, got ", t.scalar_type(), " ", t.sizes());
}

// packed [ceil(n / 16), k / 32, block bytes]: returns k
int64_t check_packed(const at::Tensor& w, int64_t n, int64_t block_bytes) {
  check(w, at::kByte, 3, "packed weights");
  TORCH_CHECK(n > 0 && w.size(0) == (n + kLanes - 1) / kLanes && w.size(2) == block_bytes,
              "lmforge GEMV: packed weights ", w.sizes(), " do not hold ", n, " rows");
  return w.size(1) * kBlock;
}

at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                     int64_t n) {
  auto xc = x.contiguous();
  check(xc, at::kFloat, 2, "x");
  check(scale, at::kFloat, 1, "scale");
  const int64_t k = check_packed(w, n, kInt8Bytes), m = xc.size(0);
  TORCH_CHECK(xc.size(1) == k && scale.size(0) == w.size(0) * kLanes, "lmforge GEMV: shapes ",
              xc.sizes(), " x packed ", w.sizes(), " (scale ", scale.sizes(), ")");
  auto y = at::empty({m, n}, xc.options());
  if (m == 0) return y;
  TORCH_CHECK(lmforge_gemv_int8(xc.data_ptr<float>(), w.data_ptr<uint8_t>(),
                                scale.data_ptr<float>(), y.data_ptr<float>(), m, n, k,
                                at::get_num_threads()) == 0,
              "lmforge GEMV: out of memory");
  return y;
}

// int4 (cpu_gemv.c's int4 layout) or q8 (its q8 layout: llama.cpp's Q8_0 blocks)
template <int64_t kBytes>
at::Tensor gemv_blocks(const at::Tensor& x, const at::Tensor& w, int64_t n) {
  auto xc = x.contiguous();
  check(xc, at::kFloat, 2, "x");
  const int64_t k = check_packed(w, n, kBytes), m = xc.size(0);
  TORCH_CHECK(xc.size(1) == k, "lmforge GEMV: shapes ", xc.sizes(), " x packed ", w.sizes());
  auto y = at::empty({m, n}, xc.options());
  if (m == 0) return y;
  auto run = kBytes == kInt4Bytes ? lmforge_gemv_int4 : lmforge_gemv_q8;
  TORCH_CHECK(run(xc.data_ptr<float>(), w.data_ptr<uint8_t>(), y.data_ptr<float>(), m, n, k,
                  at::get_num_threads()) == 0,
              "lmforge GEMV: out of memory");
  return y;
}

at::Tensor gemv_int4(const at::Tensor& x, const at::Tensor& w, int64_t n) {
  return gemv_blocks<kInt4Bytes>(x, w, n);
}

at::Tensor gemv_q8(const at::Tensor& x, const at::Tensor& w, int64_t n) {
  return gemv_blocks<kQ8Bytes>(x, w, n);
}

at::Tensor dequant_int4(const at::Tensor& w, int64_t n, bool bf16) {
  const int64_t k = check_packed(w, n, kInt4Bytes);
  auto out = at::empty({n, k}, w.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  lmforge_dequant_int4(w.data_ptr<uint8_t>(), out.data_ptr(), n, k, bf16 ? 1 : 0,
                       at::get_num_threads());
  return out;
}

// x [M, K] (any float dtype) times w [N, K] bf16 or fp16 -> [M, N] in x's dtype: lmforge's
// GEMV (cpu_gemv_half.c: fp32 sums) up to a few rows, torch's GEMM above, where its blocked
// kernels win (bf16 from 16 rows on a Zen 4 core; torch's fp16 ran 2-3x slower at 16 rows)
at::Tensor half_linear(const at::Tensor& x, const at::Tensor& w) {
  const auto wtype = w.scalar_type();
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() &&
                  (wtype == at::kBFloat16 || wtype == at::kHalf),
              "lmforge half linear: weights must be a contiguous 2-d CPU bf16 or fp16 tensor, "
              "got ", wtype, " ", w.sizes());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1), "lmforge half linear: shapes ", x.sizes(),
              " x ", w.sizes());
  const int64_t m = x.size(0), n = w.size(0), k = w.size(1);
  if (m > (wtype == at::kHalf ? 16 : 8)) return at::linear(x.to(wtype), w).to(x.scalar_type());
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;  // bf16 goes in as it is
  auto xc = (x_bf16 ? x : x.to(at::kFloat)).contiguous();
  auto y = at::empty({m, n}, xc.options().dtype(at::kFloat));
  if (m > 0 && n > 0)
    TORCH_CHECK(lmforge_gemv_half(xc.data_ptr(), x_bf16 ? 1 : 0,
                                  reinterpret_cast<const uint16_t*>(w.data_ptr()),
                                  wtype == at::kHalf ? 1 : 0, y.data_ptr<float>(), m, n, k,
                                  at::get_num_threads()) == 0,
                "lmforge half linear: out of memory");
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// q [B, H, 1, D] fp32, k / v [B, KV, L, D] fp32, fp16 or bf16 (any strides but unit along D),
// mask [B, L] (or [B, 1, 1, L]) bool or none -> [B, H, 1, D] fp32 (cpu_attention.c)
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask) {
  auto qc = q.contiguous();
  TORCH_CHECK(qc.device().is_cpu() && qc.scalar_type() == at::kFloat && qc.dim() == 4 &&
                  qc.size(2) == 1,
              "lmforge decode attention: q must be a CPU fp32 [B, H, 1, D] tensor, got ",
              qc.scalar_type(), " ", qc.sizes());
  const int64_t b = qc.size(0), h = qc.size(1), d = qc.size(3);
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() &&
                  k.size(0) == b && k.size(3) == d && k.size(1) > 0 && h % k.size(1) == 0,
              "lmforge decode attention: k ", k.sizes(), " and v ", v.sizes(),
              " do not fit q ", qc.sizes());
  const auto type = k.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kHalf || type == at::kBFloat16,
              "lmforge decode attention: the cache must be fp32, fp16 or bf16, got ", type);
  auto kc = k.stride(3) == 1 ? k : k.contiguous();
  auto vc = v.stride(3) == 1 ? v : v.contiguous();
  const int64_t len = k.size(2);
  at::Tensor m;
  if (mask.has_value()) {
    m = mask->reshape({b, -1});
    TORCH_CHECK(m.scalar_type() == at::kBool && m.size(1) >= len,
                "lmforge decode attention: mask ", mask->sizes(), " for ", len, " keys");
    if (m.stride(1) != 1) m = m.contiguous();
  }
  auto out = at::empty({b, h, 1, d}, qc.options());
  if (b == 0 || len == 0) return out.zero_();
  const int64_t ks[3] = {kc.stride(0), kc.stride(1), kc.stride(2)};
  const int64_t vs[3] = {vc.stride(0), vc.stride(1), vc.stride(2)};
  const int dtype = type == at::kFloat ? 0 : type == at::kHalf ? 1 : 2;
  TORCH_CHECK(lmforge_decode_attention(
                  qc.data_ptr<float>(), kc.data_ptr(), vc.data_ptr(), dtype, ks, vs,
                  m.defined() ? reinterpret_cast<const uint8_t*>(m.data_ptr<bool>()) : nullptr,
                  m.defined() ? m.stride(0) : 0, out.data_ptr<float>(), b, h, k.size(1), len, d,
                  1.0f / std::sqrt(static_cast<float>(d)), at::get_num_threads()) == 0,
              "lmforge decode attention: out of memory");
  return out;
}

std::string isa() { return lmforge_gemv_kernel(); }

}  // namespace

// one level of indirection, so that LMFORGE_NS is expanded before TORCH_LIBRARY pastes it
#define LMFORGE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define LMFORGE_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

LMFORGE_LIBRARY(LMFORGE_NS, m) {
  m.def("gemv_int8(Tensor x, Tensor packed, Tensor scale, int n) -> Tensor");
  m.def("gemv_int4(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("gemv_q8(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("dequant_int4(Tensor packed, int n, bool bf16) -> Tensor");
  m.def("half_linear(Tensor x, Tensor w) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask) -> Tensor");
  m.def("gemv_isa() -> str", &isa);
}

LMFORGE_LIBRARY_IMPL(LMFORGE_NS, CPU, m) {
  m.impl("gemv_int8", &gemv_int8);
  m.impl("gemv_int4", &gemv_int4);
  m.impl("gemv_q8", &gemv_q8);
  m.impl("dequant_int4", &dequant_int4);
  m.impl("half_linear", &half_linear);
  m.impl("decode_attention", &decode_attention);
}
