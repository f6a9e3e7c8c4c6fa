// Paged attention for short queries (decodes and speculative verify queries, 1-16 tokens a
// request), reading K and V in place from the KV pool through each request's block table.
//
// The pool, per layer, for K and for V: [kv_heads, num_blocks, block_size, head_dim], so the
// keys of one KV head in one block are block_size contiguous rows of head_dim values (float32 or
// bfloat16). Request b has start[b] tokens in the cache before this pass and qlen[b] new ones
// (already written to the pool); its queries are rows qoffset[b] .. qoffset[b] + qlen[b] of q
// [tokens, heads, head_dim]. Query j sees keys [0, start[b] + j]: the causal mask among a verify
// query's own tokens.
//
// Work: one item per (request, KV head, range of blocks, tile of up to 16 queries). An item takes
// the group's query heads of that KV head (GQA: every key is loaded once for all of them) times
// the tile's queries as rows, walks its blocks with an online softmax in float32 (running max m,
// sum l, output accumulator acc per row), and leaves (m, l, acc) behind. A context is split into ranges of
// split_tokens, so that both cores work even for one request at a long context; a second pass
// merges the ranges of each row by log-sum-exp: M = max m_s,
// out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M).
//
// Numerics follow engine/model/attention.py's eager path: a score is the dot product rounded to
// the cache dtype, then scaled; the softmax runs in float32. Unlike that path the
// probabilities are not rounded to bfloat16 before multiplying V (they cannot be: the online
// softmax never holds them normalized); the output is rounded once, at the end.
//
// Batch invariance: a row's arithmetic depends on its own position and context only (never on
// the query length, the tile, the batch or the threads), so a verify row equals the decode of
// its position bit for bit; tests/test_attention_kernel.py pins it for every variant.
//
// ISA: AVX512-BF16 (bfloat16 caches: the scores of 16 keys at once through `vdpbf16ps` on keys
// transposed per block), AVX512 and AVX2 block kernels, and the portable scalar one they are all
// tested against, chosen at run time; the library itself is built for baseline x86-64.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on its own intrinsics headers

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace specserve {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One row's softmax state across blocks.
struct RowState {
  float* m;    // [rows] running max
  float* l;    // [rows] running sum of e^(s - m)
  float* acc;  // [rows, dim] running sum of e^(s - m) * v
};

// What every block kernel gets: the item's query rows and one block's keys and values, as float32.
struct BlockArgs {
  const float* q;          // [rows, dim]
  const float* k;          // [nkeys, dim]
  const float* v;          // [nkeys, dim]
  const int64_t* visible;  // [rows] keys of this block each row sees (a prefix: 0..nkeys)
  int64_t rows, nkeys, dim;
  float scale;
  bool round_bf16;  // scores rounded to bfloat16 before scaling (a bfloat16 cache)
  float* scores;    // scratch [rows, nkeys] (the bf16 kernel) or [nkeys]
  // The bfloat16 kernel's own inputs: the rows and the keys as stored, and a scratch for the
  // keys transposed into dim-pair-major order.
  int64_t nkeys_padded = 0;               // the bf16 kernel's score rows: nkeys rounded up to 16
  const c10::BFloat16* q_bf16 = nullptr;  // [rows, dim]
  const c10::BFloat16* k_bf16 = nullptr;  // [nkeys, dim]
  int32_t* keys_t = nullptr;              // scratch [ceil(nkeys / 16), dim / 2, 16]
};

inline float score_of(float dot, const BlockArgs& a) {
  if (a.round_bf16) dot = static_cast<float>(c10::BFloat16(dot));
  return dot * a.scale;
}

// ---------------------------------------------------------------------------- scalar reference

void block_scalar(const BlockArgs& a, RowState st) {
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t n = a.visible[r];
    if (n == 0) continue;
    const float* q = a.q + r * a.dim;
    float mx = kNegInf;
    for (int64_t t = 0; t < n; ++t) {
      float dot = 0.f;
      for (int64_t d = 0; d < a.dim; ++d) dot += q[d] * a.k[t * a.dim + d];
      a.scores[t] = score_of(dot, a);
      mx = std::max(mx, a.scores[t]);
    }
    const float m_new = std::max(st.m[r], mx);
    const float alpha = std::exp(st.m[r] - m_new);  // 0 for the first block (m = -inf)
    float* acc = st.acc + r * a.dim;
    for (int64_t d = 0; d < a.dim; ++d) acc[d] *= alpha;
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      const float p = std::exp(a.scores[t] - m_new);
      sum += p;
      for (int64_t d = 0; d < a.dim; ++d) acc[d] += p * a.v[t * a.dim + d];
    }
    st.l[r] = st.l[r] * alpha + sum;
    st.m[r] = m_new;
  }
}

