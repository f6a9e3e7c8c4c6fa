// AVX512-VNNI variant (AVX512 F/BW/VL + VNNI): `vpdpbusd` sums 4 unsigned-weight x
// signed-activation products into each int32 lane, 64 products an instruction.
//
// A zmm of 64 weights spans two 32-value sub-blocks (Q4_K, Q5_K: lanes 0-7 and 8-15) or four
// 16-value groups (Q6_K: 4 lanes each). Their int16-sized lane sums (at most 4 * 63 * 127) get
// their scales by `vpmaddwd` against scales held as int32 with a zero high half, which is an
// exact int32 multiply in one instruction. The 32-value formats take two blocks per zmm.
//
// As in the AVX2 file, each weight block is unpacked once for all rows and each row keeps its
// own accumulator, so a row's result does not depend on the other rows of the tile.
#include <immintrin.h>

#include <algorithm>

#include "gguf_blocks.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

#include "gguf_dequant.h"  // after the pragma: compiled for this target

namespace specserve::gguf {
namespace {

inline float load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m512i load(const void* p) { return _mm512_loadu_si512(p); }

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

inline __m512i dot(__m512i weights_u8, __m512i x_s8) {
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), weights_u8, x_s8);
}

// The lane -> scale index maps: lane i of zmm k takes scale `first + i / per`.
inline __m512i lane_index(int first, int per) {
  alignas(64) int32_t index[16];
  for (int i = 0; i < 16; ++i) index[i] = first + i / per;
  return _mm512_load_si512(index);
}

// Activations come in QOrder kNibbleHalves: zmm k of the weights is the low (k even) or high
// (k odd) nibbles of the 64-byte half k / 2 of qs, i.e. the 32-value runs (sub-blocks)
// {0, 2}, {1, 3}, {4, 6}, {5, 7} in its 256-bit halves, and the activations are stored so.
template <bool FiveBits>
void q4_k_tile(const TileArgs& a) {
  constexpr int block_bytes = FiveBits ? 176 : 144;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i fifth = _mm512_set1_epi8(0x10);
  static const int kRuns[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
  __m512i pick[4], fifth_bit[4];
  for (int k = 0; k < 4; ++k) {
    pick[k] = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(kRuns[k][0]), _mm512_set1_epi32(kRuns[k][1]));
    // value 64j + l has its fifth bit at bit 2j of qh[l], value 64j + 32 + l at bit 2j + 1
    fifth_bit[k] = _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi8(char(1 << (2 * (k / 2) * 2 + k % 2))),
                                           _mm512_set1_epi8(char(1 << ((2 * (k / 2) + 1) * 2 + k % 2))));
  }
  for (int64_t n = a.n_begin; n < a.n_end; ++n) {
    const uint8_t* row = a.weights + n * a.weight_row_bytes;
    __m512 acc[kMaxRows];
    __m256 low_acc[kMaxRows];
    for (int r = 0; r < a.rows; ++r) {
      acc[r] = _mm512_setzero_ps();
      low_acc[r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* block = row + b * block_bytes;
      const uint8_t* qs = block + (FiveBits ? 48 : 16);
      uint8_t scales_mins[16];
      k_scales_mins(block + 4, scales_mins);
      __m512i q[4];
      for (int half = 0; half < 2; ++half) {
        const __m512i v = load(qs + 64 * half);
        q[2 * half] = _mm512_and_si512(v, nibble);
        q[2 * half + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
      if (FiveBits) {
        const __m256i qh = load256(block + 16);
        const __m512i bits = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
        for (int k = 0; k < 4; ++k) {
          q[k] = _mm512_or_si512(q[k], _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(bits, fifth_bit[k]), fifth));
        }
      }
      const __m512i scales_mins32 =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales_mins)));
      __m512i scale[4];
      for (int k = 0; k < 4; ++k) scale[k] = _mm512_permutexvar_epi32(pick[k], scales_mins32);
      const __m256 mins = _mm256_mul_ps(
          _mm256_set1_ps(load_half(block + 2)),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales_mins + 8)))));
      const __m512 d = _mm512_set1_ps(load_half(block));
      for (int r = 0; r < a.rows; ++r) {
        const int8_t* x = a.acts[r].q + 256 * b;
        const float* xd = a.acts[r].d + 64 * b;  // lane i of zmm k: xd[16k + i]
        __m512 scaled = _mm512_setzero_ps();
        for (int k = 0; k < 4; ++k) {
          const __m512i sum = _mm512_madd_epi16(dot(q[k], load(x + 64 * k)), scale[k]);
          scaled = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_loadu_ps(xd + 16 * k), scaled);
        }
        acc[r] = _mm512_fmadd_ps(scaled, d, acc[r]);
        low_acc[r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(a.acts[r].dsums32 + 8 * b), low_acc[r]);
      }
    }
    for (int r = 0; r < a.rows; ++r) {
      __m256 low = low_acc[r];
      __m128 sum = _mm_add_ps(_mm256_castps256_ps128(low), _mm256_extractf128_ps(low, 1));
      sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
      sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
      a.out[r * a.out_stride + n] = _mm512_reduce_add_ps(acc[r]) - _mm_cvtss_f32(sum);
    }
  }
}

