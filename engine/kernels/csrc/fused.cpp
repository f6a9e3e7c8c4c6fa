// The small ops between a decoder layer's GEMMs, each one pass over its rows:
//
//   rmsnorm(x [M, H], weight [H], eps, out_dtype) -> [M, H]
//   add_rmsnorm(x [M, H], residual [M, H], weight [H], eps, out_dtype) -> (out [M, H], sum [M, H])
//     (x may be float32 not yet rounded to the model dtype: a GEMM's output, rounded here first)
//   silu_mul(gate_up [M, 2I], dtype, out_dtype) -> [M, I]
//   rope_write_kv(qk [T, H + KVH, D], v [T, KVH, D], cos [T, 1, D], sin [T, 1, D], k_cache,
//                 v_cache, slots [T], H) -> q [T, H, D]
//     (the rotary embedding of the queries and keys, and the keys and values written to their
//     cache slots: what apply_rope, split and write_kv do in six ops and three passes)
//
// Numerics are those of engine/model/decoder.py's eager ops in the model dtype T (float32 or
// bfloat16), rounding where they round: the residual sum to T; the norm in float32, its result
// rounded to T before the weight multiplies it, the product rounded to T; gate and up rounded to
// T, silu(gate) rounded to T, the product rounded to T. Only the sum of squares (16 float lanes,
// then a fixed tree) and exp (a polynomial, below) are computed differently from torch, so a
// value can differ from the eager op's by one unit of T's last place, rarely.
//
// `out_dtype` float32 hands a GEMM that takes float32 (the GGUF kernels) its input directly: the
// values are still T's (rounded to T, then widened), so nothing changes but a copy saved.
//
// A row's result depends on that row alone: rows run in parallel, each row's loop is the same
// whatever M is, and the scalar, AVX2 and AVX512 variants compute it bit-identically (the same
// operations in the same order; contraction into FMA is off for this file). The variants are one
// template compiled three times with different target attributes; the loops are written for the
// compiler to vectorize over 16 lanes.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>

#include "fused_rows.h"
#include "isa.h"
#include "ops.h"

namespace specserve {
namespace fused {
namespace {

// Values a thread takes at least: decode and verify batches (up to 16 rows of the 1.5B's 3 x 8,960
// SiLU values) run on the calling thread. Two threads would halve SiLU*mul at 16 rows on an idle
// host (~70 us a layer), but on a shared one a parallel region waits for a descheduled thread:
// measured 8-60 ms for one such op at 4 rows (docs/ATTENTION.md, "The rest of the step").
constexpr int64_t kMinParallelValues = 1 << 19;

// ---------------------------------------------------------------------------- variants

struct NormArgs {
  const void* x;
  const void* residual;  // null: no residual
  const void* w;
  void* sum;
  void* out;
  int64_t rows, n;
  float eps;
};

struct SiluArgs {
  const void* gate_up;  // [rows, 2n]
  void* out;            // [rows, n]
  int64_t rows, n;
};

template <typename In, typename T, typename O>
SPECSERVE_INLINE void norm_rows(const NormArgs& a, int64_t begin, int64_t end) {
  const In* x = static_cast<const In*>(a.x);
  const T* r = static_cast<const T*>(a.residual);
  T* sum = static_cast<T*>(a.sum);
  O* out = static_cast<O*>(a.out);
  for (int64_t row = begin; row < end; ++row) {
    const int64_t at = row * a.n;
    norm_row<In, T, O>(x + at, r == nullptr ? nullptr : r + at, static_cast<const T*>(a.w),
                   sum == nullptr ? nullptr : sum + at, out + at, a.n, a.eps);
  }
}

template <typename In, typename T, typename O>
SPECSERVE_INLINE void silu_rows(const SiluArgs& a, int64_t begin, int64_t end) {
  const In* in = static_cast<const In*>(a.gate_up);
  O* out = static_cast<O*>(a.out);
  for (int64_t row = begin; row < end; ++row)
    silu_mul_row<In, T, O>(in + row * 2 * a.n, in + row * 2 * a.n + a.n, out + row * a.n, a.n);
}

#define SPECSERVE_VARIANT(NAME, TARGET)                                                 \
  template <typename In, typename T, typename O>                                        \
  TARGET void norm_##NAME(const NormArgs& a, int64_t begin, int64_t end) {              \
    norm_rows<In, T, O>(a, begin, end);                                                 \
  }                                                                                     \
  template <typename In, typename T, typename O>                                        \
  TARGET void silu_##NAME(const SiluArgs& a, int64_t begin, int64_t end) {              \
    silu_rows<In, T, O>(a, begin, end);                                                 \
  }

SPECSERVE_VARIANT(scalar, )
SPECSERVE_VARIANT(avx2, __attribute__((target("avx2"))))
SPECSERVE_VARIANT(avx512, __attribute__((target("avx512f,avx512bw"))))

using Isa = cpu::RowIsa;

Isa pick(const std::string& name) { return cpu::pick_row_isa(name, "fused ops"); }

// Rows in parallel, in chunks of at least kMinParallelValues values.
template <typename Fn>
void over_rows(int64_t rows, int64_t values_per_row, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, kMinParallelValues / std::max<int64_t>(1, values_per_row));
  at::parallel_for(0, rows, grain, fn);
}

