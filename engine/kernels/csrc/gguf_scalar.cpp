// The portable reference: every format in plain C++, written for clarity, not speed. The SIMD
// variants are tested against it (their integer dot products must match it exactly), it serves a
// CPU without AVX2, and its activation rounding is the one every variant uses.
#include <algorithm>
#include <cmath>

#include "gguf_blocks.h"
#include "gguf_dequant.h"

namespace specserve::gguf {
namespace {

// A K-quant super-block in integer form: w = d * scale[g] * (q - offset) - dmin * min[g] for
// the value's group of 16, g = value / 16.
struct KBlock {
  uint8_t q[256];
  int32_t scale[16], min[16];
  int32_t offset;
  float d, dmin;
};

void unpack_q4_k_or_q5_k(const uint8_t* block, bool five_bits, KBlock* out) {
  const uint8_t* qh = block + 16;
  const uint8_t* qs = block + (five_bits ? 48 : 16);
  out->d = half_to_float(block);
  out->dmin = half_to_float(block + 2);
  uint8_t scales_mins[16];
  k_scales_mins(block + 4, scales_mins);
  for (int g = 0; g < 16; ++g) {
    out->scale[g] = scales_mins[g / 2];
    out->min[g] = scales_mins[8 + g / 2];
  }
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < 32; ++l) {
      uint8_t low = qs[32 * j + l] & 15, high = qs[32 * j + l] >> 4;
      if (five_bits) {
        low |= ((qh[l] >> (2 * j)) & 1) << 4;
        high |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
      }
      out->q[64 * j + l] = low;
      out->q[64 * j + 32 + l] = high;
    }
  }
  out->offset = 0;
}

void unpack_q6_k(const uint8_t* block, KBlock* out) {
  const uint8_t* ql = block;
  const uint8_t* qh = block + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
  out->d = half_to_float(block + 208);
  out->dmin = 0.0f;
  out->offset = 32;
  for (int g = 0; g < 16; ++g) {
    out->scale[g] = sc[g];
    out->min[g] = 0;
  }
  for (int h = 0; h < 2; ++h) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t a = ql[64 * h + l], b = ql[64 * h + 32 + l], high = qh[32 * h + l];
      out->q[128 * h + l] = (a & 15) | (high & 3) << 4;
      out->q[128 * h + 32 + l] = (b & 15) | (high >> 2 & 3) << 4;
      out->q[128 * h + 64 + l] = (a >> 4) | (high >> 4 & 3) << 4;
      out->q[128 * h + 96 + l] = (b >> 4) | (high >> 6) << 4;
    }
  }
}

void unpack_q4_k_x(const uint8_t* block, KBlock* out) {
  out->d = half_to_float(block);
  out->dmin = half_to_float(block + 2);
  out->offset = 0;
  for (int g = 0; g < 16; ++g) {
    out->scale[g] = block[4 + g / 2];
    out->min[g] = block[12 + g / 2];
  }
  const uint8_t* qs = block + 20;
  for (int c = 0; c < 2; ++c) {
    for (int p = 0; p < 64; ++p) {
      out->q[value_in_lanes(2 * c, p)] = qs[64 * c + p] & 15;
      out->q[value_in_lanes(2 * c + 1, p)] = qs[64 * c + p] >> 4;
    }
  }
}

void unpack_k(int qtype, const uint8_t* block, KBlock* out) {
  if (qtype == Q4_K_X) {
    unpack_q4_k_x(block, out);
  } else if (qtype == Q6_K) {
    unpack_q6_k(block, out);
  } else {
    unpack_q4_k_or_q5_k(block, qtype == Q5_K, out);
  }
}

// A 32-value block in integer form: w = d * q.
void unpack_32(int qtype, const uint8_t* block, int8_t q[32], float* d) {
  *d = half_to_float(block);
  if (qtype == Q8_0) {
    std::memcpy(q, block + 2, 32);
    return;
  }
  const bool five = qtype == Q5_0;
  uint32_t qh = 0;
  if (five) std::memcpy(&qh, block + 2, 4);
  const uint8_t* qs = block + (five ? 6 : 2);
  const int offset = five ? 16 : 8;
  for (int i = 0; i < 16; ++i) {
    const int low = (qs[i] & 15) | (five ? ((qh >> i) & 1) << 4 : 0);
    const int high = (qs[i] >> 4) | (five ? ((qh >> (i + 16)) & 1) << 4 : 0);
    q[i] = int8_t(low - offset);
    q[i + 16] = int8_t(high - offset);
  }
}

template <int QType>
void k_tile(const TileArgs& a) {
  constexpr int block_bytes = QType == Q4_K ? 144 : QType == Q5_K ? 176 : QType == Q4_K_X ? 148 : 210;
  for (int64_t n = a.n_begin; n < a.n_end; ++n) {
    const uint8_t* row = a.weights + n * a.weight_row_bytes;
    float acc[kMaxRows] = {};
    for (int64_t b = 0; b < a.blocks; ++b) {
      KBlock w;
      unpack_k(QType, row + b * block_bytes, &w);
      for (int r = 0; r < a.rows; ++r) {
        const int8_t* x = a.acts[r].q + 256 * b;
        const int16_t* sums = a.acts[r].sums + 16 * b;
        int32_t scaled = 0, mins = 0;
        for (int g = 0; g < 16; ++g) {
          int32_t dot = 0;
          for (int i = 0; i < 16; ++i) dot += int32_t(w.q[16 * g + i]) * x[16 * g + i];
          scaled += w.scale[g] * (dot - w.offset * sums[g]);
          mins += w.min[g] * sums[g];
        }
        acc[r] += a.acts[r].d[b] * (w.d * float(scaled) - w.dmin * float(mins));
      }
    }
    for (int r = 0; r < a.rows; ++r) a.out[r * a.out_stride + n] = acc[r];
  }
}

