// 256-bit kernels for the row-interleaved layouts (Q4_K_R16, Q6_K_R16; gguf_blocks.h), included
// by gguf_avx2.cpp (Vnni = false) and gguf_avxvnni.cpp (Vnni = true) after their target pragma,
// so each gets its own copy (everything here is in an anonymous namespace).
//
// A 64-byte run of the layout is 16 columns x 4 K values; its 32-byte halves are columns 0-7
// and 8-15, one ymm each (lane j: column 8h + j). `vpmaddubsw` against a broadcast group of 4
// activations gives int16 pairs, and two steps add in int16 before one `vpmaddwd` applies the
// scale (2 * 2 * 63 * 127 = 32004 stays below 32768). The scale sits in both int16 halves of
// its int32 lane, so that `vpmaddwd` is scale * (sum of the pair), exact in int32.
// With AVX-VNNI, `vpdpbusd` sums the 4 products straight into int32 (as the AVX512 kernel does)
// and `vpmulld` applies the scale. Each group of 16 values then turns float once, times the
// row's scale for that group.

#pragma once

#include <immintrin.h>

#include <cstring>

#include "gguf_blocks.h"

namespace specserve::gguf {
namespace {

inline __m256i load_ymm(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

inline __m256i broadcast4(const int8_t* x) {  // x[0..3] in every int32 lane
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}

inline __m256 load_halves(const uint8_t* p) {  // 8 f16 -> 8 floats
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// 8 E8M0 bytes -> 8 floats 2^(e - 128), as e8m0_half_to_float: (e - 1) << 23, or for e = 0, 1 the
// subnormals 0x00200000 << e.
inline __m256 e8m0_halves(const uint8_t* p) {
  uint64_t bytes;
  std::memcpy(&bytes, p, 8);
  const __m256i e = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(bytes)));
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

// w[0..3] . x[0..15] per column, int32, by AVX-VNNI's `vpdpbusd`.
inline __m256i vnni_dot16(const __m256i* w, const int8_t* x) {
  __m256i dot = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w[0], broadcast4(x));
  for (int t = 1; t < 4; ++t) dot = _mm256_dpbusd_avx_epi32(dot, w[t], broadcast4(x + 4 * t));
  return dot;
}

// scale * (w[0..3] . x[0..15]) per column, int32, by `vpmaddubsw` pairs: two steps summed in int16
// (at most 2 * 2 * 63 * 127 = 32004) before `vpmaddwd` by the scale held in both int16 halves.
inline __m256i pairs_dot16(const __m256i* w, const int8_t* x, __m256i scale_pairs) {
  const __m256i first = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], broadcast4(x)),
                                         _mm256_maddubs_epi16(w[1], broadcast4(x + 4)));
  const __m256i second = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], broadcast4(x + 8)),
                                          _mm256_maddubs_epi16(w[3], broadcast4(x + 12)));
  return _mm256_add_epi32(_mm256_madd_epi16(first, scale_pairs), _mm256_madd_epi16(second, scale_pairs));
}

// scale * (w[0..3] . x) per column, int32: 4 x 4 values of 8 columns times 16 activations.
template <bool Vnni>
inline __m256i dot16(const __m256i* w, const int8_t* x, __m256i scale_pairs, __m256i scale32) {
  if constexpr (Vnni) return _mm256_mullo_epi32(vnni_dot16(w, x), scale32);
  else return pairs_dot16(w, x, scale_pairs);
}

// Columns 8h .. 8h + 7 of one Q4_K_R16 super-block, for Rows rows, added into acc.
template <int Rows, bool Vnni>
void q4_k_r16_half(const uint8_t* block, int h, int64_t b, const ActRow* acts, __m256* acc) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 scaled[Rows];
  for (int r = 0; r < Rows; ++r) scaled[r] = _mm256_setzero_ps();
  for (int s = 0; s < 8; ++s) {
    __m256i w[8];  // w[t]: values 32s + 4t .. + 3 of the 8 columns
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load_ymm(block + 320 + 256 * s + 64 * c + 32 * h);
      w[c] = _mm256_and_si256(v, nibble);
      w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    }
    uint64_t scale_bytes;
    std::memcpy(&scale_bytes, block + 64 + 16 * s + 8 * h, 8);
    const __m256i scale32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(scale_bytes)));
    const __m256i scale = _mm256_or_si256(scale32, _mm256_slli_epi32(scale32, 16));
    for (int r = 0; r < Rows; ++r) {
      const int8_t* x = acts[r].q + 256 * b + 32 * s;
      const float* xd = acts[r].d + 64 * b + 8 * s;  // groups 2s, 2s + 1: xd[0], xd[4]
      const __m256 first = _mm256_cvtepi32_ps(dot16<Vnni>(w, x, scale, scale32));
      const __m256 second = _mm256_cvtepi32_ps(dot16<Vnni>(w + 4, x + 16, scale, scale32));
      scaled[r] = _mm256_fmadd_ps(first, _mm256_set1_ps(xd[0]), scaled[r]);
      scaled[r] = _mm256_fmadd_ps(second, _mm256_set1_ps(xd[4]), scaled[r]);
    }
  }
  __m256 mins[8];  // column 8h + j's min of sub-block s (stored in pairs 2p, 2p + 1)
  for (int p = 0; p < 4; ++p) {
    const __m256i pair = _mm256_cvtepu8_epi16(load128(block + 192 + 32 * p + 16 * h));
    mins[2 * p] = _mm256_cvtepi32_ps(_mm256_and_si256(pair, _mm256_set1_epi32(0xFFFF)));
    mins[2 * p + 1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(pair, 16));
  }
  const __m256 d = load_halves(block + 16 * h), dmin = load_halves(block + 32 + 16 * h);
  for (int r = 0; r < Rows; ++r) {
    const float* dsums = acts[r].dsums32 + 8 * b;
    __m256 low = _mm256_mul_ps(mins[0], _mm256_set1_ps(dsums[0]));
    for (int s = 1; s < 8; ++s) low = _mm256_fmadd_ps(mins[s], _mm256_set1_ps(dsums[s]), low);
    acc[2 * r + h] = _mm256_fmadd_ps(scaled[r], d, acc[2 * r + h]);
    acc[2 * r + h] = _mm256_fnmadd_ps(low, dmin, acc[2 * r + h]);
  }
}

