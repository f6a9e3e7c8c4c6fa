// Paged attention's AVX512 kernel (`Avx512<C>`), which the AVX512-BF16 and AMX kernels build on
// (attention_bf16.cpp). Every function is compiled for avx512f and runs only once the CPU has
// said it has AVX512 (isa.h).
#pragma once
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

// ---------------------------------------------------------------------------- AVX512

// e^x for 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial (Taylor
// coefficients, relative error ~2e-7 on that range), 2^n through the exponent bits. Inputs below
// -87 (and -inf) give 0 (softmax arguments are <= 0).
__attribute__((target("avx512f"))) inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln2, high part
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);       // ln2, low part
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(~tiny, p, _mm512_castsi512_ps(bits));
}

// 16 values as float32, from a float32 or a bfloat16 row (widened exactly: the bits shifted up).
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// RB rows x CB chunks of 16 lanes of the output, over the n keys of one block: each value chunk
// is loaded once for the RB rows, each probability broadcast once for the CB chunks. A row's
// arithmetic (one FMA per key and lane, keys in order) is the same in any tile.
template <int C, int RB, int CB, typename T>
__attribute__((target("avx512f"))) inline void values_tile512(const float* p, int64_t pstride,
                                                              int64_t kstride, const T* v,
                                                              int64_t n, float* acc, int c0,
                                                              Feed& feed) {
  constexpr int64_t dim = 16 * C;
  __m512 o[RB][CB];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CB; ++c) o[r][c] = _mm512_loadu_ps(acc + r * dim + (c0 + c) * 16);
  for (int64_t t = 0; t < n; ++t) {
    __m512 vv[CB];
    for (int c = 0; c < CB; ++c) vv[c] = load16(v + t * dim + (c0 + c) * 16);
    feed.advance(CB * 16 * sizeof(T));
    for (int r = 0; r < RB; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * pstride + t * kstride]);
      for (int c = 0; c < CB; ++c) o[r][c] = _mm512_fmadd_ps(pr, vv[c], o[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CB; ++c) _mm512_storeu_ps(acc + r * dim + (c0 + c) * 16, o[r][c]);
}

// C = head_dim / 16 chunks of 16 lanes, a compile-time constant so that query rows, value chunks
// and output tiles live in registers.
template <int C>
struct Avx512 {
  static constexpr int64_t dim = 16 * C;

  // Scores in float32: per row and key two FMA chains over the chunks, reduced.
  template <typename T>
  __attribute__((target("avx512f"))) static void scores(const Range<T>& a) {
    const float* qf = as_f32(a.q, a.qf, a.rows * dim);
    for (int64_t i = 0; i < a.nblocks; ++i) {
      feed_scores(a, i);
      const float* k = as_f32(a.k[i], a.kf, a.nkeys[i] * dim);
      for (int64_t r = 0; r < a.rows; ++r) {
        __m512 q[C];
        for (int c = 0; c < C; ++c) q[c] = _mm512_loadu_ps(qf + r * dim + c * 16);
        float* s = a.scores + r * a.stride() + i * a.slots;
        const int64_t n = a.visible(r, i);
        for (int64_t t = 0; t < n; ++t) {
          if (r == 0) a.feed->advance(dim * sizeof(T));  // a key read
          __m512 s0 = _mm512_mul_ps(q[0], _mm512_loadu_ps(k + t * dim));
          __m512 s1 = _mm512_setzero_ps();
          for (int c = 1; c < C; ++c) {
            if (c & 1) s1 = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k + t * dim + c * 16), s1);
            else s0 = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k + t * dim + c * 16), s0);
          }
          s[t] = score_of<T>(_mm512_reduce_add_ps(_mm512_add_ps(s0, s1)), a.scale);
        }
        std::fill(s + n, s + a.slots, kNegInf);
      }
    }
  }

  // n values in float32: float32 ones as they are, bfloat16 ones widened into dst
  __attribute__((target("avx512f"))) static const float* as_f32(const float* src, float*, int64_t) {
    return src;
  }
  __attribute__((target("avx512f"))) static const float* as_f32(const c10::BFloat16* src,
                                                                float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
    return dst;
  }

  __attribute__((target("avx512f"))) static float softmax(float* p, int64_t n, float* l) {
    __m512 mv = _mm512_set1_ps(kNegInf);
    for (int64_t t = 0; t < n; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(p + t));
    const float mx = _mm512_reduce_max_ps(mv);
    if (mx == kNegInf) {  // a row that sees none of the range
      std::fill(p, p + n, 0.f);
      *l = 0.f;
      return mx;
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(p + t), _mm512_set1_ps(mx)));
      _mm512_storeu_ps(p + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    *l = _mm512_reduce_add_ps(sum);
    return mx;
  }

  // p[r * pstride + t * kstride]: the probability of row r for the block's key t
  template <typename T>
  __attribute__((target("avx512f"))) static void values(const float* p, int64_t pstride,
                                                        const T* v, int64_t n, int64_t rows,
                                                        int64_t, float* acc, Feed& feed,
                                                        int64_t kstride = 1) {
    constexpr int CB = C % 4 == 0 ? 4 : C % 2 == 0 ? 2 : 1;
    constexpr int RB = 6;
    int64_t r = 0;
    for (; r + RB <= rows; r += RB)
      for (int c0 = 0; c0 < C; c0 += CB)
        values_tile512<C, RB, CB, T>(p + r * pstride, pstride, kstride, v, n, acc + r * dim, c0, feed);
    for (; r < rows; ++r)
      for (int c0 = 0; c0 < C; c0 += CB)
        values_tile512<C, 1, CB, T>(p + r * pstride, pstride, kstride, v, n, acc + r * dim, c0, feed);
  }
};

}  // namespace specserve::attention