// Q4_K_X (repacked at load): zmm k's lane i holds 4 values of group i (16 values), so the four
// `vpdpbusd` of a block accumulate in one register (each lane at most 16 * 15 * 127, an int16)
// and take the sub-block scales with one `vpmaddwd`; the activations come in QOrder
// kSubblockLanes.
void q4_k_x_tile(const TileArgs& a) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m128i pairs = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  for (int64_t n = a.n_begin; n < a.n_end; ++n) {
    const uint8_t* row = a.weights + n * a.weight_row_bytes;
    __m512 acc[kMaxRows];
    __m256 low_acc[kMaxRows];
    for (int r = 0; r < a.rows; ++r) {
      acc[r] = _mm512_setzero_ps();
      low_acc[r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* block = row + b * 148;
      const __m512i v0 = load(block + 20), v1 = load(block + 84);
      const __m512i q0 = _mm512_and_si512(v0, nibble), q1 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), nibble);
      const __m512i q2 = _mm512_and_si512(v1, nibble), q3 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), nibble);
      const __m128i scales_mins = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
      const __m512i scale = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(scales_mins, pairs));
      const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(load_half(block + 2)),
                                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scales_mins, 8))));
      const __m512 d = _mm512_set1_ps(load_half(block));
      for (int r = 0; r < a.rows; ++r) {
        const int8_t* x = a.acts[r].q + 256 * b;
        __m512i sum = dot(q0, load(x));
        sum = _mm512_dpbusd_epi32(sum, q1, load(x + 64));
        sum = _mm512_dpbusd_epi32(sum, q2, load(x + 128));
        sum = _mm512_dpbusd_epi32(sum, q3, load(x + 192));
        const __m512i scaled = _mm512_madd_epi16(sum, scale);  // lane i: group i
        const __m512 xd = _mm512_loadu_ps(a.acts[r].d + 64 * b);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(scaled), _mm512_mul_ps(d, xd), acc[r]);
        low_acc[r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(a.acts[r].dsums32 + 8 * b), low_acc[r]);
      }
    }
    for (int r = 0; r < a.rows; ++r) {
      const __m256 low = low_acc[r];
      __m128 sum = _mm_add_ps(_mm256_castps256_ps128(low), _mm256_extractf128_ps(low, 1));
      sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
      sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
      a.out[r * a.out_stride + n] = _mm512_reduce_add_ps(acc[r]) - _mm_cvtss_f32(sum);
    }
  }
}

