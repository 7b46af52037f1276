// cpu_gemv.c's kernels as torch ops (namespace LMFORGE_NS, "lmforge" unless a test builds a
// variant under its own name): eager calls go through torch's dispatcher, and an ahead-of-time
// compiled decode step (exported_step.py) calls them like any other op.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#ifndef LMFORGE_NS
#define LMFORGE_NS lmforge
#endif

extern "C" {
const char* lmforge_gemv_kernel(void);
int lmforge_gemv_int8(const float* x, const int8_t* w, const float* w_scale, float* y, int64_t m,
                      int64_t n, int64_t k, int threads);
int lmforge_gemv_int4(const float* x, const uint8_t* codes, const uint16_t* d,
                      const uint16_t* offset, float* y, int64_t m, int64_t n, int64_t k,
                      int threads);
void lmforge_dequant_int4(const uint8_t* codes, const uint16_t* d, const uint16_t* offset,
                          void* out, int64_t n, int64_t k, int bf16, int threads);
}

namespace {

void check(const at::Tensor& t, at::ScalarType type, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.dim() == dim &&
                  t.is_contiguous(),
              "lmforge GEMV: ", what, " must be a contiguous ", dim, "-d CPU ", toString(type),
              " tensor, got ", t.scalar_type(), " ", t.sizes());
}

at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  auto xc = x.contiguous();
  check(xc, at::kFloat, 2, "x");
  check(w, at::kChar, 2, "weight");
  check(scale, at::kFloat, 1, "scale");
  const int64_t m = xc.size(0), k = xc.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k && scale.size(0) == n && k % 32 == 0, "lmforge GEMV: shapes ",
              xc.sizes(), " x ", w.sizes(), " (scale ", scale.sizes(), ")");
  auto y = at::empty({m, n}, xc.options());
  if (m == 0) return y;
  TORCH_CHECK(lmforge_gemv_int8(xc.data_ptr<float>(), w.data_ptr<int8_t>(),
                                scale.data_ptr<float>(), y.data_ptr<float>(), m, n, k,
                                at::get_num_threads()) == 0,
              "lmforge GEMV: out of memory");
  return y;
}

at::Tensor gemv_int4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const at::Tensor& offset) {
  auto xc = x.contiguous();
  check(xc, at::kFloat, 2, "x");
  check(codes, at::kByte, 2, "codes");
  check(scale, at::kHalf, 2, "scale");
  check(offset, at::kHalf, 2, "offset");
  const int64_t m = xc.size(0), k = xc.size(1), n = codes.size(0);
  TORCH_CHECK(codes.size(1) * 2 == k && k % 32 == 0 && scale.size(0) == n &&
                  scale.size(1) == k / 32 && offset.sizes() == scale.sizes(),
              "lmforge GEMV: shapes ", xc.sizes(), " x codes ", codes.sizes(), " (scale ",
              scale.sizes(), ")");
  auto y = at::empty({m, n}, xc.options());
  if (m == 0) return y;
  TORCH_CHECK(lmforge_gemv_int4(xc.data_ptr<float>(), codes.data_ptr<uint8_t>(),
                                reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>()),
                                reinterpret_cast<const uint16_t*>(offset.data_ptr<at::Half>()),
                                y.data_ptr<float>(), m, n, k, at::get_num_threads()) == 0,
              "lmforge GEMV: out of memory");
  return y;
}

at::Tensor dequant_int4(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                        bool bf16) {
  check(codes, at::kByte, 2, "codes");
  check(scale, at::kHalf, 2, "scale");
  check(offset, at::kHalf, 2, "offset");
  const int64_t n = codes.size(0), k = codes.size(1) * 2;
  TORCH_CHECK(k % 32 == 0 && scale.size(0) == n && scale.size(1) == k / 32 &&
                  offset.sizes() == scale.sizes(),
              "lmforge dequant: shapes codes ", codes.sizes(), " scale ", scale.sizes());
  auto w = at::empty({n, k}, codes.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  lmforge_dequant_int4(codes.data_ptr<uint8_t>(),
                       reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>()),
                       reinterpret_cast<const uint16_t*>(offset.data_ptr<at::Half>()),
                       w.data_ptr(), n, k, bf16 ? 1 : 0, at::get_num_threads());
  return w;
}

std::string isa() { return lmforge_gemv_kernel(); }

}  // namespace

// one level of indirection, so that LMFORGE_NS is expanded before TORCH_LIBRARY pastes it
#define LMFORGE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define LMFORGE_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

LMFORGE_LIBRARY(LMFORGE_NS, m) {
  m.def("gemv_int8(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.def("gemv_int4(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor");
  m.def("dequant_int4(Tensor codes, Tensor scale, Tensor offset, bool bf16) -> Tensor");
  m.def("gemv_isa() -> str", &isa);
}

LMFORGE_LIBRARY_IMPL(LMFORGE_NS, CPU, m) {
  m.impl("gemv_int8", &gemv_int8);
  m.impl("gemv_int4", &gemv_int4);
  m.impl("dequant_int4", &dequant_int4);
}
