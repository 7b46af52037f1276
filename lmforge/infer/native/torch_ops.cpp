// The native kernels (kernels.h) as torch ops (namespace LMFORGE_NS, "lmforge" unless a test
// builds the library under its own name): eager calls go through torch's dispatcher, and an
// ahead-of-time compiled decode step (steps.ExportedStep) calls them like any other op. Which
// variant's kernels run is set once by cpu_kernels.py (`use_kernel_variant`), from this CPU's
// features.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "kernels.h"

#ifndef LMFORGE_NS
#define LMFORGE_NS lmforge
#endif

namespace {

using lmforge_kernels::Kernels;

#define LMFORGE_TABLE(name) &lmforge_kernels::name::table,
const Kernels* const kVariants[] = {LMFORGE_VARIANTS(LMFORGE_TABLE)};
#undef LMFORGE_TABLE
const Kernels* active = &lmforge_kernels::portable::table;  // until cpu_kernels.py picks one

std::vector<std::string> kernel_variants() {
  std::vector<std::string> names;
  for (const Kernels* v : kVariants) names.emplace_back(v->variant);
  return names;
}

std::string kernel_variant() { return active->variant; }

void use_kernel_variant(const std::string& name) {
  for (const Kernels* v : kVariants)
    if (name == v->variant) {
      active = v;
      return;
    }
  TORCH_CHECK(false, "lmforge kernels: no variant ", name);
}

constexpr int64_t kLanes = 16, kBlock = 32, kInt8Bytes = kLanes * kBlock,
                  kQ8Bytes = kLanes * kBlock + 2 * kLanes;

// A group-wise layout's block bytes: the codes' nibbles, the fifth bits (int5), the fp16 scales,
// the fp16 offsets (unless symmetric).
constexpr int64_t group_bytes(bool symmetric, bool five) {
  return kLanes * kBlock / 2 + (five ? 4 * kLanes : 0) + (symmetric ? 2 : 4) * kLanes;
}

void check(const at::Tensor& t, at::ScalarType type, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.dim() == dim &&
                  t.is_contiguous(),
              "lmforge kernels: ", what, " must be a contiguous ", dim, "-d CPU ", toString(type),
              " tensor, got ", t.scalar_type(), " ", t.sizes());
}

// packed [ceil(n / 16), k / 32, block bytes]: returns k
int64_t check_packed(const at::Tensor& w, int64_t n, int64_t block_bytes) {
  check(w, at::kByte, 3, "packed weights");
  TORCH_CHECK(n > 0 && w.size(0) == (n + kLanes - 1) / kLanes && w.size(2) == block_bytes,
              "lmforge kernels: packed weights ", w.sizes(), " do not hold ", n, " rows");
  return w.size(1) * kBlock;
}

constexpr int64_t kInt6Bytes = kLanes * kBlock / 2 + 8 * kLanes + 4 * kLanes;

// The group-wise layouts are told apart by their block bytes: int4 320 with an offset per row
// and group (w = q d + m), 288 without (symmetric, w = (q - 8) d); int5 384 and 352; int6 448.
struct GroupLayout {
  bool symmetric;
  int bits;
  int64_t bytes;
};
GroupLayout group_layout(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 3, "lmforge kernels: packed weights must be 3-d, got ", w.sizes());
  if (w.size(2) == kInt6Bytes) return {true, 6, kInt6Bytes};
  for (bool five : {false, true})
    for (bool symmetric : {false, true})
      if (w.size(2) == group_bytes(symmetric, five))
        return {symmetric, five ? 5 : 4, group_bytes(symmetric, five)};
  TORCH_CHECK(false, "lmforge kernels: int4 / int5 / int6 weights must be packed in blocks of ",
              group_bytes(true, false), ", ", group_bytes(false, false), ", ",
              group_bytes(true, true), ", ", group_bytes(false, true), " or ", kInt6Bytes,
              " bytes, got ", w.sizes());
}

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                     int64_t n) {
  auto xc = x.contiguous();
  check(xc, at::kFloat, 2, "x");
  check(scale, at::kFloat, 1, "scale");
  const int64_t k = check_packed(w, n, kInt8Bytes), m = xc.size(0);
  TORCH_CHECK(xc.size(1) == k && scale.size(0) == w.size(0) * kLanes, "lmforge kernels: shapes ",
              xc.sizes(), " x packed ", w.sizes(), " (scale ", scale.sizes(), ")");
  auto y = at::empty({m, n}, xc.options());
  if (m == 0) return y;
  TORCH_CHECK(active->int8_matmul(xc.data_ptr<float>(), w.data_ptr<uint8_t>(),
                                scale.data_ptr<float>(), y.data_ptr<float>(), m, n, k,
                                at::get_num_threads()) == 0,
              "lmforge kernels: out of memory");
  return y;
}