template <typename In, typename T, typename O>
void run_norm(const NormArgs& a, Isa isa) {
  over_rows(a.rows, a.n, [&](int64_t begin, int64_t end) {
    if (isa == Isa::kAvx512) return norm_avx512<In, T, O>(a, begin, end);
    if (isa == Isa::kAvx2) return norm_avx2<In, T, O>(a, begin, end);
    norm_scalar<In, T, O>(a, begin, end);
  });
}

// The hand-written rows where they apply (float32 in, bf16 roundings, float32 out), the rest of
// each row and every other case through the template.
template <typename In, typename T, typename O>
bool silu_by_hand(const SiluArgs& a, Isa isa) {
  if constexpr (std::is_same_v<In, float> && std::is_same_v<T, bf16> && std::is_same_v<O, float>) {
    if (isa == Isa::kScalar) return false;
    over_rows(a.rows, 3 * a.n, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const float* gate = static_cast<const float*>(a.gate_up) + row * 2 * a.n;
        float* out = static_cast<float*>(a.out) + row * a.n;
        const int64_t done = isa == Isa::kAvx512 ? avx512_silu_row(gate, gate + a.n, out, a.n)
                                                 : avx2_silu_row(gate, gate + a.n, out, a.n);
        silu_mul_row<In, T, O>(gate + done, gate + a.n + done, out + done, a.n - done);
      }
    });
    return true;
  }
  return false;
}

template <typename In, typename T, typename O>
void run_silu(const SiluArgs& a, Isa isa) {
  if (silu_by_hand<In, T, O>(a, isa)) return;
  over_rows(a.rows, 3 * a.n, [&](int64_t begin, int64_t end) {
    if (isa == Isa::kAvx512) return silu_avx512<In, T, O>(a, begin, end);
    if (isa == Isa::kAvx2) return silu_avx2<In, T, O>(a, begin, end);
    silu_scalar<In, T, O>(a, begin, end);
  });
}

// ---------------------------------------------------------------------------- the ops

void check_dtype(at::ScalarType dtype, const char* what) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "fused ops: ", what,
              " must be float32 or bfloat16");
}

template <typename In, typename T>
void dispatch_norm(const NormArgs& a, at::ScalarType out_dtype, Isa isa) {
  if (out_dtype == at::kFloat) return run_norm<In, T, float>(a, isa);
  TORCH_CHECK(out_dtype == c10::CppTypeToScalarType<T>::value,
              "fused ops: out_dtype must be float32 or the weight's dtype");
  run_norm<In, T, T>(a, isa);
}

