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
// the tile's queries as rows and runs in three passes over its range (256 tokens by default):
// every score (keys of a block loaded once for all rows), each row's softmax over the whole
// range in float32 (its max m and sum l), then the values weighted by the probabilities (each
// value row loaded once for a tile of up to 6 rows) into the row's accumulator acc. A context is
// split into ranges of split_tokens, so that both cores work even for one request at a long
// context; a second pass merges the ranges of each row by log-sum-exp: M = max m_s,
// out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M).
//
// Numerics follow engine/model/attention.py's eager path: a score is the dot product rounded to
// the cache dtype, then scaled; the softmax runs in float32. Unlike that path the
// probabilities are not rounded to bfloat16 before multiplying V (they are not normalized until
// the merge), except in the AVX512-BF16 variant, whose values pass takes them as bf16 pairs
// through `vdpbf16ps`; the output is rounded once, at the end.
//
// Batch invariance: a row's arithmetic depends on its own position and context only (never on
// the query length, the tile, the batch or the threads), so a verify row equals the decode of
// its position bit for bit; tests/test_attention_kernel.py pins it for every variant.
//
// ISA: AMX-BF16 (bfloat16 caches in blocks of 16: the scores of a block for 16 rows in one
// `tdpbf16ps` per 32 dims, from the keys as stored), AVX512-BF16 (bfloat16 caches: the scores
// of 16 keys at once through `vdpbf16ps` on keys transposed per block, the values two keys an
// instruction through it too), AVX512 and AVX2 kernels,
// and the portable scalar one they are all tested against, chosen at run time; the library
// itself is built for baseline x86-64.
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
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "ops.h"