void q6_k_tile(const TileArgs& a) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i top = _mm512_set1_epi8(0x30);
  // Per 256-bit half, how far the 2 high bits move to bits 4-5 (16-bit lanes, masked after).
  const __m512i shift_low = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i shift_high = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const __m512i low_half = _mm512_set1_epi32(0xFFFF);
  __m512i pick[4];
  for (int k = 0; k < 4; ++k) pick[k] = lane_index(4 * k, 4);
  for (int64_t n = a.n_begin; n < a.n_end; ++n) {
    const uint8_t* row = a.weights + n * a.weight_row_bytes;
    __m512 acc[kMaxRows];
    for (int r = 0; r < a.rows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* block = row + b * 210;
      __m512i q[4];
      for (int h = 0; h < 2; ++h) {  // ql[64h..64h+63] is [values 128h + 0..31 | + 32..63] (low nibbles)
        const __m512i low = load(block + 64 * h);
        const __m256i qh = load256(block + 128 + 32 * h);
        const __m512i high = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
        q[2 * h] = _mm512_or_si512(_mm512_and_si512(low, nibble),
                                   _mm512_and_si512(_mm512_sllv_epi16(high, shift_low), top));
        q[2 * h + 1] =
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), nibble),
                            _mm512_and_si512(_mm512_srlv_epi16(high, shift_high), top));
      }
      const __m128i scales8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
      const __m512i scales32 = _mm512_and_si512(_mm512_cvtepi8_epi32(scales8), low_half);
      __m512i scale[4];
      for (int k = 0; k < 4; ++k) scale[k] = _mm512_permutexvar_epi32(pick[k], scales32);
      // q was unpacked as 0..63: 32 * sc * (d * sum of x) per group of 16 comes back off
      const __m512 offset = _mm512_mul_ps(_mm512_set1_ps(32.0f), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scales8)));
      const __m512 d = _mm512_set1_ps(load_half(block + 208));
      for (int r = 0; r < a.rows; ++r) {
        const int8_t* x = a.acts[r].q + 256 * b;
        const float* xd = a.acts[r].d + 64 * b;  // lane i of zmm k: xd[16k + i]
        __m512 scaled = _mm512_setzero_ps();
        for (int k = 0; k < 4; ++k) {
          const __m512i sum = _mm512_madd_epi16(dot(q[k], load(x + 64 * k)), scale[k]);
          scaled = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_loadu_ps(xd + 16 * k), scaled);
        }
        scaled = _mm512_fnmadd_ps(offset, _mm512_loadu_ps(a.acts[r].dsums16 + 16 * b), scaled);
        acc[r] = _mm512_fmadd_ps(scaled, d, acc[r]);
      }
    }
    for (int r = 0; r < a.rows; ++r) a.out[r * a.out_stride + n] = _mm512_reduce_add_ps(acc[r]);
  }
}

// One 32-value block's d: its f16, or MXFP4's E8M0 byte.
template <int QType>
inline float block_d(const uint8_t* block) {
  if constexpr (QType == MXFP4) return e8m0_half_to_float(block[0]);
  else return load_half(block);
}

// One 32-value block as 32 signed int8 (w = d * q).
template <int QType>
inline __m256i unpack_32(const uint8_t* block) {
  if (QType == Q8_0) return load256(block + 2);
  if (QType == MXFP4) {  // each nibble looked up in the 16 values (`vpshufb`)
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 1));
    const __m128i values = _mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(codes, 4), nibble)),
                            _mm_shuffle_epi8(values, _mm_and_si128(codes, nibble)));
  }
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (QType == Q5_0 ? 6 : 2)));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble), _mm_and_si128(packed, nibble));
  if (QType == Q4_0) return _mm256_sub_epi8(q, _mm256_set1_epi8(8));
  uint32_t qh;
  std::memcpy(&qh, block + 2, 4);
  q = _mm256_or_si256(q, _mm256_maskz_set1_epi8(__mmask32(qh), 0x10));
  return _mm256_sub_epi8(q, _mm256_set1_epi8(16));
}

