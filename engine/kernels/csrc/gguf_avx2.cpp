// AVX2 + FMA (+ F16C) variant: 32 int8 products per `vpmaddubsw` (unsigned weight x signed
// activation into int16 pairs) and `vpmaddwd` to apply the int16 scales and widen to int32.
//
// No int16 sum can saturate: Q4_K pairs are at most 2 * 15 * 127, Q5_K 2 * 31 * 127, Q6_K
// 2 * 63 * 127 (their weights are unpacked unsigned, the -32 is folded in with the activation
// sums), and the 32-value formats multiply |w| <= 128 by sign-adjusted activations, 2 * 128 * 127
// (MXFP4's values, |w| <= 12, looked up from their codes by `vpshufb`).
//
// Each weight block is unpacked once into registers (or the stack) and then multiplied with
// every activation row; each row keeps its own accumulator, so a row's result does not depend on
// how many rows share the tile.
#include <immintrin.h>

#include "gguf_blocks.h"

#pragma GCC target("avx2,fma,f16c")

#include "gguf_dequant.h"      // after the pragma: compiled for this target
#include "gguf_rows16_avx2.h"  // the 16-row layouts' kernels, here without AVX-VNNI

namespace specserve::gguf {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

template <bool FiveBits>
void q4_k_tile(const TileArgs& a) {
  constexpr int block_bytes = FiveBits ? 176 : 144;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t n = a.n_begin; n < a.n_end; ++n) {
    const uint8_t* row = a.weights + n * a.weight_row_bytes;
    __m256 acc[kMaxRows];
    for (int r = 0; r < a.rows; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* block = row + b * block_bytes;
      const uint8_t* qs = block + (FiveBits ? 48 : 16);
      uint8_t scales_mins[16];
      k_scales_mins(block + 4, scales_mins);
      __m256i q[8], scale[8];
      for (int j = 0; j < 4; ++j) {
        const __m256i v = load(qs + 32 * j);
        q[2 * j] = _mm256_and_si256(v, nibble);
        q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        if (FiveBits) {
          const __m256i qh = load(block + 16);
          const __m256i bit_low = _mm256_set1_epi8(char(1 << (2 * j)));
          const __m256i bit_high = _mm256_set1_epi8(char(2 << (2 * j)));
          const __m256i fifth = _mm256_set1_epi8(0x10);
          q[2 * j] = _mm256_or_si256(
              q[2 * j],
              _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_low), bit_low), fifth));
          q[2 * j + 1] = _mm256_or_si256(
              q[2 * j + 1],
              _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_high), bit_high), fifth));
        }
      }
      for (int s = 0; s < 8; ++s) scale[s] = _mm256_set1_epi16(scales_mins[s]);
      const __m256 d = _mm256_set1_ps(load_half(block));
      const __m256 mins = _mm256_mul_ps(
          _mm256_set1_ps(load_half(block + 2)),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales_mins + 8)))));
      for (int r = 0; r < a.rows; ++r) {
        const int8_t* x = a.acts[r].q + 256 * b;
        const float* xd = a.acts[r].d + 64 * b;  // lane i of sub-block s: xd[8s + i]
        __m256 scaled = _mm256_setzero_ps();
        for (int s = 0; s < 8; ++s) {
          const __m256i pairs = _mm256_maddubs_epi16(q[s], load(x + 32 * s));
          const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, scale[s]));
          scaled = _mm256_fmadd_ps(sum, _mm256_loadu_ps(xd + 8 * s), scaled);
        }
        acc[r] = _mm256_fmadd_ps(scaled, d, acc[r]);
        acc[r] = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(a.acts[r].dsums32 + 8 * b), acc[r]);
      }
    }
    for (int r = 0; r < a.rows; ++r) a.out[r * a.out_stride + n] = hsum(acc[r]);
  }
}

// Byte mask [i, i, ... (8 times), i + 1, ... (8 times)] picking the scales of groups i, i + 1.
inline __m128i pair_selector(int i) {
  return _mm_setr_epi8(char(i), char(i), char(i), char(i), char(i), char(i), char(i), char(i),
                       char(i + 1), char(i + 1), char(i + 1), char(i + 1), char(i + 1),
                       char(i + 1), char(i + 1), char(i + 1));
}