// dtype: the weight's and residual's (T); x_dtype: T, or float32 with a residual
void norm(const NormArgs& a, at::ScalarType x_dtype, at::ScalarType dtype,
          at::ScalarType out_dtype, Isa isa) {
  if (dtype == at::kFloat) return dispatch_norm<float, float>(a, out_dtype, isa);
  if (x_dtype == at::kFloat) return dispatch_norm<float, bf16>(a, out_dtype, isa);
  dispatch_norm<bf16, bf16>(a, out_dtype, isa);
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              "fused ops: x must be a contiguous 2-D CPU tensor [M, H]");
  check_dtype(x.scalar_type(), "x");
  check_dtype(weight.scalar_type(), "weight");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "fused ops: weight must be [H]");
}

}  // namespace

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps,
                   at::ScalarType out_dtype, const std::string& isa) {
  check_rows(x, weight);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rmsnorm: weight must be in x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(out_dtype));
  const NormArgs a{x.data_ptr(), nullptr, weight.data_ptr(), nullptr, out.data_ptr(),
                   x.size(0), x.size(1), static_cast<float>(eps)};
  norm(a, x.scalar_type(), x.scalar_type(), out_dtype, pick(isa));
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rmsnorm(const at::Tensor& x, const at::Tensor& residual,
                                               const at::Tensor& weight, double eps,
                                               at::ScalarType out_dtype, const std::string& isa) {
  check_rows(x, weight);
  const at::ScalarType dtype = residual.scalar_type();
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
                  weight.scalar_type() == dtype &&
                  (x.scalar_type() == dtype || x.scalar_type() == at::kFloat),
              "add_rmsnorm: residual and weight in one dtype, x in it or in float32");
  at::Tensor sum = at::empty_like(residual);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(out_dtype));
  const NormArgs a{x.data_ptr(), residual.data_ptr(), weight.data_ptr(), sum.data_ptr(),
                   out.data_ptr(), x.size(0), x.size(1), static_cast<float>(eps)};
  norm(a, x.scalar_type(), dtype, out_dtype, pick(isa));
  return {out, sum};
}

namespace {

template <typename In, typename T>
void dispatch_silu(const SiluArgs& a, at::ScalarType out_dtype, Isa isa) {
  if (out_dtype == at::kFloat) return run_silu<In, T, float>(a, isa);
  TORCH_CHECK(out_dtype == c10::CppTypeToScalarType<T>::value,
              "fused ops: out_dtype must be float32 or dtype");
  run_silu<In, T, T>(a, isa);
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate_up, at::ScalarType dtype, at::ScalarType out_dtype,
                    const std::string& isa) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous() &&
                  gate_up.device().is_cpu(),
              "silu_mul: gate_up must be a contiguous 2-D CPU tensor [M, 2I]");
  check_dtype(gate_up.scalar_type(), "gate_up");
  check_dtype(dtype, "dtype");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == dtype,
              "silu_mul: gate_up must be float32 or dtype");
  const int64_t n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), n}, gate_up.options().dtype(out_dtype));
  const SiluArgs a{gate_up.data_ptr(), out.data_ptr(), gate_up.size(0), n};
  const Isa chosen = pick(isa);
  if (dtype == at::kFloat) return dispatch_silu<float, float>(a, out_dtype, chosen), out;
  if (gate_up.scalar_type() == at::kFloat) return dispatch_silu<float, bf16>(a, out_dtype, chosen), out;
  dispatch_silu<bf16, bf16>(a, out_dtype, chosen);
  return out;
}

// ---------------------------------------------------------------------------- rope_write_kv

