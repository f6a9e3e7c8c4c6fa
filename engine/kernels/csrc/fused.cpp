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

#include "isa.h"
#include "ops.h"

#define SPECSERVE_INLINE __attribute__((always_inline)) inline

namespace specserve {
namespace fused {
namespace {

constexpr int kLanes = 16;
// Values a thread takes at least: decode and verify batches (up to 16 rows of the 1.5B's 3 x 8,960
// SiLU values) run on the calling thread. Two threads would halve SiLU*mul at 16 rows on an idle
// host (~70 us a layer), but on a shared one a parallel region waits for a descheduled thread:
// measured 8-60 ms for one such op at 4 rows (docs/ATTENTION.md, "The rest of the step").
constexpr int64_t kMinParallelValues = 1 << 19;

using bf16 = c10::BFloat16;

SPECSERVE_INLINE float widen(float v) { return v; }
SPECSERVE_INLINE float widen(bf16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, NaN kept quiet: c10's conversion, written branch-free to vectorize.
SPECSERVE_INLINE uint16_t bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(nan ? 0x7fc0u : rounded);
}

template <typename T>
SPECSERVE_INLINE float round_to(float f) {
  if constexpr (std::is_same_v<T, bf16>) {
    uint32_t bits = static_cast<uint32_t>(bf16_bits(f)) << 16;
    float r;
    std::memcpy(&r, &bits, sizeof r);
    return r;
  } else {
    return f;
  }
}

template <typename O>
SPECSERVE_INLINE void store(O* dst, float v) {  // v already holds a value of O
  if constexpr (std::is_same_v<O, bf16>) {
    dst->x = bf16_bits(v);
  } else {
    *dst = v;
  }
}

// e^x for the float range silu needs: x = n ln2 + r, |r| <= ln2 / 2, e^r by Cephes' degree-6
// polynomial, 2^n put in the exponent bits. Relative error ~1e-7; no branches.
SPECSERVE_INLINE float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : x;  // selects, not std::min/max: those references block vectorizing
  x = x > 88.0f ? 88.0f : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504088896341f + magic) - magic;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t exponent = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent, sizeof scale);
  return p * scale;
}

// ---------------------------------------------------------------------------- one row

// sum of squares over 16 lanes, then a fixed tree: the same order on every ISA
SPECSERVE_INLINE float lane_sum(float (&acc)[kLanes]) {
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  return acc[0];
}

// x is T, or float32 not yet rounded to T (a GEMM's output): rounded first, as the eager cast does
template <typename In, typename T>
SPECSERVE_INLINE void add_row(const In* __restrict x, const T* __restrict r, T* __restrict sum,
                             int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    store(sum + i, round_to<T>(round_to<T>(widen(x[i])) + widen(r[i])));
}

template <typename T>
SPECSERVE_INLINE float sum_squares(const T* __restrict h, int64_t n) {
  float acc[kLanes] = {};
  const int64_t full = n / kLanes * kLanes;
  for (int64_t i = 0; i < full; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = widen(h[i + j]);
      acc[j] += v * v;
    }
  }
  for (int64_t i = full; i < n; ++i) {
    const float v = widen(h[i]);
    acc[i - full] += v * v;
  }
  return lane_sum(acc);
}

template <typename T, typename O>
SPECSERVE_INLINE void scale_row(const T* __restrict h, const T* __restrict w, O* __restrict out,
                               float inv, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store(out + i, round_to<T>(widen(w[i]) * round_to<T>(widen(h[i]) * inv)));
}

// sum = round(x + residual) when residual is given (else x itself is read); out = norm(sum) * w
template <typename In, typename T, typename O>
SPECSERVE_INLINE void norm_row(const In* x, const T* residual, const T* w, T* sum, O* out,
                               int64_t n, float eps) {
  if (residual != nullptr) add_row(x, residual, sum, n);
  const T* h = sum;  // without a residual x is T (the op checks)
  if constexpr (std::is_same_v<In, T>) h = residual == nullptr ? x : sum;
  const float inv = 1.0f / std::sqrt(sum_squares(h, n) / static_cast<float>(n) + eps);
  scale_row(h, w, out, inv, n);
}