namespace specserve {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One item's result per row: the range's max score m, the sum l of e^(s - m), and the output
// accumulator acc = sum of e^(s - m) * v (merged over ranges afterwards).
struct RowState {
  float* m;    // [rows]
  float* l;    // [rows]
  float* acc;  // [rows, dim]
};

// The lines a range will read next, asked of L2 as the kernel reads: each `advance(bytes)`
// asks for as many bytes ahead as the kernel has just read, so the memory system streams the
// next blocks while this one is computed. The pool's blocks are scattered 4 KB runs, so the
// hardware prefetcher stops at each block's end. A whole block's prefetches at once (what this
// replaced) helped little on Zen 4: the core stalls on a burst of 64 misses. Spread over the
// block's loads, the same lines took 0.64-0.68x the burst's time for a decode at 2,700 and 8,000
// tokens, 0.78x for a 4-token verify (cold, 28 layers; docs/ATTENTION.md).
struct Feed {
  const char* next = nullptr;
  const char* end = nullptr;
  // What to read next (the rest of the last queue asked at once, a rare leftover).
  void queue(const void* p, int64_t bytes) {
    advance(end - next);
    next = static_cast<const char*>(p);
    end = next + bytes;
  }
  void advance(int64_t bytes) {
    for (; bytes > 0 && next < end; bytes -= 64, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// Blocks ahead of the one being read that the feed asks for: two measured best on Zen 4 (one
// and three within 5%, six 15% slower).
constexpr int64_t kFeedBlocks = 2;

// What an item's kernels read: `rows` query rows against the blocks of one range of a request's
// context. Keys at positions < limit[r] are visible to row r (its causal limit); a block's slots
// past its keys, and keys a row does not see, score -inf.
template <typename T>
struct Range {
  const T* q;             // [rows, dim] as stored
  float* qf;              // scratch [rows, dim]: the rows in float32 (kernels that score in it)
  const int64_t* limit;   // [rows]
  const T* const* k;      // [nblocks]: a block's keys [block_size, dim]
  const T* const* v;      // [nblocks]: its values
  const int64_t* nkeys;   // [nblocks]: keys in the block (the last one may be partial)
  int64_t first;          // position of the range's first key
  int64_t rows, nblocks, block_size, dim;
  int64_t slots;          // score slots per block: block_size rounded up to 16
  float scale;
  float* scores;          // scratch [max(rows, 16), nblocks * slots]: scores, then probabilities
                          // (row-major; the AMX kernel's key-major [nblocks * 16][16 rows])
  float* kf;              // scratch [block_size, dim]: a block's keys in float32
  int32_t* keys_t;        // scratch [slots / 16, dim / 2, 16]: the bf16 kernel's transposed keys
  Feed* feed;             // the thread's prefetch queue
  bool fed;               // the first kFeedBlocks blocks' keys are asked for (by the last range)
  const T* then[kFeedBlocks];  // the thread's next range's first key blocks (null: none)
  int64_t stride() const { return nblocks * slots; }
  // Bytes of block i's keys (or values) the range reads.
  int64_t bytes(int64_t i) const { return nkeys[i] * dim * int64_t(sizeof(T)); }
  // Keys of block i row r sees: a prefix of the block.
  int64_t visible(int64_t r, int64_t i) const {
    return std::clamp<int64_t>(limit[r] - (first + i * block_size), 0, nkeys[i]);
  }
};

// The scores pass reads the keys block by block, then the values pass the values: while block
// i's scores are computed, the feed brings in block i + kFeedBlocks's keys, past the last block
// the first values; while block i's values are added, block i + kFeedBlocks's values, past the
// last block the keys the thread reads next (its next range's first blocks).
template <typename T>
inline void feed_scores(const Range<T>& a, int64_t i) {
  if (i == 0 && !a.fed)
    for (int64_t j = 1; j < std::min(kFeedBlocks, a.nblocks); ++j) a.feed->queue(a.k[j], a.bytes(j));
  const int64_t j = i + kFeedBlocks;
  if (j < a.nblocks) a.feed->queue(a.k[j], a.bytes(j));
  else if (j - a.nblocks < a.nblocks) a.feed->queue(a.v[j - a.nblocks], a.bytes(j - a.nblocks));
}

template <typename T>
inline void feed_values(const Range<T>& a, int64_t i) {
  const int64_t j = i + kFeedBlocks;
  if (j < a.nblocks) a.feed->queue(a.v[j], a.bytes(j));
  else if (j - a.nblocks < kFeedBlocks && a.then[j - a.nblocks] != nullptr)
    a.feed->queue(a.then[j - a.nblocks], a.block_size * a.dim * int64_t(sizeof(T)));
}

// A score as the eager path computes it: the dot product rounded to the cache dtype, then scaled.
template <typename T>
inline float score_of(float dot, float scale) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) dot = static_cast<float>(c10::BFloat16(dot));
  return dot * scale;
}

// ---------------------------------------------------------------------------- scalar reference

struct Scalar {
  template <typename T>
  static void scores(const Range<T>& a) {
    for (int64_t i = 0; i < a.nblocks; ++i)
      for (int64_t r = 0; r < a.rows; ++r) {
        float* s = a.scores + r * a.stride() + i * a.slots;
        const int64_t n = a.visible(r, i);
        for (int64_t t = 0; t < a.slots; ++t) {
          if (t >= n) {
            s[t] = kNegInf;
            continue;
          }
          float dot = 0.f;
          for (int64_t d = 0; d < a.dim; ++d)
            dot += static_cast<float>(a.q[r * a.dim + d]) * static_cast<float>(a.k[i][t * a.dim + d]);
          s[t] = score_of<T>(dot, a.scale);
        }
      }
  }
  static float softmax(float* p, int64_t n, float* l) {  // -> m; p := e^(p - m), l := their sum
    float mx = kNegInf;
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, p[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      p[t] = p[t] == kNegInf ? 0.f : std::exp(p[t] - mx);
      sum += p[t];
    }
    *l = sum;
    return mx;
  }
  // acc[r] += sum over the block's keys t of p[r][t] * v[t]
  template <typename T>
  static void values(const float* p, int64_t pstride, const T* v, int64_t n, int64_t rows,
                     int64_t dim, float* acc, Feed&) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t d = 0; d < dim; ++d)
          acc[r * dim + d] += p[r * pstride + t] * static_cast<float>(v[t * dim + d]);
  }
};

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
template <int64_t kPairs>
__attribute__((target("avx512f"))) void transpose_keys(const c10::BFloat16* k, int64_t nkeys,
                                                       int32_t* keys_t, Feed& feed) {
  static_assert(kPairs % 16 == 0, "head_dim a multiple of 32");
  for (int64_t t0 = 0; t0 < nkeys; t0 += 16) {
    int32_t* out = keys_t + (t0 / 16) * kPairs * 16;
    for (int64_t p0 = 0; p0 < kPairs; p0 += 16) {
      __m512i r[16];
      for (int t = 0; t < 16; ++t) {
        feed.advance(64);
        r[t] = t0 + t < nkeys ? _mm512_loadu_si512(k + (t0 + t) * 2 * kPairs + 2 * p0)
                              : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + (p0 + i) * 16, r[i]);
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

// 16 dot products -> scores: rounded to bf16 (as the cache dtype's matmul would), then scaled;
// lanes at and past `n` (keys the row does not see) -inf.
__attribute__((target("avx512f,avx512bf16"))) inline __m512 round_bf16(__m512 x) {
  return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(x));
}

__attribute__((target("avx512f,avx512bf16"))) inline void store_scores(__m512 dots, float scale,
                                                                      int64_t n, float* dst) {
  const __m512 rounded = round_bf16(dots);
  const __mmask16 live = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1);
  _mm512_storeu_ps(dst, _mm512_mask_mul_ps(_mm512_set1_ps(kNegInf), live, rounded,
                                           _mm512_set1_ps(scale)));
}

// Scores of rows r .. r + RB against keys t0 .. t0 + 15 of block i, stored.
template <int RB>
__attribute__((target("avx512f,avx512bf16"))) inline void rows_bf16(
    const Range<c10::BFloat16>& a, const int32_t* q_pairs, const int32_t* kt, int64_t r,
    int64_t i, int64_t t0) {
  const int64_t pairs = a.dim / 2;
  __m512 s[RB];
  scores_bf16<RB>(q_pairs + r * pairs, pairs, kt, s);
  for (int j = 0; j < RB; ++j)
    store_scores(s[j], a.scale, a.visible(r + j, i) - t0,
                 a.scores + (r + j) * a.stride() + i * a.slots + t0);
}

// Probabilities of keys t, t + 1 of RB rows' block as bf16 pairs (one int32 each, what
// `vdpbf16ps` multiplies against a pair of value rows), rounded to nearest even.
template <int RB>
__attribute__((target("avx512f,avx512bf16"))) inline void probability_pairs(const float* p, int64_t pstride,
                                                                           int32_t pairs[RB][8]) {
  for (int r = 0; r < RB; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs[r]),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + r * pstride)));
}