template <int QType>
void tile_32(const TileArgs& a) {
  constexpr int block_bytes = q32_block_bytes(QType);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t n = a.n_begin; n < a.n_end; ++n) {
    const uint8_t* row = a.weights + n * a.weight_row_bytes;
    __m512 acc[kMaxRows];
    for (int r = 0; r < a.rows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a.blocks; b += 2) {  // blocks b and b + 1 in the two halves
      const bool pair = b + 1 < a.blocks;
      const uint8_t* block = row + b * block_bytes;
      __m512i w = _mm512_castsi256_si512(unpack_32<QType>(block));
      w = _mm512_inserti64x4(w, pair ? unpack_32<QType>(block + block_bytes) : _mm256_setzero_si256(), 1);
      const __mmask16 lanes = pair ? 0xFFFF : 0x00FF;
      const __m512 d = _mm512_mask_blend_ps(
          0xFF00, _mm512_set1_ps(block_d<QType>(block)),
          _mm512_set1_ps(pair ? block_d<QType>(block + block_bytes) : 0.0f));
      const __m512i magnitude = _mm512_abs_epi8(w);  // |w| as unsigned, -128 included
      const __mmask64 negative = _mm512_movepi8_mask(w);
      for (int r = 0; r < a.rows; ++r) {
        const __mmask64 bytes = pair ? ~__mmask64(0) : __mmask64(0xFFFFFFFF);
        __m512i x = _mm512_maskz_loadu_epi8(bytes, a.acts[r].q + 32 * b);
        x = _mm512_mask_sub_epi8(x, negative, zero, x);  // x * sign(w)
        const __m512 dx = _mm512_maskz_loadu_ps(lanes, a.acts[r].d + 8 * b);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot(magnitude, x)), _mm512_mul_ps(d, dx), acc[r]);
      }
    }
    for (int r = 0; r < a.rows; ++r) a.out[r * a.out_stride + n] = _mm512_reduce_add_ps(acc[r]);
  }
}


// ---- Row-interleaved layouts (Q4_K_R16, Q6_K_R16; gguf_blocks.h): lane j is output column j ----
//
// Each `vpdpbusd` takes 4 K values of 16 columns and one group of 4 activations broadcast to
// every lane. Each group of 16 values' int32 sums turn float once, times the row's scale for
// that group (a broadcast load); the column scales, converted once per block for all rows,
// multiply a sub-block's sum; the mins and Q6_K's -32 come off through the row's per-group
// d * sum(q). The weights are unpacked once per sub-block and used by all `Rows` (1 to 16)
// activation rows, whose accumulators stay in registers.

// x[0..3] in every int32 lane: GCC 12 emits a `vpbroadcastd` load (a load-port uop, no ALU work)
// rather than folding it into `vpdpbusd` as an m32bcst operand; either costs no shuffle.
inline __m512i broadcast4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

inline __m512 load_halves(const uint8_t* p) {  // 16 f16 -> 16 floats
  return _mm512_cvtph_ps(load256(p));
}

// 16 E8M0 bytes -> 16 floats 2^(e - 128), as e8m0_half_to_float: (e - 1) << 23, or for e = 0, 1
// the subnormals 0x00200000 << e.
inline __m512 e8m0_halves(const uint8_t* p) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
  const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, tiny));
}

// 4 x 4 values of 16 columns (w[0..3]) times 16 activations: int32 per column.
inline __m512i dot16(const __m512i* w, const int8_t* x) {
  __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], broadcast4(x));
  for (int t = 1; t < 4; ++t) sum = _mm512_dpbusd_epi32(sum, w[t], broadcast4(x + 4 * t));
  return sum;
}

// One group of 16 columns x Rows rows, Q4_K_R16. The columns' d and dmin multiply their
// sub-block scales and mins once for all rows, so each row keeps one accumulator
// (16 rows: 16 of the 32 zmm) and pays no per-block multiply of its own.
template <int Rows>
void q4_k_r16_group(const TileArgs& a) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i low_half = _mm512_set1_epi32(0xFFFF);
  const uint8_t* group = a.weights + a.n_begin * a.weight_row_bytes;
  __m512 acc[Rows];  // [16 columns] per row
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* block = group + b * (16 * 148);
    const __m512 d = load_halves(block);
    for (int s = 0; s < 8; ++s) {
      prefetch_ahead(block, 16 * 148, s, 8);
      __m512i w[8];  // w[t]: values 32s + 4t .. + 3 of the 16 columns
      for (int c = 0; c < 4; ++c) {
        const __m512i v = load(block + 320 + 256 * s + 64 * c);
        w[c] = _mm512_and_si512(v, nibble);
        w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
      const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64 + 16 * s)))));