template <typename In, typename T, typename O>
SPECSERVE_INLINE void silu_mul_row(const In* __restrict gate, const In* __restrict up,
                                  O* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = round_to<T>(widen(gate[i]));
    const float u = round_to<T>(widen(up[i]));
    const float s = round_to<T>(g / (1.0f + exp_approx(-g)));
    store(out + i, round_to<T>(s * u));
  }
}

// ---------------------------------------------------------------------------- SiLU*mul by hand
//
// GCC vectorizes silu_mul_row poorly (AVX512: masked code at ~4 ns a value; AVX2: not at all), so
// the hot case, float32 in (a GGUF GEMM's output) with bf16 roundings, has explicit SIMD rows:
// the same operations in the same order as silu_mul_row and exp_approx (no FMA), so bit-identical.

#define SPECSERVE_SIMD_SILU(NAME, TARGET, V, VI, W, PS, EPI, SI, CMPLT, CMPGT, BLEND, NANMASK)   \
  TARGET inline V NAME##_bf16(V v) {                                                             \
    const VI bits = _mm##W##_cast##PS##_si##SI(v);                                               \
    VI rounded = _mm##W##_add_epi32(bits, _mm##W##_set1_epi32(0x7fff));                          \
    rounded = _mm##W##_add_epi32(rounded, _mm##W##_and_si##SI(_mm##W##_srli_epi32(bits, 16),      \
                                                              _mm##W##_set1_epi32(1)));         \
    rounded = _mm##W##_and_si##SI(rounded, _mm##W##_set1_epi32(int(0xffff0000u)));               \
    const V out = _mm##W##_castsi##SI##_##PS(rounded);                                           \
    return BLEND(NANMASK(bits), out, _mm##W##_castsi##SI##_##PS(_mm##W##_set1_epi32(0x7fc00000))); \
  }                                                                                              \
  TARGET inline V NAME##_exp(V x) {                                                              \
    x = BLEND(CMPLT(x, _mm##W##_set1_ps(-87.0f)), x, _mm##W##_set1_ps(-87.0f));                  \
    x = BLEND(CMPGT(x, _mm##W##_set1_ps(88.0f)), x, _mm##W##_set1_ps(88.0f));                    \
    const V magic = _mm##W##_set1_ps(12582912.0f);                                               \
    const V n = _mm##W##_sub_ps(                                                                 \
        _mm##W##_add_ps(_mm##W##_mul_ps(x, _mm##W##_set1_ps(1.44269504088896341f)), magic), magic); \
    V r = _mm##W##_sub_ps(x, _mm##W##_mul_ps(n, _mm##W##_set1_ps(0.693359375f)));                 \
    r = _mm##W##_sub_ps(r, _mm##W##_mul_ps(n, _mm##W##_set1_ps(-2.12194440e-4f)));               \
    V p = _mm##W##_set1_ps(1.9875691500e-4f);                                                    \
    p = _mm##W##_add_ps(_mm##W##_mul_ps(p, r), _mm##W##_set1_ps(1.3981999507e-3f));              \
    p = _mm##W##_add_ps(_mm##W##_mul_ps(p, r), _mm##W##_set1_ps(8.3334519073e-3f));              \
    p = _mm##W##_add_ps(_mm##W##_mul_ps(p, r), _mm##W##_set1_ps(4.1665795894e-2f));              \
    p = _mm##W##_add_ps(_mm##W##_mul_ps(p, r), _mm##W##_set1_ps(1.6666665459e-1f));              \
    p = _mm##W##_add_ps(_mm##W##_mul_ps(p, r), _mm##W##_set1_ps(5.0000001201e-1f));              \
    p = _mm##W##_add_ps(_mm##W##_add_ps(_mm##W##_mul_ps(p, _mm##W##_mul_ps(r, r)), r),           \
                        _mm##W##_set1_ps(1.0f));                                                 \
    const VI exponent = _mm##W##_slli_epi32(                                                     \
        _mm##W##_add_epi32(_mm##W##_cvttps_epi32(n), _mm##W##_set1_epi32(127)), 23);             \
    return _mm##W##_mul_ps(p, _mm##W##_castsi##SI##_##PS(exponent));                              \
  }                                                                                              \
  /* float32 gate and up, bf16 roundings, float32 out; returns the values it did */              \
  TARGET inline int64_t NAME##_silu_row(const float* gate, const float* up, float* out, int64_t n) { \
    constexpr int64_t lanes = sizeof(V) / sizeof(float);                                         \
    int64_t i = 0;                                                                               \
    for (; i + lanes <= n; i += lanes) {                                                         \
      const V g = NAME##_bf16(_mm##W##_loadu_ps(gate + i));                                      \
      const V u = NAME##_bf16(_mm##W##_loadu_ps(up + i));                                        \
      const V e = NAME##_exp(_mm##W##_sub_ps(_mm##W##_setzero_ps(), g));                         \
      const V s = NAME##_bf16(_mm##W##_div_ps(g, _mm##W##_add_ps(_mm##W##_set1_ps(1.0f), e)));   \
      _mm##W##_storeu_ps(out + i, NAME##_bf16(_mm##W##_mul_ps(s, u)));                           \
    }                                                                                            \
    return i;                                                                                    \
  }

#define SPECSERVE_512_LT(a, b) _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ)
#define SPECSERVE_512_GT(a, b) _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ)
#define SPECSERVE_512_BLEND(mask, a, b) _mm512_mask_blend_ps(mask, a, b)
#define SPECSERVE_512_NAN(bits) \
  _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000))