// x * cos + roll(x, D / 2) * sin per head row, with the eager ops' roundings: each product
// rounded to T, then their sum (sin is the table with its first half negated, so the roll is
// rotate_half). Query heads go to q, key heads to their cache slot, and v is copied to its slot.
namespace {

template <typename T>
void rope_write_kv_rows(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                        const at::Tensor& slots, int64_t heads, at::Tensor& q) {
  const int64_t tokens = qk.size(0), all_heads = qk.size(1), dim = qk.size(2), half = dim / 2;
  const int64_t kv_heads = all_heads - heads, num_blocks = k_cache.size(1), block = k_cache.size(2);
  const T* src = qk.data_ptr<T>();
  const T* vs = v.data_ptr<T>();
  const T* cs = cos.data_ptr<T>();
  const T* sn = sin.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* qo = q.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t qk_stride = qk.stride(0), v_stride = v.stride(0);
  // a thread takes 64 tokens at least: a decode batch runs on the calling thread
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cs + t * dim;
      const T* s = sn + t * dim;
      TORCH_CHECK(slot[t] >= 0 && slot[t] < num_blocks * block, "rope_write_kv: slot out of range");
      const int64_t at = slot[t];  // the token's row in each head's [num_blocks * block, D] pool
      for (int64_t h = 0; h < all_heads; ++h) {
        const T* x = src + t * qk_stride + h * dim;
        T* out = h < heads ? qo + (t * heads + h) * dim : kc + ((h - heads) * num_blocks * block + at) * dim;
        for (int64_t i = 0; i < dim; ++i) {
          const T a = static_cast<T>(widen(x[i]) * widen(c[i]));
          const T b = static_cast<T>(widen(x[i < half ? i + half : i - half]) * widen(s[i]));
          out[i] = static_cast<T>(widen(a) + widen(b));
        }
      }
      for (int64_t h = 0; h < kv_heads; ++h)
        std::memcpy(vc + (h * num_blocks * block + at) * dim, vs + t * v_stride + h * dim, dim * sizeof(T));
    }
  });
}

}  // namespace

at::Tensor rope_write_kv(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& slots, int64_t heads) {
  const auto dtype = qk.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rope_write_kv: float32 or bfloat16");
  TORCH_CHECK(v.scalar_type() == dtype && cos.scalar_type() == dtype && sin.scalar_type() == dtype &&
                  k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "rope_write_kv: one dtype for every tensor");
  TORCH_CHECK(qk.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "rope_write_kv: qk [T, H + KVH, D], v [T, KVH, D], caches [KVH, blocks, block, D]");
  const int64_t tokens = qk.size(0), dim = qk.size(2), kv_heads = qk.size(1) - heads;
  TORCH_CHECK(heads > 0 && kv_heads == k_cache.size(0) && v.size(1) == kv_heads && dim % 2 == 0 &&
                  v.size(2) == dim && k_cache.size(3) == dim && v.size(0) == tokens,
              "rope_write_kv: head counts or head_dim mismatch");
  TORCH_CHECK(qk.stride(2) == 1 && qk.stride(1) == dim && v.stride(2) == 1 && v.stride(1) == dim,
              "rope_write_kv: each token's heads contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "rope_write_kv: contiguous caches");
  const at::Tensor c = cos.contiguous().view({-1, dim}), s = sin.contiguous().view({-1, dim});
  TORCH_CHECK(c.size(0) == tokens && s.size(0) == tokens, "rope_write_kv: one cos and sin row per token");
  const at::Tensor sl = slots.contiguous();
  TORCH_CHECK(sl.scalar_type() == at::kLong && sl.numel() == tokens, "rope_write_kv: one int64 slot per token");
  at::Tensor q = at::empty({tokens, heads, dim}, qk.options());
  if (dtype == at::kFloat) rope_write_kv_rows<float>(qk, v, c, s, k_cache, v_cache, sl, heads, q);
  else rope_write_kv_rows<bf16>(qk, v, c, s, k_cache, v_cache, sl, heads, q);
  return q;
}

}  // namespace fused
}  // namespace specserve

TORCH_LIBRARY_FRAGMENT(specserve_kernels, m) {
  m.def("rmsnorm(Tensor x, Tensor weight, float eps, ScalarType out_dtype, str isa='auto') -> Tensor");
  m.def(
      "add_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps, ScalarType out_dtype, "
      "str isa='auto') -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up, ScalarType dtype, ScalarType out_dtype, str isa='auto') -> Tensor");
  m.def(
      "rope_write_kv(Tensor qk, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor slots, int heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_kernels, CPU, m) {
  m.impl("rmsnorm", &specserve::fused::rmsnorm);
  m.impl("add_rmsnorm", &specserve::fused::add_rmsnorm);
  m.impl("silu_mul", &specserve::fused::silu_mul);
  m.impl("rope_write_kv", &specserve::fused::rope_write_kv);
}
