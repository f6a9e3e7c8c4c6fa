// The row math of the fused ops (fused.cpp): one row's residual add, RMSNorm and SiLU*mul in the
// model dtype's roundings, written for the compiler to vectorize over 16 lanes, and SiLU*mul's
// hand-written AVX2 and AVX512 rows. fused.cpp compiles these once per variant (scalar, AVX2,
// AVX512) with FMA contraction off, so every variant computes a row bit-identically.
#pragma once
#pragma GCC optimize("fp-contract=off")

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#define SPECSERVE_INLINE __attribute__((always_inline)) inline

namespace specserve::fused {

constexpr int kLanes = 16;

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

}  // namespace specserve::fused
