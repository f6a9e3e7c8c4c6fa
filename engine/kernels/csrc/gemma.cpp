// Gemma's small ops between the GEMMs, each one pass over its rows (fused.cpp has Llama's):
//
//   offset_rmsnorm(x [M, H], residual [M, H]?, weight [H], eps, dtype, out_dtype)
//       -> (out [M, H], sum [M, H]): sum = x + residual (x itself without one), rounded to dtype;
//          out = sum * rsqrt(mean(sum^2) + eps) * (1 + weight), in float32, rounded once
//   gelu_tanh_mul(gate_up [M, 2I], dtype, out_dtype) -> [M, I]: gelu_tanh(gate) * up (GeGLU)
//
// x may be float32 not yet rounded to dtype (a GEMM's output, or q/k heads read with a row
// stride): it is rounded first, as the eager `.to(dtype)` does. Numerics follow transformers'
// Gemma3RMSNorm and `gelu_pytorch_tanh` in dtype T: the norm normalizes in float32 and rounds
// after the (1 + weight) scale (Llama's rounds before it); gate and up are rounded to T, the gelu
// computed in float32 and rounded to T, the product rounded to T. The sum of squares (16 lanes
// and a fixed tree, fused_rows.h) and tanh (through exp_approx) differ from torch's, so a value
// can differ from the eager op's by an ulp of T; engine/model/decoder.py therefore calls these
// ops wherever they run, and csrc/layers.cpp calls the same ones, so its Gemma layers equal the
// Python loop's bit for bit.
//
// A row's result depends on that row alone and every variant (scalar, AVX2, AVX512: one template
// compiled three times, FMA contraction off) computes it bit-identically.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "fused_rows.h"
#include "isa.h"
#include "ops.h"

namespace specserve {
namespace gemma {
namespace {

using fused::bf16;
using fused::exp_approx;
using fused::round_to;
using fused::store;
using fused::widen;

// decode and verify batches run on the calling thread (fused.cpp's kMinParallelValues: a
// parallel region on a shared host waits for a descheduled thread)
constexpr int64_t kMinParallelValues = 1 << 19;

struct NormArgs {
  const void* x;         // [rows] at x_stride
  const void* residual;  // [rows, n] or null
  const void* w;         // [n] in T
  void* sum;             // [rows, n] in T
  void* out;             // [rows, n] in O
  int64_t rows, n, x_stride;
  float eps;
};

struct GeluArgs {
  const void* gate_up;  // [rows, 2n]
  void* out;            // [rows, n]
  int64_t rows, n;
};

template <typename In, typename T, typename O>
SPECSERVE_INLINE void norm_row(const In* __restrict x, const T* __restrict r, const T* __restrict w,
                               T* __restrict sum, O* __restrict out, int64_t n, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    const float h = round_to<T>(widen(x[i]));
    store(sum + i, r == nullptr ? h : round_to<T>(h + widen(r[i])));
  }
  const float inv = 1.0f / std::sqrt(fused::sum_squares(sum, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) store(out + i, round_to<O>(round_to<T>((widen(sum[i]) * inv) * (1.0f + widen(w[i])))));
}

// 0.5 x (1 + tanh(y)), y = sqrt(2 / pi) (x + 0.044715 x^3), as x / (1 + e^-2y): the same value
// without the cancellation in 1 + tanh(y) where y is negative
SPECSERVE_INLINE float gelu_tanh(float x) {
  const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return x / (1.0f + exp_approx(-2.0f * inner));
}

template <typename In, typename T, typename O>
SPECSERVE_INLINE void gelu_row(const In* __restrict gate, const In* __restrict up, O* __restrict out,
                               int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = round_to<T>(widen(gate[i]));
    const float u = round_to<T>(widen(up[i]));
    store(out + i, round_to<T>(round_to<T>(gelu_tanh(g)) * u));
  }
}

template <typename In, typename T, typename O>
SPECSERVE_INLINE void norm_rows(const NormArgs& a, int64_t begin, int64_t end) {
  const T* r = static_cast<const T*>(a.residual);
  for (int64_t row = begin; row < end; ++row)
    norm_row<In, T, O>(static_cast<const In*>(a.x) + row * a.x_stride, r == nullptr ? nullptr : r + row * a.n,
                       static_cast<const T*>(a.w), static_cast<T*>(a.sum) + row * a.n,
                       static_cast<O*>(a.out) + row * a.n, a.n, a.eps);
}

template <typename In, typename T, typename O>
SPECSERVE_INLINE void gelu_rows(const GeluArgs& a, int64_t begin, int64_t end) {
  const In* in = static_cast<const In*>(a.gate_up);
  for (int64_t row = begin; row < end; ++row)
    gelu_row<In, T, O>(in + row * 2 * a.n, in + row * 2 * a.n + a.n, static_cast<O*>(a.out) + row * a.n, a.n);
}

#define SPECSERVE_GEMMA_VARIANT(NAME, TARGET)                                           \
  template <typename In, typename T, typename O>                                        \
  TARGET void norm_##NAME(const NormArgs& a, int64_t begin, int64_t end) {              \
    norm_rows<In, T, O>(a, begin, end);                                                 \
  }                                                                                     \
  template <typename In, typename T, typename O>                                        \
  TARGET void gelu_##NAME(const GeluArgs& a, int64_t begin, int64_t end) {              \
    gelu_rows<In, T, O>(a, begin, end);                                                 \
  }