#pragma GCC unroll 16  // GCC leaves a loop, and the sums in memory, past 8 rows otherwise
      for (int r = 0; r < Rows; ++r) {
        const int8_t* x = a.acts[r].q + 256 * b + 32 * s;
        const float* xd = a.acts[r].d + 64 * b + 8 * s;  // groups 2s, 2s + 1: xd[0], xd[4]
        __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(dot16(w, x)), _mm512_set1_ps(xd[0]));
        sub = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot16(w + 4, x + 16)), _mm512_set1_ps(xd[4]), sub);
        acc[r] = _mm512_fmadd_ps(sub, scale, acc[r]);
      }
    }
    __m512 mins[8];  // column j's dmin * min of sub-block s (stored in pairs 2p, 2p + 1 per int16)
    const __m512 dmin = load_halves(block + 32);
    for (int p = 0; p < 4; ++p) {
      const __m512i pair = _mm512_cvtepu8_epi16(load256(block + 192 + 32 * p));
      mins[2 * p] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_and_si512(pair, low_half)));
      mins[2 * p + 1] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(pair, 16)));
    }
    for (int r = 0; r < Rows; ++r) {
      const float* dsums = a.acts[r].dsums32 + 8 * b;
      __m512 low = _mm512_mul_ps(mins[0], _mm512_set1_ps(dsums[0]));
      for (int s = 1; s < 8; ++s) low = _mm512_fmadd_ps(mins[s], _mm512_set1_ps(dsums[s]), low);
      acc[r] = _mm512_sub_ps(acc[r], low);
    }
  }
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(a.out + r * a.out_stride + a.n_begin, acc[r]);
}

// One group of 16 columns x Rows rows, Q6_K_R16. The columns' d multiplies their group scales once
// per group for all rows; per row, the -32 of q comes off the group's sum before its one scale:
// (d_x * sum(q x) - 32 * d_x * sum(x)) * (d * scale).
template <int Rows>
void q6_k_r16_group(const TileArgs& a) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i top = _mm512_set1_epi8(0x30);
  const uint8_t* group = a.weights + a.n_begin * a.weight_row_bytes;
  __m512 acc[Rows];  // [16 columns] per row
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* block = group + b * (16 * 210);
    const __m512 d = load_halves(block);
    for (int g = 0; g < 16; ++g) {
      prefetch_ahead(block, 16 * 210, g, 16);
      const uint8_t* values = block + 288 + 192 * g;
      const __m512i low0 = load(values), low1 = load(values + 64), high = load(values + 128);
      // w[k]: values 16g + 4k .. + 3; the two high bits of k sit at bits 2k, 2k + 1 of `high`
      // (0xF8: a | (b & c), the nibble or'ed with the masked high bits in one instruction)
      const __m512i w[4] = {
          _mm512_ternarylogic_epi32(_mm512_and_si512(low0, nibble), _mm512_slli_epi16(high, 4), top, 0xF8),
          _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(low0, 4), nibble), _mm512_slli_epi16(high, 2), top, 0xF8),
          _mm512_ternarylogic_epi32(_mm512_and_si512(low1, nibble), high, top, 0xF8),
          _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(low1, 4), nibble), _mm512_srli_epi16(high, 2), top, 0xF8),
      };
      // scales are stored in int16-able pairs (groups 2p, 2p + 1): pick this group's half
      const __m512i pair = _mm512_cvtepi8_epi16(load256(block + 32 + 32 * (g / 2)));
      const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(
          g % 2 ? _mm512_srai_epi32(pair, 16) : _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16)));
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r) {
        const int8_t* x = a.acts[r].q + 256 * b + 16 * g;
        const __m512 offset = _mm512_set1_ps(32.0f * a.acts[r].dsums16[16 * b + g]);  // exact: a power of 2
        const __m512 xd = _mm512_set1_ps(a.acts[r].d[64 * b + 4 * g]);
        const __m512 sum = _mm512_fmsub_ps(_mm512_cvtepi32_ps(dot16(w, x)), xd, offset);
        acc[r] = _mm512_fmadd_ps(sum, scale, acc[r]);
      }
    }
  }
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(a.out + r * a.out_stride + a.n_begin, acc[r]);
}

