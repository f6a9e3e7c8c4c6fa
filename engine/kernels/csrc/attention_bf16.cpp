// Paged attention on bfloat16 caches: the AVX512-BF16 and AMX-BF16 variants (attention.cpp has the
// overview and the reference they are tested against).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on its own intrinsics headers

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "attention_avx512.h"

namespace specserve::attention {
namespace {

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
    // a row's first visible key: its window's (without a window, every key from 0)
    const __m512i low = a.window > 0 ? _mm512_sub_epi32(lim, _mm512_set1_epi32(int32_t(a.window)))
                                     : _mm512_set1_epi32(std::numeric_limits<int32_t>::min());
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
        const __m512i pos = _mm512_set1_epi32(int32_t(first + t));
        const __mmask16 seen = t < a.nkeys[i] ? _mm512_mask_cmpge_epi32_mask(_mm512_cmpgt_epi32_mask(lim, pos), pos, low) : 0;
        const __m512 v = _mm512_mul_ps(round_bf16(_mm512_load_ps(block + t * 16)), _mm512_set1_ps(a.scale));
        _mm512_store_ps(block + t * 16, _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), seen, v));
      }
    }
    if (a.tree != nullptr)  // key-major: the range's key n for row r at s[n * 16 + r]
      for (int64_t r = 0; r < nr; ++r) tree_hidden(a, r0 + r, [&](int64_t n) { s[n * 16 + r] = kNegInf; });
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

}  // namespace

// The bf16 kernel leaves acc in its own lane order, put back by Bf16::unpermute (attend).
template <int C>
constexpr bool kPermutedAcc<Bf16<C>> = true;

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

}  // namespace specserve::attention