template <int QType>
void tile_32(const TileArgs& a) {
  const int block_bytes = QType == Q8_0 ? 34 : QType == Q5_0 ? 22 : 18;
  for (int64_t n = a.n_begin; n < a.n_end; ++n) {
    const uint8_t* row = a.weights + n * a.weight_row_bytes;
    float acc[kMaxRows] = {};
    for (int64_t b = 0; b < a.blocks; ++b) {
      int8_t q[32];
      float d;
      unpack_32(QType, row + b * block_bytes, q, &d);
      for (int r = 0; r < a.rows; ++r) {
        const int8_t* x = a.acts[r].q + 32 * b;
        int32_t dot = 0;
        for (int i = 0; i < 32; ++i) dot += int32_t(q[i]) * x[i];
        acc[r] += (d * a.acts[r].d[8 * b]) * float(dot);
      }
    }
    for (int r = 0; r < a.rows; ++r) a.out[r * a.out_stride + n] = acc[r];
  }
}

// Round to nearest even by the float adder (1.5 * 2^23 pushes the fraction out), exact for
// |v| < 2^22: the same result as nearbyint in the default rounding mode, without a libm call.
inline int32_t round_nearest(float v) {
  const float magic = 12582912.0f;
  return int32_t((v + magic) - magic);
}

// 32-value runs 0..7 -> 0, 2, 1, 3, 4, 6, 5, 7 (QOrder kNibbleHalves).
void reorder_nibble_halves(int8_t* q) {
  int8_t copy[256];
  std::memcpy(copy, q, 256);
  static const int kRun[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  for (int i = 0; i < 8; ++i) std::memcpy(q + 32 * i, copy + 32 * kRun[i], 32);
}

void reorder_subblock_lanes(int8_t* q) {
  int8_t copy[256];
  std::memcpy(copy, q, 256);
  for (int k = 0; k < 4; ++k) {
    for (int p = 0; p < 64; ++p) q[64 * k + p] = copy[value_in_lanes(k, p)];
  }
}

}  // namespace

void pack_q4_k_x(const uint8_t* block, uint8_t* out) {
  KBlock w;
  unpack_q4_k_or_q5_k(block, false, &w);
  std::memcpy(out, block, 4);  // d, dmin
  k_scales_mins(block + 4, out + 4);
  for (int c = 0; c < 2; ++c) {
    for (int p = 0; p < 64; ++p) {
      out[20 + 64 * c + p] = uint8_t(w.q[value_in_lanes(2 * c, p)] | w.q[value_in_lanes(2 * c + 1, p)] << 4);
    }
  }
}

void dequantize_block(int qtype, const uint8_t* block, float* out) {
  if (is_k_quant(qtype)) {
    KBlock w;
    unpack_k(qtype, block, &w);
    for (int i = 0; i < 256; ++i) {
      const int g = i / 16;
      out[i] = w.d * float(w.scale[g] * (int32_t(w.q[i]) - w.offset)) - w.dmin * float(w.min[g]);
    }
    return;
  }
  int8_t q[32];
  float d;
  unpack_32(qtype, block, q, &d);
  for (int i = 0; i < 32; ++i) out[i] = d * float(q[i]);
}

void quantize_row(const float* x, const ActLayout& layout, uint8_t* row, float* residual) {
  int8_t* q = reinterpret_cast<int8_t*>(row);
  int16_t* sums = reinterpret_cast<int16_t*>(row + layout.sums_offset);
  float* dsums = reinterpret_cast<float*>(row + layout.dsums_offset);
  float* d_out = reinterpret_cast<float*>(row + layout.d_offset);
  const int block = layout.k_quant ? 256 : 32;
  for (int64_t b = 0; b < layout.k / block; ++b) {
    const float* xb = x + b * block;
    float amax = 0.0f;
    for (int i = 0; i < block; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f;
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < block; ++i) {
      q[b * block + i] = int8_t(std::clamp(round_nearest(xb[i] * inverse), -127, 127));
    }
    if (residual != nullptr) {
      for (int i = 0; i < block; ++i) residual[b * block + i] = xb[i] - d * float(q[b * block + i]);
    }
    if (layout.k_quant) {
      d_out[b] = d;
      for (int g = 0; g < 16; ++g) {
        int32_t sum = 0;
        for (int i = 0; i < 16; ++i) sum += q[b * block + 16 * g + i];
        sums[b * 16 + g] = int16_t(sum);
      }
      for (int s = 0; s < 8; ++s) dsums[b * 8 + s] = d * float(sums[b * 16 + 2 * s] + sums[b * 16 + 2 * s + 1]);
      if (layout.q_order == kNibbleHalves) reorder_nibble_halves(q + b * block);
      if (layout.q_order == kSubblockLanes) reorder_subblock_lanes(q + b * block);
    } else {
      for (int i = 0; i < 8; ++i) d_out[8 * b + i] = d;
    }
  }
}

Variant scalar_variant() {
  return {"scalar",     tile_32<Q4_0>, tile_32<Q5_0>, tile_32<Q8_0>,
          k_tile<Q4_K>, k_tile<Q5_K>,   k_tile<Q6_K>, k_tile<Q4_K_X>,
          kNatural,     kNatural,       dequantize_row_impl};
}

}  // namespace specserve::gguf