// RB rows x CB chunks of 32 dims over the n keys (n <= 16) of one block, two keys per
// `vdpbf16ps`: a value pair interleaves rows t and t + 1 by `vpunpck[lh]wd`, so accumulator lo
// of a chunk holds dims 8j + 0..3 and hi dims 8j + 4..7 (j the 128-bit lane), the order acc is
// kept in until the range ends (Bf16::unpermute). A missing key t + 1 (odd n) reads as zeros.
template <int C, int RB, int CB>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void values_pairs(
    const int32_t pairs[][8], const c10::BFloat16* v, int64_t n, float* acc, int c0, Feed& feed) {
  constexpr int64_t dim = 16 * C;
  __m512 lo[RB][CB], hi[RB][CB];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CB; ++c) {
      lo[r][c] = _mm512_loadu_ps(acc + r * dim + (c0 + c) * 32);
      hi[r][c] = _mm512_loadu_ps(acc + r * dim + (c0 + c) * 32 + 16);
    }
  for (int64_t t = 0; t < n; t += 2) {
    feed.advance(2 * CB * 64);  // two keys' CB chunks of 32 dims
    __m512bh vlo[CB], vhi[CB];
    for (int c = 0; c < CB; ++c) {
      const __m512i a = _mm512_loadu_si512(v + t * dim + (c0 + c) * 32);
      const __m512i b = t + 1 < n ? _mm512_loadu_si512(v + (t + 1) * dim + (c0 + c) * 32) : _mm512_setzero_si512();
      vlo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      vhi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int r = 0; r < RB; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(pairs[r][t / 2]);
      for (int c = 0; c < CB; ++c) {
        lo[r][c] = _mm512_dpbf16_ps(lo[r][c], vlo[c], pr);
        hi[r][c] = _mm512_dpbf16_ps(hi[r][c], vhi[c], pr);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CB; ++c) {
      _mm512_storeu_ps(acc + r * dim + (c0 + c) * 32, lo[r][c]);
      _mm512_storeu_ps(acc + r * dim + (c0 + c) * 32 + 16, hi[r][c]);
    }
}

// Avx512 for a bfloat16 cache on a CPU with AVX512-BF16: the scores come from the keys as
// stored through `vdpbf16ps` (16 keys in the lanes, transposed once per block for all rows),
// rounded to bf16 and scaled as the other kernels do; the softmax is Avx512's, the values its
// own (two keys a `vdpbf16ps`, below).
template <int C>
struct Bf16 : Avx512<C> {
  static constexpr int64_t dim = 16 * C, pairs = dim / 2;

  __attribute__((target("avx512f,avx512bf16"))) static void scores(const Range<c10::BFloat16>& a) {
    const auto* q_pairs = reinterpret_cast<const int32_t*>(a.q);
    for (int64_t i = 0; i < a.nblocks; ++i) {
      feed_scores(a, i);
      transpose_keys<pairs>(a.k[i], a.nkeys[i], a.keys_t, *a.feed);
      for (int64_t t0 = 0; t0 < a.nkeys[i]; t0 += 16) {
        const int32_t* kt = a.keys_t + (t0 / 16) * pairs * 16;
        for (int64_t r = 0; r < a.rows; r += 6) {
          switch (std::min<int64_t>(6, a.rows - r)) {
            case 6: rows_bf16<6>(a, q_pairs, kt, r, i, t0); break;
            case 5: rows_bf16<5>(a, q_pairs, kt, r, i, t0); break;
            case 4: rows_bf16<4>(a, q_pairs, kt, r, i, t0); break;
            case 3: rows_bf16<3>(a, q_pairs, kt, r, i, t0); break;
            case 2: rows_bf16<2>(a, q_pairs, kt, r, i, t0); break;
            default: rows_bf16<1>(a, q_pairs, kt, r, i, t0);
          }
        }
      }
      for (int64_t r = 0; r < a.rows; ++r)  // slots past the block's last group of 16
        std::fill(a.scores + r * a.stride() + i * a.slots + (a.nkeys[i] + 15) / 16 * 16,
                  a.scores + r * a.stride() + (i + 1) * a.slots, kNegInf);
    }
  }

  // The values through `vdpbf16ps`, two keys an instruction (values_pairs), 16 keys at a time;
  // acc is left in values_pairs' lane order (unpermute puts it back).
  __attribute__((target("avx512f,avx512bw,avx512bf16"))) static void values(
      const float* p, int64_t pstride, const c10::BFloat16* v, int64_t n, int64_t rows, int64_t,
      float* acc, Feed& feed) {
    static_assert(C % 2 == 0, "head_dim a multiple of 32");
    constexpr int RB = 6, CB = C % 4 == 0 ? 2 : 1;
    int32_t pairs[RB][8];
    for (int64_t t0 = 0; t0 < n; t0 += 16) {  // p's slots come in 16s: the loads stay in the row
      const int64_t keys = std::min<int64_t>(16, n - t0);
      const c10::BFloat16* vt = v + t0 * dim;
      int64_t r = 0;
      for (; r + RB <= rows; r += RB) {
        probability_pairs<RB>(p + r * pstride + t0, pstride, pairs);
        for (int c0 = 0; c0 < C / 2; c0 += CB) values_pairs<C, RB, CB>(pairs, vt, keys, acc + r * dim, c0, feed);
      }
      for (; r < rows; ++r) {
        probability_pairs<1>(p + r * pstride + t0, pstride, pairs);
        for (int c0 = 0; c0 < C / 2; c0 += CB) values_pairs<C, 1, CB>(pairs, vt, keys, acc + r * dim, c0, feed);
      }
    }
  }

  // acc rows from values_pairs' lane order back to dims in order.
  static void unpermute(float* acc, int64_t rows) {
    float row[dim];
    for (int64_t r = 0; r < rows; ++r) {
      float* a = acc + r * dim;
      for (int64_t c = 0; c < dim; c += 32)
        for (int j = 0; j < 16; ++j) {
          row[c + 8 * (j / 4) + j % 4] = a[c + j];
          row[c + 8 * (j / 4) + 4 + j % 4] = a[c + 16 + j];
        }
      std::copy(row, row + dim, a);
    }
  }
};

// Kernels whose values leave acc in their own lane order, put back by K::unpermute.
template <class K>
constexpr bool kPermutedAcc = false;
template <int C>
constexpr bool kPermutedAcc<Bf16<C>> = true;

// ---------------------------------------------------------------------------- AMX-BF16

// Tiles 0 (scores), 1 (keys) and 2 (queries), 16 rows of 64 bytes each.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile"))) inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 3; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// Bf16 with the scores from the tile unit, for blocks of 16 keys: per block and 32 dims, one
// `tdpbf16ps` multiplies the block's keys as stored (A: 16 keys x 32 dims) by the queries'
// dim pairs (B: 16 pairs x 16 rows, built once per item), so no key is transposed and one
// instruction does what 64 `vdpbf16ps` did. The scores come out key-major (a vector is one key's
// score for 16 rows), so the softmax runs down the keys with the rows in the lanes, and the
// values take each probability at stride 16. Rows go 16 at a time; a row's arithmetic is the same
// in any tile and any batch.
template <int C>
struct Amx {
  static constexpr int64_t dim = 16 * C, pairs = dim / 2, chunks = dim / 32;

  __attribute__((target("avx512f,avx512bf16,amx-tile,amx-bf16"))) static void attend(
      const Range<c10::BFloat16>& a, RowState st) {
    configure_tiles();
    for (int64_t r0 = 0; r0 < a.rows; r0 += 16) rows16(a, st, r0, std::min<int64_t>(16, a.rows - r0));
    _tile_release();
  }

  __attribute__((target("avx512f,avx512bf16,amx-tile,amx-bf16"))) static void rows16(
      const Range<c10::BFloat16>& a, RowState st, int64_t r0, int64_t nr) {
    alignas(64) int32_t qt[chunks][16][16];  // [32 dims][pair p][row r]: q[r][32c + 2p .. + 1]
    const auto* q = reinterpret_cast<const int32_t*>(a.q) + r0 * pairs;
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t p = 0; p < 16; ++p)
        for (int64_t r = 0; r < 16; ++r) qt[c][p][r] = r < nr ? q[r * pairs + 16 * c + p] : 0;
    alignas(64) int32_t limit[16];
    for (int64_t r = 0; r < 16; ++r) limit[r] = r < nr ? static_cast<int32_t>(a.limit[r0 + r]) : 0;
    const __m512i lim = _mm512_load_si512(limit);
    float* s = a.scores;  // [nblocks * 16 keys][16 rows]
    for (int64_t i = 0; i < a.nblocks; ++i) {
      _tile_zero(0);
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(1, a.k[i] + 32 * c, dim * 2);
        _tile_loadd(2, qt[c], 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      float* block = s + i * 256;
      _tile_stored(0, block, 64);
      const int64_t first = a.first + i * 16;
      for (int64_t t = 0; t < 16; ++t) {  // round, scale; -inf where a row does not see the key
        const __mmask16 seen = t < a.nkeys[i] ? _mm512_cmpgt_epi32_mask(lim, _mm512_set1_epi32(int32_t(first + t))) : 0;
        const __m512 v = _mm512_mul_ps(round_bf16(_mm512_load_ps(block + t * 16)), _mm512_set1_ps(a.scale));
        _mm512_store_ps(block + t * 16, _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), seen, v));
      }
    }
    const int64_t keys = a.nblocks * 16;
    __m512 m = _mm512_set1_ps(kNegInf);
    for (int64_t t = 0; t < keys; ++t) m = _mm512_max_ps(m, _mm512_load_ps(s + t * 16));
    const __mmask16 live = _mm512_cmp_ps_mask(m, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
    const __m512 shift = _mm512_maskz_mov_ps(live, m);  // a row that sees none: all its e^ are 0
    __m512 l = _mm512_setzero_ps();
    for (int64_t t = 0; t < keys; ++t) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_load_ps(s + t * 16), shift));
      _mm512_store_ps(s + t * 16, e);
      l = _mm512_add_ps(l, e);
    }
    alignas(64) float mv[16], lv[16];
    _mm512_store_ps(mv, m);
    _mm512_store_ps(lv, l);
    std::copy_n(mv, nr, st.m + r0);
    std::copy_n(lv, nr, st.l + r0);
    float* acc = st.acc + r0 * dim;
    std::fill(acc, acc + nr * dim, 0.f);
    for (int64_t i = 0; i < a.nblocks; ++i)
      Avx512<C>::values(s + i * 256, 1, a.v[i], a.nkeys[i], nr, dim, acc, *a.feed, 16);
  }
};

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