// Columns 8h .. 8h + 7 of one Q6_K_R16 super-block, for Rows rows, added into acc.
template <int Rows, bool Vnni>
void q6_k_r16_half(const uint8_t* block, int h, int64_t b, const ActRow* acts, __m256* acc) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i top = _mm256_set1_epi8(0x30);
  const __m256i even = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                        0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
  const __m256i odd = _mm256_add_epi8(even, _mm256_set1_epi8(2));
  __m256 scaled[Rows];
  for (int r = 0; r < Rows; ++r) scaled[r] = _mm256_setzero_ps();
  for (int g = 0; g < 16; ++g) {
    const uint8_t* values = block + 288 + 192 * g + 32 * h;
    const __m256i low0 = load_ymm(values), low1 = load_ymm(values + 64), high = load_ymm(values + 128);
    const __m256i w[4] = {  // w[k]: values 16g + 4k .. + 3; its two high bits at bits 2k, 2k + 1
        _mm256_or_si256(_mm256_and_si256(low0, nibble), _mm256_and_si256(_mm256_slli_epi16(high, 4), top)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low0, 4), nibble),
                        _mm256_and_si256(_mm256_slli_epi16(high, 2), top)),
        _mm256_or_si256(_mm256_and_si256(low1, nibble), _mm256_and_si256(high, top)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low1, 4), nibble),
                        _mm256_and_si256(_mm256_srli_epi16(high, 2), top)),
    };
    const __m256i pair = _mm256_cvtepi8_epi16(load128(block + 32 + 32 * (g / 2) + 16 * h));
    const __m256i scale = _mm256_shuffle_epi8(pair, g % 2 ? odd : even);  // this group's, twice
    const __m256i scale32 = _mm256_srai_epi32(_mm256_slli_epi32(scale, 16), 16);
    const __m256 offset = _mm256_mul_ps(_mm256_cvtepi32_ps(scale32), _mm256_set1_ps(32.0f));  // the -32 of q
    for (int r = 0; r < Rows; ++r) {
      const int8_t* x = acts[r].q + 256 * b + 16 * g;
      const __m256 sum = _mm256_cvtepi32_ps(dot16<Vnni>(w, x, scale, scale32));
      scaled[r] = _mm256_fmadd_ps(sum, _mm256_set1_ps(acts[r].d[64 * b + 4 * g]), scaled[r]);
      scaled[r] = _mm256_fnmadd_ps(offset, _mm256_set1_ps(acts[r].dsums16[16 * b + g]), scaled[r]);
    }
  }
  const __m256 d = load_halves(block + 16 * h);
  for (int r = 0; r < Rows; ++r) acc[2 * r + h] = _mm256_fmadd_ps(scaled[r], d, acc[2 * r + h]);
}

// The 32-value formats' 5th bits for columns 8h .. 8h + 7: bit 4(j - 8h) + i of `bits` to a
// byte of 0x10 where set.
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i picks = _mm256_set1_epi64x(int64_t(0x8040201008040201));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, picks), picks), _mm256_set1_epi8(0x10));
}

// w[0..3] . x[0..15] per column, int32, no scale (pairs: Q4_0 and Q5_0 only, see q32_r16_half).
template <bool Vnni>
inline __m256i dot16_plain(const __m256i* w, const int8_t* x) {
  if constexpr (Vnni) return vnni_dot16(w, x);
  else return pairs_dot16(w, x, _mm256_set1_epi16(1));
}