// the group-wise layouts (quantized_matmul.cpp's int4 / int5, asymmetric or symmetric) or q8
// (its q8 layout: llama.cpp's Q8_0 blocks): `bytes` per block, run by `run`
template <typename Run>
at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t bytes,
                        Run run) {
  auto xc = x.contiguous();
  check(xc, at::kFloat, 2, "x");
  const int64_t k = check_packed(w, n, bytes), m = xc.size(0);
  TORCH_CHECK(xc.size(1) == k, "lmforge kernels: shapes ", xc.sizes(), " x packed ", w.sizes());
  auto y = at::empty({m, n}, xc.options());
  if (m == 0) return y;
  TORCH_CHECK(run(xc.data_ptr<float>(), w.data_ptr<uint8_t>(), y.data_ptr<float>(), m, n, k,
                  at::get_num_threads()) == 0,
              "lmforge kernels: out of memory");
  return y;
}

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& w, int64_t n) {
  const auto [symmetric, bits, bytes] = group_layout(w);
  return block_matmul(x, w, n, bytes,
                      [&](const float* xp, const uint8_t* wp, float* y, int64_t m, int64_t n,
                          int64_t k, int threads) {
                        return active->group_matmul(xp, wp, y, m, n, k, symmetric, bits, threads);
                      });
}

at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& w, int64_t n) {
  return block_matmul(x, w, n, kQ8Bytes, active->q8_matmul);
}

at::Tensor dequantize_int4(const at::Tensor& w, int64_t n, bool bf16) {
  const auto [symmetric, bits, bytes] = group_layout(w);
  TORCH_CHECK(bits < 6, "lmforge kernels: dequantize_int4 takes the int4 / int5 layouts");
  const int64_t k = check_packed(w, n, bytes);
  const bool five = bits == 5;
  auto out = at::empty({n, k}, w.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  active->dequantize_int4(w.data_ptr<uint8_t>(), out.data_ptr(), n, k, symmetric ? 1 : 0,
                          five ? 1 : 0, bf16 ? 1 : 0, at::get_num_threads());
  return out;
}

// x [M, K] (any float dtype) times w [N, K] bf16, fp16 or fp32 -> [M, N] in x's dtype
// (dense_matmul.cpp: fp32 sums); for the few rows of a decode step (HalfLinear and
// model/linear.py send more to a GEMM)
at::Tensor dense_matmul(const at::Tensor& x, const at::Tensor& w) {
  const auto wtype = w.scalar_type();
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() &&
                  (wtype == at::kBFloat16 || wtype == at::kHalf || wtype == at::kFloat),
              "lmforge dense matmul: weights must be a contiguous 2-d CPU bf16, fp16 or fp32 "
              "tensor, got ", wtype, " ", w.sizes());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1), "lmforge dense matmul: shapes ", x.sizes(),
              " x ", w.sizes());
  const int64_t m = x.size(0), n = w.size(0), k = w.size(1);
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;  // bf16 goes in as it is
  auto xc = (x_bf16 ? x : x.to(at::kFloat)).contiguous();
  auto y = at::empty({m, n}, xc.options().dtype(at::kFloat));
  const int w_type = wtype == at::kFloat ? 2 : wtype == at::kHalf ? 1 : 0;
  if (m > 0 && n > 0)
    TORCH_CHECK(active->dense_matmul(xc.data_ptr(), x_bf16 ? 1 : 0, w.data_ptr(), w_type,
                                     y.data_ptr<float>(), m, n, k, at::get_num_threads()) == 0,
                "lmforge dense matmul: out of memory");
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// q [B, H, 1, D] fp32, k / v [B, KV, L, D] fp32, fp16 or bf16 (any strides but unit along D),
// mask [B, L] (or [B, 1, 1, L]) bool or none -> [B, H, 1, D] fp32 (decode_attention.cpp)
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
  TORCH_CHECK(active->decode_attention(
                  qc.data_ptr<float>(), kc.data_ptr(), vc.data_ptr(), dtype, ks, vs,
                  m.defined() ? reinterpret_cast<const uint8_t*>(m.data_ptr<bool>()) : nullptr,
                  m.defined() ? m.stride(0) : 0, out.data_ptr<float>(), b, h, k.size(1), len, d,
                  1.0f / std::sqrt(static_cast<float>(d)), at::get_num_threads()) == 0,
              "lmforge decode attention: out of memory");
  return out;
}