// ---------------------------------------------------------------------------- AVX512

// e^x for 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial (Taylor
// coefficients, relative error ~2e-7 on that range), 2^n through the exponent bits. Inputs below
// -87 flush to 0 (softmax arguments are <= 0).
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

// One row's online-softmax step over a block whose n scores (max mx) are in `scores`: rescale
// the row's state, turn the scores into e^(s - m) in place, and add their weighted values.
template <int C>
__attribute__((target("avx512f"))) inline void softmax_pv_avx512(const BlockArgs& a, RowState st,
                                                                 int64_t r, int64_t n, float mx,
                                                                 float* scores) {
  constexpr int64_t dim = 16 * C;
  const float m_new = std::max(st.m[r], mx);
  const float alpha = std::exp(st.m[r] - m_new);
  float sum = 0.f;
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 live = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(live, scores + t);
    const __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
    _mm512_mask_storeu_ps(scores + t, live, p);
    sum += _mm512_reduce_add_ps(p);
  }
  st.l[r] = st.l[r] * alpha + sum;
  st.m[r] = m_new;
  float* acc = st.acc + r * dim;
  __m512 o[C];
  for (int c = 0; c < C; ++c) o[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + c * 16), _mm512_set1_ps(alpha));
  for (int64_t u = 0; u < n; ++u) {
    const __m512 p = _mm512_set1_ps(scores[u]);
    for (int c = 0; c < C; ++c) o[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(a.v + u * dim + c * 16), o[c]);
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + c * 16, o[c]);
}

// C = head_dim / 16 chunks of 16 lanes, a compile-time constant so that a query row and an
// output row live in registers: the V accumulation runs C independent FMA chains per key
// (one chain per row would wait on FMA latency at every key).
template <int C>
__attribute__((target("avx512f"))) void block_avx512(const BlockArgs& a, RowState st) {
  constexpr int64_t dim = 16 * C;
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t n = a.visible[r];
    if (n == 0) continue;
    __m512 q[C];
    for (int c = 0; c < C; ++c) q[c] = _mm512_loadu_ps(a.q + r * dim + c * 16);
    float mx = kNegInf;
    for (int64_t t = 0; t < n; ++t) {
      const float* k = a.k + t * dim;
      __m512 s0 = _mm512_mul_ps(q[0], _mm512_loadu_ps(k));
      __m512 s1 = _mm512_setzero_ps();
      for (int c = 1; c < C; ++c) {
        if (c & 1) s1 = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k + c * 16), s1);
        else s0 = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k + c * 16), s0);
      }
      a.scores[t] = score_of(_mm512_reduce_add_ps(_mm512_add_ps(s0, s1)), a);
      mx = std::max(mx, a.scores[t]);
    }
    softmax_pv_avx512<C>(a, st, r, n, mx, a.scores);
  }
}

__attribute__((target("avx512f"))) void bf16_to_f32_avx512(const c10::BFloat16* src, float* dst,
                                                           int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}


// ---------------------------------------------------------------------------- AVX512-BF16