// Columns 8h .. 8h + 7 of one Q4_0_R16 / Q5_0_R16 / Q8_0_R16 / MXFP4_R16 block (Q8_0 with
// AVX-VNNI only: its values reach 255, past `vpmaddubsw`'s int16 pairs; MXFP4's unsigned values
// reach 24), for Rows rows, added into acc.
template <int Rows, int QType, bool Vnni>
void q32_r16_half(const uint8_t* block, int h, int64_t b, const ActRow* acts, __m256* acc) {
  static_assert(Vnni || QType != Q8_0_R16, "Q8_0_R16 needs vpdpbusd");
  constexpr int values_at = r16_values_at(QType);
  __m256i w[8];  // w[t]: values 4t .. 4t + 3 of the 8 columns
  if constexpr (QType == Q8_0_R16) {
    for (int t = 0; t < 8; ++t) w[t] = load_ymm(block + 32 + 64 * t + 32 * h);
  } else {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load_ymm(block + values_at + 64 * c + 32 * h);
      w[c] = _mm256_and_si256(v, nibble);
      w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    }
    if constexpr (QType == MXFP4_R16) {  // codes -> 12 + value, 0..24
      const __m256i values = _mm256_broadcastsi128_si256(load128(kMxfp4Unsigned));
      for (int t = 0; t < 8; ++t) w[t] = _mm256_shuffle_epi8(values, w[t]);
    }
    if constexpr (QType == Q5_0_R16) {
      for (int m = 0; m < 8; ++m) {
        uint32_t bits;
        std::memcpy(&bits, block + 288 + 8 * m + 4 * h, 4);
        __m256i& target = w[m / 2 + 4 * (m % 2)];
        target = _mm256_or_si256(target, fifth_bits(bits));
      }
    }
  }
  const __m256 d = QType == MXFP4_R16 ? e8m0_halves(block + 8 * h) : load_halves(block + 16 * h);
  const __m256 offset = _mm256_set1_ps(float(q32_offset(QType)));
  for (int r = 0; r < Rows; ++r) {
    const int8_t* x = acts[r].q + 32 * b;
    const float* xd = acts[r].d + 8 * b;  // the block's groups of 16: xd[0], xd[4]
    __m256 sum = _mm256_mul_ps(_mm256_cvtepi32_ps(dot16_plain<Vnni>(w, x)), _mm256_set1_ps(xd[0]));
    sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot16_plain<Vnni>(w + 4, x + 16)), _mm256_set1_ps(xd[4]), sum);
    sum = _mm256_fnmadd_ps(offset, _mm256_set1_ps(acts[r].dsums32[b]), sum);
    acc[2 * r + h] = _mm256_fmadd_ps(sum, d, acc[2 * r + h]);
  }
}

// One group of 16 columns x Rows rows: the two 8-column halves of each block in turn.
template <int Rows, int QType, bool Vnni>
void rows16_group(const TileArgs& a) {
  const uint8_t* group = a.weights + a.n_begin * a.weight_row_bytes;
  __m256 acc[2 * Rows];  // [row][half]
  for (int i = 0; i < 2 * Rows; ++i) acc[i] = _mm256_setzero_ps();
  Format format;
  format_of(QType, &format);
  const int block_bytes = kGroupRows * format.block_bytes;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* block = group + b * block_bytes;
    prefetch_ahead(block, block_bytes, 0, 1);
    for (int h = 0; h < 2; ++h) {
      if constexpr (QType == Q6_K_R16) q6_k_r16_half<Rows, Vnni>(block, h, b, a.acts, acc);
      else if constexpr (QType == Q4_K_R16) q4_k_r16_half<Rows, Vnni>(block, h, b, a.acts, acc);
      else q32_r16_half<Rows, QType, Vnni>(block, h, b, a.acts, acc);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(a.out + r * a.out_stride + a.n_begin + 8 * h, acc[2 * r + h]);
  }
}

// The row count as a template argument; more than 8 rows (16 ymm registers) go 8 at a time.
template <int QType, bool Vnni>
void rows16_tile(const TileArgs& a) {
  if (a.rows > kMaxRows) {
    TileArgs first = a, rest = a;
    first.rows = kMaxRows;
    rest.rows = a.rows - kMaxRows;
    rest.acts = a.acts + kMaxRows;
    rest.out = a.out + kMaxRows * a.out_stride;
    rows16_tile<QType, Vnni>(first);
    return rows16_tile<QType, Vnni>(rest);
  }
  switch (a.rows) {
    case 1: return rows16_group<1, QType, Vnni>(a);
    case 2: return rows16_group<2, QType, Vnni>(a);
    case 3: return rows16_group<3, QType, Vnni>(a);
    case 4: return rows16_group<4, QType, Vnni>(a);
    case 5: return rows16_group<5, QType, Vnni>(a);
    case 6: return rows16_group<6, QType, Vnni>(a);
    case 7: return rows16_group<7, QType, Vnni>(a);
    default: return rows16_group<8, QType, Vnni>(a);
  }
}

}  // namespace
}  // namespace specserve::gguf