// q [B, H, T, D] fp32, k / v [B, KV, T, D] fp32 (any strides but unit along D) -> causal
// attention [B, H, T, D] fp32, laid out [B, T, H, D] (the output projection's rows as they are)
// (prefill_attention.cpp)
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() &&
                  q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2) && k.size(3) == q.size(3) && k.size(1) > 0 &&
                  q.size(1) % k.size(1) == 0,
              "lmforge prefill attention: q ", q.sizes(), ", k ", k.sizes(), " and v ",
              v.sizes(), " must be CPU fp32 [B, H, T, D] and [B, KV, T, D] tensors");
  auto qc = q.stride(3) == 1 ? q : q.contiguous();
  auto kc = k.stride(3) == 1 ? k : k.contiguous();
  auto vc = v.stride(3) == 1 ? v : v.contiguous();
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  auto out = at::empty({b, t, h, d}, qc.options()).transpose(1, 2);
  if (out.numel() == 0) return out;
  const int64_t qs[3] = {qc.stride(0), qc.stride(1), qc.stride(2)};
  const int64_t ks[3] = {kc.stride(0), kc.stride(1), kc.stride(2)};
  const int64_t vs[3] = {vc.stride(0), vc.stride(1), vc.stride(2)};
  const int64_t os[3] = {out.stride(0), out.stride(1), out.stride(2)};
  TORCH_CHECK(active->prefill_attention(qc.data_ptr<float>(), kc.data_ptr<float>(),
                                        vc.data_ptr<float>(), qs, ks, vs, out.data_ptr<float>(),
                                        os, b, h, k.size(1), t, d,
                                        1.0f / std::sqrt(static_cast<float>(d)),
                                        at::get_num_threads()) == 0,
              "lmforge prefill attention: out of memory");
  return out;
}

// silu(gate) * up elementwise (SwiGLU's activation; activations.cpp), gate and up of one shape
// and dtype (fp32 or bf16), in fp32; the result bf16 when `bf16`, else fp32
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up, bool bf16) {
  const auto type = gate.scalar_type();
  TORCH_CHECK(gate.device().is_cpu() && up.device().is_cpu() && up.scalar_type() == type &&
                  gate.sizes() == up.sizes() && (type == at::kFloat || type == at::kBFloat16),
              "lmforge silu_mul: gate and up must be CPU fp32 or bf16 tensors of one shape and "
              "dtype, got ", type, " ", gate.sizes(), " and ", up.scalar_type(), " ", up.sizes());
  auto g = gate.contiguous(), u = up.contiguous();
  auto out = at::empty(g.sizes(), g.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  active->silu_mul(g.data_ptr(), u.data_ptr(), type == at::kBFloat16 ? 1 : 0, out.data_ptr(),
                   bf16 ? 1 : 0, g.numel(), at::get_num_threads());
  return out;
}

// RMSNorm over the last dim of x (fp32 or bf16) with weight w [d] (fp32 or bf16), in fp32, the
// result in x's dtype and shape (row_ops.cpp)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const auto type = x.scalar_type(), w_type = w.scalar_type();
  const bool ok = [&] {
    for (auto t : {type, w_type})
      if (t != at::kFloat && t != at::kBFloat16) return false;
    return true;
  }();
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && ok && x.dim() >= 1 && w.dim() == 1 &&
                  x.size(-1) == w.size(0),
              "lmforge rms_norm: x and w must be CPU fp32 or bf16 tensors, w [d] and x [..., d], "
              "got ", type, " ", x.sizes(), " and ", w_type, " ", w.sizes());
  auto xc = x.contiguous(), wc = w.contiguous();
  auto out = at::empty(xc.sizes(), xc.options());
  const int64_t d = w.size(0);
  if (out.numel() == 0) return out;
  active->rms_norm(xc.data_ptr(), wc.data_ptr(), type == at::kBFloat16, w_type == at::kBFloat16,
                   out.data_ptr(), xc.numel() / d, d, static_cast<float>(eps),
                   at::get_num_threads());
  return out;
}