// In-place transpose of a 16 x 16 matrix of 32-bit elements, r[i] its row i.
__attribute__((target("avx512f"))) inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + c], 128-bit lane L: column 4L + c of rows 4i .. 4i + 3
  __m512i u[16];
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);  // lanes 0, 2 of each
    const __m512i x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);  // lanes 1, 3 of each
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[4 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// Keys [nkeys, dim] bf16 -> keys_t [group of 16 keys][dim / 2][16]: lane t of pair p holds
// (k[t][2p], k[t][2p + 1]), what `vdpbf16ps` multiplies against a broadcast pair of the query.
// Keys past nkeys read as zero (their scores are masked).
__attribute__((target("avx512f"))) void transpose_keys(const c10::BFloat16* k, int64_t nkeys,
                                                       int64_t dim, int32_t* keys_t) {
  const int64_t pairs = dim / 2;
  for (int64_t t0 = 0; t0 < nkeys; t0 += 16) {
    int32_t* out = keys_t + (t0 / 16) * pairs * 16;
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      const __mmask16 cols = pairs - p0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (pairs - p0)) - 1);
      __m512i r[16];
      for (int t = 0; t < 16; ++t)
        r[t] = t0 + t < nkeys ? _mm512_maskz_loadu_epi32(cols, k + (t0 + t) * dim + 2 * p0)
                              : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t i = 0; i < std::min<int64_t>(16, pairs - p0); ++i)
        _mm512_storeu_si512(out + (p0 + i) * 16, r[i]);
    }
  }
}

// Scores of RB rows against 16 keys (keys_t of one group): per row two chains of `vdpbf16ps`
// (even and odd dim pairs) added at the end. A row's arithmetic is the same whichever rows it
// is computed with, so RB only sets how many independent chains are in flight.
template <int RB>
__attribute__((target("avx512f,avx512bf16"))) inline void scores_bf16(const int32_t* q_pairs,
                                                                     int64_t pairs,
                                                                     const int32_t* keys_t,
                                                                     __m512 out[RB]) {
  __m512 even[RB], odd[RB];
  for (int i = 0; i < RB; ++i) even[i] = odd[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p += 2) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(keys_t + p * 16);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(keys_t + (p + 1) * 16);
    for (int i = 0; i < RB; ++i) {
      even[i] = _mm512_dpbf16_ps(even[i], k0, (__m512bh)_mm512_set1_epi32(q_pairs[i * pairs + p]));
      odd[i] = _mm512_dpbf16_ps(odd[i], k1, (__m512bh)_mm512_set1_epi32(q_pairs[i * pairs + p + 1]));
    }
  }
  for (int i = 0; i < RB; ++i) out[i] = _mm512_add_ps(even[i], odd[i]);
}

// 16 dot products -> scores: rounded to bf16 (as the cache dtype's matmul would), then scaled.
__attribute__((target("avx512f,avx512bf16"))) inline void store_scores(__m512 dots,
                                                                      const BlockArgs& a,
                                                                      float* dst) {
  const __m512 rounded = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(dots));
  _mm512_storeu_ps(dst, _mm512_mul_ps(rounded, _mm512_set1_ps(a.scale)));
}

// block_avx512 for a bfloat16 cache on a CPU with AVX512-BF16: the scores come from the keys
// as stored through `vdpbf16ps` (16 keys in the lanes), rounded to bf16 and scaled as the other
// kernels do; the softmax and the values are block_avx512's.
template <int C>
__attribute__((target("avx512f,avx512bf16"))) void block_bf16(const BlockArgs& a, RowState st) {
  constexpr int64_t dim = 16 * C, pairs = dim / 2;
  constexpr int RB = 4;
  transpose_keys(a.k_bf16, a.nkeys, dim, a.keys_t);
  const auto* q_pairs = reinterpret_cast<const int32_t*>(a.q_bf16);
  for (int64_t t0 = 0; t0 < a.nkeys; t0 += 16) {
    const int32_t* kt = a.keys_t + (t0 / 16) * pairs * 16;
    int64_t r = 0;
    for (; r + RB <= a.rows; r += RB) {
      __m512 s[RB];
      scores_bf16<RB>(q_pairs + r * pairs, pairs, kt, s);
      for (int i = 0; i < RB; ++i) store_scores(s[i], a, a.scores + (r + i) * a.nkeys_padded + t0);
    }
    for (; r < a.rows; ++r) {
      __m512 s[1];
      scores_bf16<1>(q_pairs + r * pairs, pairs, kt, s);
      store_scores(s[0], a, a.scores + r * a.nkeys_padded + t0);
    }
  }
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t n = a.visible[r];
    if (n == 0) continue;
    float* scores = a.scores + r * a.nkeys_padded;
    float mx = kNegInf;
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, scores[t]);
    softmax_pv_avx512<C>(a, st, r, n, mx, scores);
  }
}

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