SPECSERVE_GEMMA_VARIANT(scalar, )
SPECSERVE_GEMMA_VARIANT(avx2, __attribute__((target("avx2"))))
SPECSERVE_GEMMA_VARIANT(avx512, __attribute__((target("avx512f,avx512bw"))))

using Isa = cpu::RowIsa;

Isa pick(const std::string& name) { return cpu::pick_row_isa(name, "gemma ops"); }

template <typename Fn>
void over_rows(int64_t rows, int64_t values_per_row, const Fn& fn) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kMinParallelValues / std::max<int64_t>(1, values_per_row)), fn);
}

template <typename In, typename T, typename O>
void run_norm(const NormArgs& a, Isa isa) {
  over_rows(a.rows, a.n, [&](int64_t begin, int64_t end) {
    if (isa == Isa::kAvx512) return norm_avx512<In, T, O>(a, begin, end);
    if (isa == Isa::kAvx2) return norm_avx2<In, T, O>(a, begin, end);
    norm_scalar<In, T, O>(a, begin, end);
  });
}

template <typename In, typename T, typename O>
void run_gelu(const GeluArgs& a, Isa isa) {
  over_rows(a.rows, 3 * a.n, [&](int64_t begin, int64_t end) {
    if (isa == Isa::kAvx512) return gelu_avx512<In, T, O>(a, begin, end);
    if (isa == Isa::kAvx2) return gelu_avx2<In, T, O>(a, begin, end);
    gelu_scalar<In, T, O>(a, begin, end);
  });
}

// In: x's type; T: the model dtype; O: out_dtype (T or float32)
template <typename In, typename T, typename Args, typename Run>
void by_out(at::ScalarType out_dtype, const Args& a, Isa isa, Run run) {
  if (out_dtype == at::kFloat) return run.template operator()<In, T, float>(a, isa);
  TORCH_CHECK(out_dtype == c10::CppTypeToScalarType<T>::value, "gemma ops: out_dtype must be float32 or dtype");
  run.template operator()<In, T, T>(a, isa);
}

template <typename Args, typename Run>
void by_types(at::ScalarType in, at::ScalarType dtype, at::ScalarType out_dtype, const Args& a, Isa isa,
              Run run) {
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && (in == at::kFloat || in == dtype),
              "gemma ops: dtype float32 or bfloat16, the input in it or in float32");
  if (dtype == at::kFloat) return by_out<float, float>(out_dtype, a, isa, run);
  if (in == at::kFloat) return by_out<float, bf16>(out_dtype, a, isa, run);
  by_out<bf16, bf16>(out_dtype, a, isa, run);
}

struct NormRun {
  template <typename In, typename T, typename O>
  void operator()(const NormArgs& a, Isa isa) const { run_norm<In, T, O>(a, isa); }
};

struct GeluRun {
  template <typename In, typename T, typename O>
  void operator()(const GeluArgs& a, Isa isa) const { run_gelu<In, T, O>(a, isa); }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> offset_rmsnorm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                  const at::Tensor& weight, double eps, at::ScalarType dtype,
                                                  at::ScalarType out_dtype, const std::string& isa) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu(),
              "offset_rmsnorm: x must be a 2-D CPU tensor [M, H] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.is_contiguous() && weight.scalar_type() == dtype,
              "offset_rmsnorm: weight must be [H] in dtype");
  const bool add = residual.has_value() && residual->defined();
  if (add)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() && residual->scalar_type() == dtype,
                "offset_rmsnorm: residual must be contiguous [M, H] in dtype");
  at::Tensor sum = at::empty({rows, n}, x.options().dtype(dtype));
  at::Tensor out = at::empty({rows, n}, x.options().dtype(out_dtype));
  const NormArgs a{x.data_ptr(), add ? residual->data_ptr() : nullptr, weight.data_ptr(), sum.data_ptr(),
                   out.data_ptr(), rows, n, x.stride(0), static_cast<float>(eps)};
  by_types(x.scalar_type(), dtype, out_dtype, a, pick(isa), NormRun{});
  return {out, sum};
}

at::Tensor gelu_tanh_mul(const at::Tensor& gate_up, at::ScalarType dtype, at::ScalarType out_dtype,
                         const std::string& isa) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous() && gate_up.device().is_cpu(),
              "gelu_tanh_mul: gate_up must be a contiguous 2-D CPU tensor [M, 2I]");
  const int64_t n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), n}, gate_up.options().dtype(out_dtype));
  const GeluArgs a{gate_up.data_ptr(), out.data_ptr(), gate_up.size(0), n};
  by_types(gate_up.scalar_type(), dtype, out_dtype, a, pick(isa), GeluRun{});
  return out;
}

}  // namespace gemma
}  // namespace specserve

TORCH_LIBRARY_FRAGMENT(specserve_kernels, m) {
  m.def(
      "offset_rmsnorm(Tensor x, Tensor? residual, Tensor weight, float eps, ScalarType dtype, "
      "ScalarType out_dtype, str isa='auto') -> (Tensor, Tensor)");
  m.def("gelu_tanh_mul(Tensor gate_up, ScalarType dtype, ScalarType out_dtype, str isa='auto') -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_kernels, CPU, m) {
  m.impl("offset_rmsnorm", &specserve::gemma::offset_rmsnorm);
  m.impl("gelu_tanh_mul", &specserve::gemma::gelu_tanh_mul);
}