// the index of each row's largest value (the first of equals, the first NaN if any: torch.max's
// indices) in x [rows, n] fp32, n > 0 (row_ops.cpp)
at::Tensor argmax_rows(const at::Tensor& x) {
  auto xc = x.contiguous();
  check(xc, at::kFloat, 2, "x");
  TORCH_CHECK(xc.size(1) > 0, "lmforge argmax_rows: rows of no values");
  auto out = at::empty({xc.size(0)}, xc.options().dtype(at::kLong));
  active->argmax_rows(xc.data_ptr<float>(), out.data_ptr<int64_t>(), xc.size(0), xc.size(1));
  return out;
}

// RoPE's rotation, Hugging Face's rotate-half pairing: x [b, h, t, d] fp32 (any strides but
// unit along d), cos / sin broadcasting to [b, 1, t, d] -> x cos + rotate_half(x) sin,
// contiguous (row_ops.cpp)
at::Tensor rope_rotate_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 4 &&
                  x.size(3) % 2 == 0 && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() &&
                  cos.dim() <= 4 && cos.device().is_cpu() && sin.device().is_cpu(),
              "lmforge rope_rotate_half: x must be a CPU fp32 [b, h, t, d] tensor with d even "
              "and cos / sin fp32 tables of one shape, got ", x.scalar_type(), " ", x.sizes(),
              " and ", cos.scalar_type(), " ", cos.sizes());
  const int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  TORCH_CHECK(cos.dim() < 3 || cos.size(-3) == 1, "lmforge rope_rotate_half: tables ",
              cos.sizes(), " vary by head");
  auto xc = x.stride(3) == 1 ? x : x.contiguous();
  auto table = [&](const at::Tensor& c) {  // [b, 1, t, d] (a view), unit stride along d
    auto e = c.expand({b, 1, t, d});
    return e.stride(3) == 1 ? e : e.contiguous();
  };
  auto c = table(cos), s = table(sin);
  if (c.strides() != s.strides()) s = s.contiguous(), c = c.contiguous();
  auto out = at::empty({b, h, t, d}, xc.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const int64_t xs[3] = {xc.stride(0), xc.stride(1), xc.stride(2)};
  const int64_t cs[2] = {c.stride(0), c.stride(2)};
  active->rope_rotate_half(xc.data_ptr<float>(), xs, c.data_ptr<float>(), s.data_ptr<float>(), cs,
                           out.data_ptr<float>(), b, h, t, d, at::get_num_threads());
  return out;
}

}  // namespace

// one level of indirection, so that LMFORGE_NS is expanded before TORCH_LIBRARY pastes it
#define LMFORGE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define LMFORGE_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

LMFORGE_LIBRARY(LMFORGE_NS, m) {
  m.def("int8_matmul(Tensor x, Tensor packed, Tensor scale, int n) -> Tensor");
  m.def("int4_matmul(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("q8_matmul(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("dequantize_int4(Tensor packed, int n, bool bf16) -> Tensor");
  m.def("dense_matmul(Tensor x, Tensor w) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up, bool bf16) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("rope_rotate_half(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("kernel_variants() -> str[]", &kernel_variants);
  m.def("kernel_variant() -> str", &kernel_variant);
  m.def("use_kernel_variant(str name) -> ()", &use_kernel_variant);
}

LMFORGE_LIBRARY_IMPL(LMFORGE_NS, CPU, m) {
  m.impl("int8_matmul", &int8_matmul);
  m.impl("int4_matmul", &int4_matmul);
  m.impl("q8_matmul", &q8_matmul);
  m.impl("dequantize_int4", &dequantize_int4);
  m.impl("dense_matmul", &dense_matmul);
  m.impl("decode_attention", &decode_attention);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("silu_mul", &silu_mul);
  m.impl("rms_norm", &rms_norm);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("rope_rotate_half", &rope_rotate_half);
}