// ---------------------------------------------------------------------------- one range

// An item's rows against its range: every score, then each row's softmax over the whole range
// (its max and sum are the item's m and l), then the values weighted by the probabilities.
template <class K, typename T>
void attend(const Range<T>& a, RowState st) {
  K::scores(a);
  for (int64_t r = 0; r < a.rows; ++r)
    st.m[r] = K::softmax(a.scores + r * a.stride(), a.stride(), st.l + r);
  std::fill(st.acc, st.acc + a.rows * a.dim, 0.f);
  for (int64_t i = 0; i < a.nblocks; ++i) {
    feed_values(a, i);
    K::values(a.scores + i * a.slots, a.stride(), a.v[i], a.nkeys[i], a.rows, a.dim, st.acc, *a.feed);
  }
  if constexpr (kPermutedAcc<K>) K::unpermute(st.acc, a.rows);
}

// ---------------------------------------------------------------------------- dispatch

template <typename T>
using RangeFn = void (*)(const Range<T>&, RowState);

enum class Isa { kAuto, kScalar, kAvx2, kAvx512, kAvx512Bf16, kAmx };

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

// The AVX512 kernels by head_dim / 16; null where none is compiled.
template <typename T>
RangeFn<T> avx512_for(int64_t dim) {
  switch (dim) {
    case 16: return attend<Avx512<1>, T>;
    case 32: return attend<Avx512<2>, T>;
    case 64: return attend<Avx512<4>, T>;
    case 80: return attend<Avx512<5>, T>;
    case 96: return attend<Avx512<6>, T>;
    case 128: return attend<Avx512<8>, T>;
    case 256: return attend<Avx512<16>, T>;
    default: return nullptr;
  }
}