// block_avx512 on 8 lanes: C = head_dim / 8.
template <int C>
__attribute__((target("avx2,fma"))) void block_avx2(const BlockArgs& a, RowState st) {
  constexpr int64_t dim = 8 * C;
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t n = a.visible[r];
    if (n == 0) continue;
    const float* q = a.q + r * dim;
    float mx = kNegInf;
    for (int64_t t = 0; t < n; ++t) {
      const float* k = a.k + t * dim;
      __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
      __m256 s1 = _mm256_setzero_ps();
      for (int c = 1; c < C; ++c) {
        const __m256 prod_q = _mm256_loadu_ps(q + c * 8), kk = _mm256_loadu_ps(k + c * 8);
        if (c & 1) s1 = _mm256_fmadd_ps(prod_q, kk, s1);
        else s0 = _mm256_fmadd_ps(prod_q, kk, s0);
      }
      a.scores[t] = score_of(sum256(_mm256_add_ps(s0, s1)), a);
      mx = std::max(mx, a.scores[t]);
    }
    const float m_new = std::max(st.m[r], mx);
    const float alpha = std::exp(st.m[r] - m_new);
    float sum = 0.f;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
      const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(a.scores + t), _mm256_set1_ps(m_new)));
      _mm256_storeu_ps(a.scores + t, p);
      sum += sum256(p);
    }
    for (; t < n; ++t) {
      a.scores[t] = std::exp(a.scores[t] - m_new);
      sum += a.scores[t];
    }
    st.l[r] = st.l[r] * alpha + sum;
    st.m[r] = m_new;
    float* acc = st.acc + r * dim;
    __m256 o[C];
    for (int c = 0; c < C; ++c) o[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + c * 8), _mm256_set1_ps(alpha));
    for (int64_t u = 0; u < n; ++u) {
      const __m256 p = _mm256_set1_ps(a.scores[u]);
      for (int c = 0; c < C; ++c) o[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(a.v + u * dim + c * 8), o[c]);
    }
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + c * 8, o[c]);
  }
}

__attribute__((target("avx2,fma"))) void bf16_to_f32_avx2(const c10::BFloat16* src, float* dst,
                                                          int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// ---------------------------------------------------------------------------- dispatch

using BlockFn = void (*)(const BlockArgs&, RowState);

bool has_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return yes;
}

bool has_avx2() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
}

bool has_avx512bf16() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return has_avx512() && __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return yes;
}

enum class Isa { kAuto, kScalar, kAvx2, kAvx512, kAvx512Bf16 };

// The AVX2 block kernels by head_dim / 8; null where none is compiled.
BlockFn avx2_for(int64_t dim) {
  switch (dim) {
    case 16: return block_avx2<2>;
    case 32: return block_avx2<4>;
    case 64: return block_avx2<8>;
    case 80: return block_avx2<10>;
    case 96: return block_avx2<12>;
    case 128: return block_avx2<16>;
    case 256: return block_avx2<32>;
    default: return nullptr;
  }
}

// The AVX512 block kernels by head_dim / 16; null where none is compiled.
BlockFn avx512_for(int64_t dim) {
  switch (dim) {
    case 16: return block_avx512<1>;
    case 32: return block_avx512<2>;
    case 64: return block_avx512<4>;
    case 80: return block_avx512<5>;
    case 96: return block_avx512<6>;
    case 128: return block_avx512<8>;
    case 256: return block_avx512<16>;
    default: return nullptr;
  }
}

// The AVX512-BF16 block kernels (bfloat16 caches) by head_dim / 16; null where none is compiled.
BlockFn bf16_for(int64_t dim) {
  switch (dim) {
    case 32: return block_bf16<2>;
    case 64: return block_bf16<4>;
    case 96: return block_bf16<6>;
    case 128: return block_bf16<8>;
    case 256: return block_bf16<16>;
    default: return nullptr;
  }
}