#define SPECSERVE_256_LT(a, b) _mm256_cmp_ps(a, b, _CMP_LT_OQ)
#define SPECSERVE_256_GT(a, b) _mm256_cmp_ps(a, b, _CMP_GT_OQ)
#define SPECSERVE_256_BLEND(mask, a, b) _mm256_blendv_ps(a, b, mask)
#define SPECSERVE_256_NAN(bits) _mm256_castsi256_ps(_mm256_cmpgt_epi32( \
  _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000)))

SPECSERVE_SIMD_SILU(avx512, __attribute__((target("avx512f,avx512bw"))), __m512, __m512i, 512, ps,
                    epi32, 512, SPECSERVE_512_LT, SPECSERVE_512_GT, SPECSERVE_512_BLEND, SPECSERVE_512_NAN)
SPECSERVE_SIMD_SILU(avx2, __attribute__((target("avx2"))), __m256, __m256i, 256, ps, epi32, 256,
                    SPECSERVE_256_LT, SPECSERVE_256_GT, SPECSERVE_256_BLEND, SPECSERVE_256_NAN)

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

enum class Isa { kScalar, kAvx2, kAvx512 };

Isa pick(const std::string& name) {
  const bool avx512 = cpu::avx512(), avx2 = cpu::avx2();
  if (name == "scalar") return Isa::kScalar;
  if (name == "avx2") {
    TORCH_CHECK(avx2, "fused ops: this CPU has no AVX2");
    return Isa::kAvx2;
  }
  if (name == "avx512") {
    TORCH_CHECK(avx512, "fused ops: this CPU has no AVX512F/BW");
    return Isa::kAvx512;
  }
  TORCH_CHECK(name == "auto", "fused ops: isa must be auto, scalar, avx2 or avx512");
  return avx512 ? Isa::kAvx512 : avx2 ? Isa::kAvx2 : Isa::kScalar;
}

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