// The AVX512-BF16 kernels (bfloat16 caches) by head_dim / 16; null where none is compiled.
RangeFn<c10::BFloat16> bf16_for(int64_t dim) {
  using T = c10::BFloat16;
  switch (dim) {
    case 32: return attend<Bf16<2>, T>;
    case 64: return attend<Bf16<4>, T>;
    case 96: return attend<Bf16<6>, T>;
    case 128: return attend<Bf16<8>, T>;
    case 256: return attend<Bf16<16>, T>;
    default: return nullptr;
  }
}

// The AMX kernels (bfloat16 caches, blocks of 16) by head_dim / 16; null where none is compiled.
RangeFn<c10::BFloat16> amx_for(int64_t dim) {
  switch (dim) {
    case 64: return Amx<4>::attend;
    case 128: return Amx<8>::attend;
    case 256: return Amx<16>::attend;
    default: return nullptr;
  }
}

template <typename T>
RangeFn<T> kernel_for(Isa isa, int64_t dim) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (isa == Isa::kAmx) return amx_for(dim);
    if (isa == Isa::kAvx512Bf16) return bf16_for(dim);
  }
  if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16 || isa == Isa::kAmx) return avx512_for<T>(dim);
  if (isa == Isa::kAvx2) return avx2_for<T>(dim);
  return attend<Scalar, T>;
}