// One group of 16 columns x Rows rows, Q4_0_R16 / Q5_0_R16 / Q8_0_R16 / MXFP4_R16: per block of
// 32 values, each half's int32 sums turn float times the row's group scale, the format's offset
// comes off through the row's d * sum(q) of the block, and the column scales multiply the block's
// sum. MXFP4's codes become 12 + their value by one `vpshufb` per 64 bytes.
template <int QType, int Rows>
void q32_r16_group(const TileArgs& a) {
  constexpr int block_bytes = 16 * q32_block_bytes(rows16_tail(QType)), values_at = r16_values_at(QType);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i fifth = _mm512_set1_epi8(0x10);
  const __m512 offset = _mm512_set1_ps(float(q32_offset(QType)));
  const uint8_t* group = a.weights + a.n_begin * a.weight_row_bytes;
  __m512 acc[Rows];
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* block = group + b * block_bytes;
    prefetch_ahead(block, block_bytes, 0, 1);
    __m512i w[8];  // w[t]: values 4t .. 4t + 3 of the 16 columns
    if constexpr (QType == Q8_0_R16) {
      for (int t = 0; t < 8; ++t) w[t] = load(block + 32 + 64 * t);
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m512i v = load(block + values_at + 64 * c);
        w[c] = _mm512_and_si512(v, nibble);
        w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
      if constexpr (QType == MXFP4_R16) {
        const __m512i values = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Unsigned)));
        for (int t = 0; t < 8; ++t) w[t] = _mm512_shuffle_epi8(values, w[t]);
      }
      if constexpr (QType == Q5_0_R16) {
        for (int m = 0; m < 8; ++m) {
          uint64_t bits;
          std::memcpy(&bits, block + 288 + 8 * m, 8);
          __m512i& target = w[m / 2 + 4 * (m % 2)];
          target = _mm512_or_si512(target, _mm512_maskz_mov_epi8(_cvtu64_mask64(bits), fifth));
        }
      }
    }
    const __m512 d = QType == MXFP4_R16 ? e8m0_halves(block) : load_halves(block);
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const int8_t* x = a.acts[r].q + 32 * b;
      const float* xd = a.acts[r].d + 8 * b;  // the block's groups of 16: xd[0], xd[4]
      __m512 sum = _mm512_mul_ps(_mm512_cvtepi32_ps(dot16(w, x)), _mm512_set1_ps(xd[0]));
      sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot16(w + 4, x + 16)), _mm512_set1_ps(xd[4]), sum);
      sum = _mm512_fnmadd_ps(offset, _mm512_set1_ps(a.acts[r].dsums32[b]), sum);
      acc[r] = _mm512_fmadd_ps(sum, d, acc[r]);
    }
  }
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(a.out + r * a.out_stride + a.n_begin, acc[r]);
}

// The row count as a template argument, so each row's accumulators are registers.
template <template <int> class Group, int Rows = kMaxRows16>
void by_rows(const TileArgs& a) {
  if constexpr (Rows > 1) {
    if (a.rows < Rows) return by_rows<Group, Rows - 1>(a);
  }
  Group<Rows>::run(a);
}

template <int Rows>
struct Q4KRows16 {
  static void run(const TileArgs& a) { q4_k_r16_group<Rows>(a); }
};

template <int Rows>
struct Q6KRows16 {
  static void run(const TileArgs& a) { q6_k_r16_group<Rows>(a); }
};

template <int QType>
struct Q32Rows16 {
  template <int Rows>
  struct Of {
    static void run(const TileArgs& a) { q32_r16_group<QType, Rows>(a); }
  };
};

}  // namespace

Variant avx512_variant() {
  return {"avx512vnni",     tile_32<Q4_0>,    tile_32<Q5_0>, tile_32<Q8_0>, tile_32<MXFP4>,
          q4_k_tile<false>, q4_k_tile<true>, q6_k_tile,     q4_k_x_tile,
          by_rows<Q4KRows16>, by_rows<Q6KRows16>,
          by_rows<Q32Rows16<Q4_0_R16>::Of>, by_rows<Q32Rows16<Q5_0_R16>::Of>, by_rows<Q32Rows16<Q8_0_R16>::Of>,
          by_rows<Q32Rows16<MXFP4_R16>::Of>,
          kNibbleHalves,    kSubblockLanes,  dequantize_row_impl, dequantize_group_impl};
}

}  // namespace specserve::gguf