Isa pick(const std::string& isa, int64_t dim, bool bf16) {
  const bool avx512_ok = has_avx512() && avx512_for(dim) != nullptr;
  const bool avx2_ok = has_avx2() && avx2_for(dim) != nullptr;
  const bool bf16_ok = bf16 && has_avx512bf16() && bf16_for(dim) != nullptr;
  if (isa == "scalar") return Isa::kScalar;
  if (isa == "avx512bf16") {
    TORCH_CHECK(bf16_ok, "paged_attention: avx512bf16 needs a bfloat16 cache and the CPU (head_dim ",
                dim, ")");
    return Isa::kAvx512Bf16;
  }
  if (isa == "avx512") {
    TORCH_CHECK(avx512_ok, "paged_attention: avx512 unavailable (CPU or head_dim ", dim, ")");
    return Isa::kAvx512;
  }
  if (isa == "avx2") {
    TORCH_CHECK(avx2_ok, "paged_attention: avx2 unavailable (CPU or head_dim ", dim, ")");
    return Isa::kAvx2;
  }
  TORCH_CHECK(isa == "auto", "paged_attention: isa must be auto, scalar, avx2, avx512 or avx512bf16");
  return bf16_ok ? Isa::kAvx512Bf16 : avx512_ok ? Isa::kAvx512 : avx2_ok ? Isa::kAvx2 : Isa::kScalar;
}

template <typename T>
void to_f32(const T* src, float* dst, int64_t n, Isa isa) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16) return bf16_to_f32_avx512(src, dst, n);
    if (isa == Isa::kAvx2) return bf16_to_f32_avx2(src, dst, n);
  }
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// ---------------------------------------------------------------------------- the op

// Rows of a (request, KV head) are ordered query-major, row j * group + g: query j of head
// h * group + g, so a tile of queries is a contiguous run of rows.
struct Item {
  int64_t b, h, block_begin, block_end;
  int64_t row_offset;        // of the (request, KV head, range)'s first row, into the partials
  int64_t q_begin, q_end;    // the tile of queries this item computes
};

// Queries an item takes at once: a prompt chunk's rows are tiled so that a tile's queries and
// accumulators stay in cache while its blocks stream past, and so that a long prompt gives the
// threads many items. A row's arithmetic does not depend on the tile it is in.
constexpr int64_t kQueryTile = 16;

struct Batch {
  std::vector<int64_t> start, qlen, qoffset, splits;
  std::vector<Item> items;
  int64_t total_rows = 0;
};

// Ranges per (request, KV head) of split_tokens each (the last one shorter). The split depends
// on the request's own context only, never on the batch or the thread count, so a request's
// output does not change with what it is batched with (and a tensor-parallel rank, holding
// some KV heads, computes each head as the whole model would).
Batch plan(const at::Tensor& start, const at::Tensor& qlen, int64_t kv_heads, int64_t group,
           int64_t block_size, int64_t max_blocks, int64_t split_tokens) {
  Batch p;
  const int64_t batch = start.size(0);
  const auto* s = start.data_ptr<int64_t>();
  const auto* q = qlen.data_ptr<int64_t>();
  const int64_t split_blocks = std::max<int64_t>(1, split_tokens / block_size);
  int64_t offset = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t blocks = (s[b] + q[b] + block_size - 1) / block_size;
    TORCH_CHECK(q[b] >= 1 && blocks <= max_blocks, "paged_attention: bad request ", b);
    const int64_t splits = (blocks + split_blocks - 1) / split_blocks;
    p.start.push_back(s[b]);
    p.qlen.push_back(q[b]);
    p.qoffset.push_back(offset);
    p.splits.push_back(splits);
    offset += q[b];
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t i = 0; i < splits; ++i) {
        for (int64_t j = 0; j < q[b]; j += kQueryTile)
          p.items.push_back({b, h, i * split_blocks, std::min(blocks, (i + 1) * split_blocks),
                            p.total_rows, j, std::min(q[b], j + kQueryTile)});
        p.total_rows += group * q[b];
      }
  }
  return p;
}