void q6_k_tile(const TileArgs& a) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i top = _mm256_set1_epi8(0x30);
  for (int64_t n = a.n_begin; n < a.n_end; ++n) {
    const uint8_t* row = a.weights + n * a.weight_row_bytes;
    __m256 acc[kMaxRows];
    for (int r = 0; r < a.rows; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* block = row + b * 210;
      __m256i q[8], scale[8];
      for (int h = 0; h < 2; ++h) {
        const __m256i low0 = load(block + 64 * h), low1 = load(block + 64 * h + 32);
        const __m256i high = load(block + 128 + 32 * h);
        q[4 * h] = _mm256_or_si256(_mm256_and_si256(low0, nibble),
                                   _mm256_and_si256(_mm256_slli_epi16(high, 4), top));
        q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(low1, nibble),
                                       _mm256_and_si256(_mm256_slli_epi16(high, 2), top));
        q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low0, 4), nibble),
                                       _mm256_and_si256(high, top));
        q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low1, 4), nibble),
                                       _mm256_and_si256(_mm256_srli_epi16(high, 2), top));
      }
      const __m128i scales8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
      for (int k = 0; k < 8; ++k) {
        scale[k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales8, pair_selector(2 * k)));
      }
      // q was unpacked as 0..63: 32 * sc * (d * sum of x) per group of 16 comes back off
      const __m256 thirty_two = _mm256_set1_ps(32.0f);
      const __m256 offset_low = _mm256_mul_ps(thirty_two, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales8)));
      const __m256 offset_high =
          _mm256_mul_ps(thirty_two, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scales8, 8))));
      const __m256 d = _mm256_set1_ps(load_half(block + 208));
      for (int r = 0; r < a.rows; ++r) {
        const int8_t* x = a.acts[r].q + 256 * b;
        const float* xd = a.acts[r].d + 64 * b;  // lane i of q[k]: xd[8k + i]
        __m256 scaled = _mm256_setzero_ps();
        for (int k = 0; k < 8; ++k) {
          const __m256i pairs = _mm256_maddubs_epi16(q[k], load(x + 32 * k));
          const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, scale[k]));
          scaled = _mm256_fmadd_ps(sum, _mm256_loadu_ps(xd + 8 * k), scaled);
        }
        const float* dsums = a.acts[r].dsums16 + 16 * b;
        scaled = _mm256_fnmadd_ps(offset_low, _mm256_loadu_ps(dsums), scaled);
        scaled = _mm256_fnmadd_ps(offset_high, _mm256_loadu_ps(dsums + 8), scaled);
        acc[r] = _mm256_fmadd_ps(scaled, d, acc[r]);
      }
    }
    for (int r = 0; r < a.rows; ++r) a.out[r * a.out_stride + n] = hsum(acc[r]);
  }
}

// One 32-value block's d: its f16, or MXFP4's E8M0 byte.
template <int QType>
inline float block_d(const uint8_t* block) {
  if constexpr (QType == MXFP4) return e8m0_half_to_float(block[0]);
  else return load_half(block);
}

// One 32-value block as signed int8 (w = d * q).
template <int QType>
inline __m256i unpack_32(const uint8_t* block) {
  if (QType == Q8_0) return load(block + 2);
  if (QType == MXFP4) {  // each nibble looked up in the 16 values (`vpshufb`)
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 1));
    const __m128i values = _mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(codes, 4), nibble)),
                            _mm_shuffle_epi8(values, _mm_and_si128(codes, nibble)));
  }
  const uint8_t* qs = block + (QType == Q5_0 ? 6 : 2);
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble),
                               _mm_and_si128(packed, nibble));
  if (QType == Q4_0) return _mm256_sub_epi8(q, _mm256_set1_epi8(8));
  // Q5_0: bit i of qh goes to byte i: spread qh's byte i / 8 to byte i, then test bit i % 8.
  uint32_t qh;
  std::memcpy(&qh, block + 2, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(qh)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bits = _mm256_set1_epi64x(int64_t(0x8040201008040201));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits);
  q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
  return _mm256_sub_epi8(q, _mm256_set1_epi8(16));
}

template <int QType>
void tile_32(const TileArgs& a) {
  constexpr int block_bytes = q32_block_bytes(QType);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = a.n_begin; n < a.n_end; ++n) {
    const uint8_t* row = a.weights + n * a.weight_row_bytes;
    __m256 acc[kMaxRows];
    for (int r = 0; r < a.rows; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* block = row + b * block_bytes;
      const __m256i w = unpack_32<QType>(block);
      const __m256i magnitude = _mm256_sign_epi8(w, w);  // |w|, unsigned for maddubs
      const __m256 d = _mm256_set1_ps(block_d<QType>(block));
      for (int r = 0; r < a.rows; ++r) {
        // x * sign(w): the product |w| * x * sign(w) = w * x, pairs summed in int16
        const __m256i x = _mm256_sign_epi8(load(a.acts[r].q + 32 * b), w);
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x), ones);
        // lanes 0-3: the block's first group of 16, 4-7 its second
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_loadu_ps(a.acts[r].d + 8 * b)),
                                 acc[r]);
      }
    }
    for (int r = 0; r < a.rows; ++r) a.out[r * a.out_stride + n] = hsum(acc[r]);
  }
}


}  // namespace

Variant avx2_variant() {
  return {"avx2",          tile_32<Q4_0>,    tile_32<Q5_0>, tile_32<Q8_0>, tile_32<MXFP4>,
          q4_k_tile<false>, q4_k_tile<true>, q6_k_tile,     nullptr,
          rows16_tile<Q4_K_R16, false>, rows16_tile<Q6_K_R16, false>,
          rows16_tile<Q4_0_R16, false>, rows16_tile<Q5_0_R16, false>,
          nullptr,  // Q8_0 stays per row: its values past 127 overflow vpmaddubsw's pairs
          rows16_tile<MXFP4_R16, false>,
          kNatural,         kNatural,        dequantize_row_impl, dequantize_group_impl};
}

}  // namespace specserve::gguf