Isa pick(const std::string& isa, int64_t dim, bool bf16, int64_t block_size) {
  const bool avx512_ok = cpu::avx512() && avx512_for<float>(dim) != nullptr;
  const bool avx2_ok = cpu::avx2() && avx2_for<float>(dim) != nullptr;
  const bool bf16_ok = bf16 && cpu::avx512bf16() && bf16_for(dim) != nullptr;
  const bool amx_ok = bf16_ok && block_size == 16 && amx_for(dim) != nullptr && cpu::amx_bf16();
  if (isa == "scalar") return Isa::kScalar;
  if (isa == "amx") {
    TORCH_CHECK(amx_ok, "paged_attention: amx needs a bfloat16 cache, blocks of 16, head_dim 64, "
                "128 or 256 and a CPU with AMX-BF16 (head_dim ", dim, ", blocks of ", block_size, ")");
    return Isa::kAmx;
  }
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
  TORCH_CHECK(isa == "auto",
              "paged_attention: isa must be auto, scalar, avx2, avx512, avx512bf16 or amx");
  return amx_ok ? Isa::kAmx
         : bf16_ok ? Isa::kAvx512Bf16
         : avx512_ok ? Isa::kAvx512
         : avx2_ok ? Isa::kAvx2
                   : Isa::kScalar;
}

// ---------------------------------------------------------------------------- the op