template <typename T>
void run_items(const Batch& p, const at::Tensor& q, const at::Tensor& k_cache,
               const at::Tensor& v_cache, const at::Tensor& tables, float scale, Isa isa,
               float* m, float* l, float* acc) {
  const int64_t heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1);
  const int64_t block_size = k_cache.size(2), group = heads / kv_heads;
  const int64_t max_blocks = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const BlockFn block = isa == Isa::kAvx512Bf16 ? bf16_for(dim)
                       : isa == Isa::kAvx512   ? avx512_for(dim)
                       : isa == Isa::kAvx2     ? avx2_for(dim)
                                               : block_scalar;
  const bool round = std::is_same_v<T, c10::BFloat16>;
  const bool keys_as_stored = isa == Isa::kAvx512Bf16;  // the bf16 kernel reads q and K as stored
  const int64_t padded = (block_size + 15) / 16 * 16;
  at::parallel_for(0, static_cast<int64_t>(p.items.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf, kf(block_size * dim), vf(block_size * dim), scores;
    std::vector<c10::BFloat16> qh;
    std::vector<int32_t> keys_t(keys_as_stored ? padded * dim / 2 : 0);
    std::vector<int64_t> visible;
    for (int64_t i = lo; i < hi; ++i) {
      const Item& it = p.items[i];
      const int64_t qn = p.qlen[it.b], start = p.start[it.b];
      const int64_t rows = group * (it.q_end - it.q_begin), first_row = group * it.q_begin;
      visible.resize(rows);
      scores.resize(keys_as_stored ? rows * padded : block_size);
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (keys_as_stored) {
          qh.resize(rows * dim);
          for (int64_t j = it.q_begin; j < it.q_end; ++j)  // a query's heads are contiguous rows
            std::copy_n(qp + ((p.qoffset[it.b] + j) * heads + it.h * group) * dim, group * dim,
                        qh.data() + (j - it.q_begin) * group * dim);
        }
      }
      if (!keys_as_stored) {
        qf.resize(rows * dim);
        for (int64_t j = it.q_begin; j < it.q_end; ++j)  // row j * group + g: query j, head h * group + g
          for (int64_t g = 0; g < group; ++g)
            to_f32(qp + ((p.qoffset[it.b] + j) * heads + it.h * group + g) * dim,
                   qf.data() + ((j - it.q_begin) * group + g) * dim, dim, isa);
      }
      const int64_t at = it.row_offset + first_row;
      RowState st{m + at, l + at, acc + at * dim};
      std::fill(st.m, st.m + rows, kNegInf);
      std::fill(st.l, st.l + rows, 0.f);
      std::fill(st.acc, st.acc + rows * dim, 0.f);
      for (int64_t blk = it.block_begin; blk < it.block_end; ++blk) {
        const int64_t first = blk * block_size;
        if (first > start + it.q_end - 1) break;  // past the tile's last query: seen by none
        const int64_t id = tp[it.b * max_blocks + blk];
        TORCH_CHECK(id >= 0 && id < num_blocks, "paged_attention: block id out of range");
        const int64_t nkeys = std::min(block_size, start + qn - first);
        for (int64_t r = 0; r < rows; ++r)
          visible[r] = std::clamp<int64_t>(start + it.q_begin + r / group + 1 - first, 0, nkeys);
        const int64_t base = ((it.h * num_blocks) + id) * block_size * dim;
        const float* kb = nullptr;
        const float* vb;
        BlockArgs a{qf.data(), nullptr, nullptr, visible.data(), rows, nkeys, dim, scale, round,
                    scores.data()};
        if constexpr (std::is_same_v<T, float>) {
          kb = kp + base;
          vb = vp + base;
        } else {
          if (keys_as_stored) {
            a.q_bf16 = qh.data();
            a.k_bf16 = kp + base;
            a.keys_t = keys_t.data();
            a.nkeys_padded = padded;
          } else {
            to_f32(kp + base, kf.data(), nkeys * dim, isa);
            kb = kf.data();
          }
          to_f32(vp + base, vf.data(), nkeys * dim, isa);
          vb = vf.data();
        }
        a.k = kb;
        a.v = vb;
        block(a, st);
      }
    }
  });
}

