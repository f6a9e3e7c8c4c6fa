// Paged attention, the AVX2 variant (attention.cpp has the overview and the reference).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on its own intrinsics headers

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention.h"

namespace specserve::attention {
namespace {

// ---------------------------------------------------------------------------- AVX2

// exp512's method on 8 lanes.
__attribute__((target("avx2,fma"))) inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

__attribute__((target("avx2,fma"))) inline float sum256(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

__attribute__((target("avx2,fma"))) inline float max256(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// values_tile512 on 8 lanes (16 registers: RB x CB accumulators, CB values, one broadcast).
template <int C, int RB, int CB, typename T>
__attribute__((target("avx2,fma"))) inline void values_tile256(const float* p, int64_t pstride,
                                                               const T* v, int64_t n,
                                                               float* acc, int c0, Feed& feed) {
  constexpr int64_t dim = 8 * C;
  __m256 o[RB][CB];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CB; ++c) o[r][c] = _mm256_loadu_ps(acc + r * dim + (c0 + c) * 8);
  for (int64_t t = 0; t < n; ++t) {
    __m256 vv[CB];
    for (int c = 0; c < CB; ++c) vv[c] = load8(v + t * dim + (c0 + c) * 8);
    feed.advance(CB * 8 * sizeof(T));
    for (int r = 0; r < RB; ++r) {
      const __m256 pr = _mm256_broadcast_ss(p + r * pstride + t);
      for (int c = 0; c < CB; ++c) o[r][c] = _mm256_fmadd_ps(pr, vv[c], o[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CB; ++c) _mm256_storeu_ps(acc + r * dim + (c0 + c) * 8, o[r][c]);
}

// Avx512 on 8 lanes: C = head_dim / 8.
template <int C>
struct Avx2 {
  static constexpr int64_t dim = 8 * C;

  template <typename T>
  __attribute__((target("avx2,fma"))) static void scores(const Range<T>& a) {
    const float* qf = as_f32(a.q, a.qf, a.rows * dim);
    for (int64_t i = 0; i < a.nblocks; ++i) {
      feed_scores(a, i);
      const float* k = as_f32(a.k[i], a.kf, a.nkeys[i] * dim);
      for (int64_t r = 0; r < a.rows; ++r) {
        const float* q = qf + r * dim;
        float* s = a.scores + r * a.stride() + i * a.slots;
        const int64_t n = a.visible(r, i);
        for (int64_t t = 0; t < n; ++t) {
          if (r == 0) a.feed->advance(dim * sizeof(T));  // a key read
          __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k + t * dim));
          __m256 s1 = _mm256_setzero_ps();
          for (int c = 1; c < C; ++c) {
            const __m256 qc = _mm256_loadu_ps(q + c * 8), kc = _mm256_loadu_ps(k + t * dim + c * 8);
            if (c & 1) s1 = _mm256_fmadd_ps(qc, kc, s1);
            else s0 = _mm256_fmadd_ps(qc, kc, s0);
          }
          s[t] = score_of<T>(sum256(_mm256_add_ps(s0, s1)), a.scale);
        }
        std::fill(s + n, s + a.slots, kNegInf);
      }
    }
  }

  __attribute__((target("avx2,fma"))) static const float* as_f32(const float* src, float*, int64_t) {
    return src;
  }
  __attribute__((target("avx2,fma"))) static const float* as_f32(const c10::BFloat16* src,
                                                                 float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
    return dst;
  }

  __attribute__((target("avx2,fma"))) static float softmax(float* p, int64_t n, float* l) {
    __m256 mv = _mm256_set1_ps(kNegInf);
    for (int64_t t = 0; t < n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(p + t));
    const float mx = max256(mv);
    if (mx == kNegInf) {
      std::fill(p, p + n, 0.f);
      *l = 0.f;
      return mx;
    }
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + t), _mm256_set1_ps(mx)));
      _mm256_storeu_ps(p + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    *l = sum256(sum);
    return mx;
  }

  template <typename T>
  __attribute__((target("avx2,fma"))) static void values(const float* p, int64_t pstride,
                                                         const T* v, int64_t n, int64_t rows,
                                                         int64_t, float* acc, Feed& feed) {
    constexpr int CB = C % 2 == 0 ? 2 : 1;
    constexpr int RB = 4;
    int64_t r = 0;
    for (; r + RB <= rows; r += RB)
      for (int c0 = 0; c0 < C; c0 += CB)
        values_tile256<C, RB, CB, T>(p + r * pstride, pstride, v, n, acc + r * dim, c0, feed);
    for (; r < rows; ++r)
      for (int c0 = 0; c0 < C; c0 += CB)
        values_tile256<C, 1, CB, T>(p + r * pstride, pstride, v, n, acc + r * dim, c0, feed);
  }
};

}  // namespace

// The AVX2 kernels by head_dim / 8; null where none is compiled.
template <typename T>
RangeFn<T> avx2_for(int64_t dim) {
  switch (dim) {
    case 16: return attend<Avx2<2>, T>;
    case 32: return attend<Avx2<4>, T>;
    case 64: return attend<Avx2<8>, T>;
    case 80: return attend<Avx2<10>, T>;
    case 96: return attend<Avx2<12>, T>;
    case 128: return attend<Avx2<16>, T>;
    case 256: return attend<Avx2<32>, T>;
    default: return nullptr;
  }
}

template RangeFn<float> avx2_for<float>(int64_t);
template RangeFn<c10::BFloat16> avx2_for<c10::BFloat16>(int64_t);

}  // namespace specserve::attention