// A scratch buffer whose data is 64-byte aligned, so that no 512-bit load or store splits a line.
template <typename T>
class Scratch {
 public:
  T* get(size_t n) {
    raw_.resize(n + 64 / sizeof(T));
    const auto at = (reinterpret_cast<uintptr_t>(raw_.data()) + 63) & ~uintptr_t{63};
    return reinterpret_cast<T*>(at);
  }

 private:
  std::vector<T> raw_;
};

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
  const int64_t max_blocks = tables.size(1), slots = (block_size + 15) / 16 * 16;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const RangeFn<T> kernel = kernel_for<T>(isa, dim);
  // where block n of an item's range starts in each cache; null past the item's last block
  const auto block = [&](const Item& it, int64_t n) -> std::optional<int64_t> {
    if (it.block_begin + n >= it.block_end) return std::nullopt;
    const int64_t id = tp[it.b * max_blocks + it.block_begin + n];
    TORCH_CHECK(id >= 0 && id < num_blocks, "paged_attention: block id out of range");
    return ((it.h * num_blocks) + id) * block_size * dim;
  };
  at::parallel_for(0, static_cast<int64_t>(p.items.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<T> qrows;
    Scratch<float> scores, queries_f32, keys_f32;
    Scratch<int32_t> keys_t;
    Feed feed;
    float* kf = keys_f32.get(block_size * dim);
    int32_t* kt = keys_t.get(slots * dim / 2);
    std::vector<int64_t> limit, nkeys;
    std::vector<const T*> kb, vb;
    bool fed = false;
    for (int64_t i = lo; i < hi; ++i) {
      const Item& it = p.items[i];
      const int64_t qn = p.qlen[it.b], start = p.start[it.b];
      const int64_t rows = group * (it.q_end - it.q_begin), first_row = group * it.q_begin;
      const int64_t at = it.row_offset + first_row;
      const RowState st{m + at, l + at, acc + at * dim};
      // the blocks up to the tile's last query: later ones are seen by none of its rows
      const int64_t end = std::min(it.block_end, (start + it.q_end - 1) / block_size + 1);
      const int64_t nblocks = std::max<int64_t>(0, end - it.block_begin);
      if (nblocks == 0) {
        std::fill(st.m, st.m + rows, kNegInf);
        std::fill(st.l, st.l + rows, 0.f);
        std::fill(st.acc, st.acc + rows * dim, 0.f);
        fed = false;  // what the last range queued was this one's blocks
        continue;
      }
      qrows.resize(rows * dim);
      limit.resize(rows);
      for (int64_t j = it.q_begin; j < it.q_end; ++j)  // row j * group + g: query j, head h * group + g
        std::copy_n(qp + ((p.qoffset[it.b] + j) * heads + it.h * group) * dim, group * dim,
                    qrows.data() + (j - it.q_begin) * group * dim);
      for (int64_t r = 0; r < rows; ++r) limit[r] = start + it.q_begin + r / group + 1;
      kb.resize(nblocks);
      vb.resize(nblocks);
      nkeys.resize(nblocks);
      for (int64_t n = 0; n < nblocks; ++n) {
        const int64_t base = *block(it, n);
        kb[n] = kp + base;
        vb[n] = vp + base;
        nkeys[n] = std::min(block_size, start + qn - (it.block_begin + n) * block_size);
      }
      Range<T> a{qrows.data(), queries_f32.get(rows * dim), limit.data(), kb.data(), vb.data(), nkeys.data(),
                 it.block_begin * block_size, rows, nblocks, block_size, dim, slots, scale,
                 scores.get(std::max<int64_t>(rows, 16) * nblocks * slots), kf, kt, &feed, fed, {}};
      for (int64_t n = 0; n < kFeedBlocks && i + 1 < hi; ++n) {
        const std::optional<int64_t> next = block(p.items[i + 1], n);
        a.then[n] = next ? kp + *next : nullptr;
      }
      kernel(a, st);
      fed = i + 1 < hi && nblocks >= kFeedBlocks;
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

}  // namespace

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
  const Isa isa = pick(isa_name, dim, q.scalar_type() == at::kBFloat16, k_cache.size(2));
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

}  // namespace specserve

TORCH_LIBRARY_FRAGMENT(specserve_kernels, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor start_pos, Tensor query_lens, float scale, str isa='auto', "
      "int split_tokens=256) -> Tensor",
      &specserve::paged_attention);
}