template <typename T>
void merge(const Batch& p, int64_t heads, int64_t kv_heads, int64_t dim, const float* m,
           const float* l, const float* acc, at::Tensor& out) {
  const int64_t group = heads / kv_heads;
  T* op = out.data_ptr<T>();
  // item index of (b, h, split 0, tile 0): items are laid out b-major, then h, split, tile
  std::vector<int64_t> first_item(p.start.size()), tiles(p.start.size());
  for (size_t b = 0, n = 0; b < p.start.size(); ++b) {
    first_item[b] = static_cast<int64_t>(n);
    tiles[b] = (p.qlen[b] + kQueryTile - 1) / kQueryTile;
    n += kv_heads * p.splits[b] * tiles[b];
  }
  const int64_t batch = static_cast<int64_t>(p.start.size());
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> row(dim);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / kv_heads, h = bh % kv_heads, qn = p.qlen[b];
      const int64_t splits = p.splits[b], stride = tiles[b];  // items of one range: its tiles
      const Item* items = p.items.data() + first_item[b] + h * splits * stride;
      for (int64_t r = 0; r < group * qn; ++r) {
        float mx = kNegInf;
        for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, m[items[s * stride].row_offset + r]);
        float total = 0.f;
        std::fill(row.begin(), row.end(), 0.f);
        for (int64_t s = 0; s < splits; ++s) {
          const int64_t at = items[s * stride].row_offset + r;
          if (m[at] == kNegInf) continue;  // a range this row sees none of
          const float w = std::exp(m[at] - mx);
          total += l[at] * w;
          for (int64_t d = 0; d < dim; ++d) row[d] += acc[at * dim + d] * w;
        }
        const int64_t g = r % group, j = r / group;
        T* dst = op + ((p.qoffset[b] + j) * heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(row[d] / total);
      }
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& start_pos, const at::Tensor& query_lens,
                           double scale, const std::string& isa_name, int64_t split_tokens) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: q [tokens, heads, dim], caches [kv_heads, blocks, block, dim]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: contiguous tensors only");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_attention: q and the caches share one dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(0) == 0,
              "paged_attention: head_dim or GQA grouping mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && start_pos.scalar_type() == at::kLong &&
                  query_lens.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "paged_attention: int64 block tables, start positions and query lengths");
  const at::Tensor start = start_pos.contiguous(), qlen = query_lens.contiguous();
  TORCH_CHECK(start.size(0) == qlen.size(0) && block_tables.size(0) == start.size(0),
              "paged_attention: one block table, start and length per request");
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(0);
  const Batch p = plan(start, qlen, kv_heads, heads / kv_heads, k_cache.size(2),
                       block_tables.size(1), split_tokens);
  TORCH_CHECK(p.qoffset.empty() || p.qoffset.back() + p.qlen.back() == q.size(0),
              "paged_attention: query lengths must sum to q's tokens");
  const Isa isa = pick(isa_name, dim, q.scalar_type() == at::kBFloat16);
  std::vector<float> m(p.total_rows), l(p.total_rows), acc(p.total_rows * dim);
  at::Tensor out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    run_items<float>(p, q, k_cache, v_cache, block_tables, s, isa, m.data(), l.data(), acc.data());
    merge<float>(p, heads, kv_heads, dim, m.data(), l.data(), acc.data(), out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_attention: float32 or bfloat16");
    run_items<c10::BFloat16>(p, q, k_cache, v_cache, block_tables, s, isa, m.data(), l.data(),
                             acc.data());
    merge<c10::BFloat16>(p, heads, kv_heads, dim, m.data(), l.data(), acc.data(), out);
  }
  return out;
}

}  // namespace
}  // namespace specserve

TORCH_LIBRARY_FRAGMENT(specserve_kernels, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor start_pos, Tensor query_lens, float scale, str isa='auto', "
      "int split_tokens=256) -> Tensor",
      &specserve::paged_attention);
}
