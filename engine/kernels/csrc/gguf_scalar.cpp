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

// Column j of a Q4_K_R16 super-block (layout in gguf_blocks.h).
void unpack_q4_k_r16(const uint8_t* block, int j, KBlock* out) {
  out->d = half_to_float(block + 2 * j);
  out->dmin = half_to_float(block + 32 + 2 * j);
  out->offset = 0;
  for (int g = 0; g < 16; ++g) {
    const int s = g / 2;
    out->scale[g] = block[64 + 16 * s + j];
    out->min[g] = block[192 + 32 * (s / 2) + 2 * j + s % 2];
  }
  for (int s = 0; s < 8; ++s) {
    for (int c = 0; c < 4; ++c) {
      for (int i = 0; i < 4; ++i) {
        const uint8_t byte = block[320 + 256 * s + 64 * c + 4 * j + i];
        out->q[32 * s + 4 * c + i] = byte & 15;
        out->q[32 * s + 16 + 4 * c + i] = byte >> 4;
      }
    }
  }
}

// Column j of a Q6_K_R16 super-block.
void unpack_q6_k_r16(const uint8_t* block, int j, KBlock* out) {
  out->d = half_to_float(block + 2 * j);
  out->dmin = 0.0f;
  out->offset = 32;
  for (int g = 0; g < 16; ++g) {
    out->scale[g] = int8_t(block[32 + 32 * (g / 2) + 2 * j + g % 2]);
    out->min[g] = 0;
    const uint8_t* group = block + 288 + 192 * g;
    for (int i = 0; i < 4; ++i) {
      const uint8_t high = group[128 + 4 * j + i];
      for (int k = 0; k < 4; ++k) {
        const uint8_t low = group[64 * (k / 2) + 4 * j + i];
        out->q[16 * g + 4 * k + i] = (k % 2 ? low >> 4 : low & 15) | ((high >> (2 * k)) & 3) << 4;
      }
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
  if (qtype == MXFP4) {
    *d = e8m0_half_to_float(block[0]);
    for (int i = 0; i < 16; ++i) {
      q[i] = kMxfp4Values[block[1 + i] & 15];
      q[i + 16] = kMxfp4Values[block[1 + i] >> 4];
    }
    return;
  }
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

// Super-block b of weight row n of a *_R16 matrix; `full_group`: n's group has all 16 rows
// (else n is one of the last N % 16 rows, stored per row as the tail form).
void unpack_rows16(int qtype, const uint8_t* weights, int64_t row_bytes, bool full_group, int64_t n,
                   int64_t b, KBlock* out) {
  Format format;
  format_of(qtype, &format);
  if (!full_group) return unpack_k(rows16_tail(qtype), weights + n * row_bytes + b * format.block_bytes, out);
  const uint8_t* block = weights + n / kGroupRows * kGroupRows * row_bytes + b * kGroupRows * format.block_bytes;
  if (qtype == Q4_K_R16) return unpack_q4_k_r16(block, int(n % kGroupRows), out);
  unpack_q6_k_r16(block, int(n % kGroupRows), out);
}

template <int QType>
void k_tile(const TileArgs& a) {
  constexpr int block_bytes = QType == Q4_K ? 144 : QType == Q5_K ? 176 : QType == Q4_K_X ? 148 : 210;
  // a *_R16 tile is one group: all 16 rows interleaved, or the per-row tail (gguf_blocks.h)
  for (int64_t n = a.n_begin; n < a.n_end; ++n) {
    const uint8_t* row = a.weights + n * a.weight_row_bytes;
    float acc[kMaxRows16] = {};
    for (int64_t b = 0; b < a.blocks; ++b) {
      KBlock w;
      if (is_rows16(QType)) {
        unpack_rows16(QType, a.weights, a.weight_row_bytes, a.n_end - a.n_begin == kGroupRows, n, b, &w);
      } else {
        unpack_k(QType, row + b * block_bytes, &w);
      }
      for (int r = 0; r < a.rows; ++r) {
        const ActRow& act = a.acts[r];
        float scaled = 0.0f, mins = 0.0f;
        for (int g = 0; g < 16; ++g) {
          int32_t dot = 0;
          for (int i = 0; i < 16; ++i) dot += int32_t(w.q[16 * g + i]) * act.q[256 * b + 16 * g + i];
          const float xd = act.d[64 * b + 4 * g], dsum = act.dsums16[16 * b + g];
          scaled += float(w.scale[g]) * (xd * float(dot) - float(w.offset) * dsum);
          mins += float(w.min[g]) * dsum;
        }
        acc[r] += w.d * scaled - w.dmin * mins;
      }
    }
    for (int r = 0; r < a.rows; ++r) a.out[r * a.out_stride + n] = acc[r];
  }
}

// Block b of weight row n of a 32-value type (file or *_R16 layout) as signed values and d.
template <int QType>
void unpack_32_at(const TileArgs& a, int64_t n, int64_t b, int8_t q[32], float* d) {
  if constexpr (is_rows16_32(QType)) {
    constexpr int block_bytes = q32_block_bytes(rows16_tail(QType));
    if (a.n_end - a.n_begin != kGroupRows) {  // a tail row, stored as the file's
      return unpack_32(rows16_tail(QType), a.weights + n * a.weight_row_bytes + b * block_bytes, q, d);
    }
    uint8_t u[32];
    unpack_32_r16(QType, a.weights + a.n_begin * a.weight_row_bytes + b * kGroupRows * block_bytes,
                  int(n - a.n_begin), u, d);
    for (int i = 0; i < 32; ++i) q[i] = int8_t(int(u[i]) - q32_offset(QType));
  } else {
    unpack_32(QType, a.weights + n * a.weight_row_bytes + b * q32_block_bytes(QType), q, d);
  }
}

template <int QType>
void tile_32(const TileArgs& a) {
  for (int64_t n = a.n_begin; n < a.n_end; ++n) {
    float acc[kMaxRows16] = {};
    for (int64_t b = 0; b < a.blocks; ++b) {
      int8_t q[32];
      float d;
      unpack_32_at<QType>(a, n, b, q, &d);
      for (int r = 0; r < a.rows; ++r) {
        const int8_t* x = a.acts[r].q + 32 * b;
        int32_t low = 0, high = 0;  // the block's two groups of 16
        for (int i = 0; i < 16; ++i) low += int32_t(q[i]) * x[i];
        for (int i = 16; i < 32; ++i) high += int32_t(q[i]) * x[i];
        acc[r] += d * (a.acts[r].d[8 * b] * float(low) + a.acts[r].d[8 * b + 4] * float(high));
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

// 32-value runs 0..7 -> 0, 2, 1, 3, 4, 6, 5, 7 (QOrder kNibbleHalves), q and the scales of its
// 4-value units alike.
void reorder_nibble_halves(int8_t* q, float* d) {
  int8_t copy[256];
  float d_copy[64];
  std::memcpy(copy, q, 256);
  std::memcpy(d_copy, d, sizeof d_copy);
  static const int kRun[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  for (int i = 0; i < 8; ++i) {
    std::memcpy(q + 32 * i, copy + 32 * kRun[i], 32);
    std::memcpy(d + 8 * i, d_copy + 8 * kRun[i], 8 * sizeof(float));
  }
}

void reorder_subblock_lanes(int8_t* q, float* d) {
  int8_t copy[256];
  float d_copy[64];
  std::memcpy(copy, q, 256);
  std::memcpy(d_copy, d, sizeof d_copy);
  for (int k = 0; k < 4; ++k) {
    for (int p = 0; p < 64; ++p) q[64 * k + p] = copy[value_in_lanes(k, p)];
    for (int p = 0; p < 64; p += 4) d[16 * k + p / 4] = d_copy[value_in_lanes(k, p) / 4];
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

namespace {

// Column j of a Q4_K_R16 super-block from its unpacked Q4_K block (the inverse of unpack_q4_k_r16).
void pack_q4_k_r16_column(const uint8_t* file_block, const KBlock& w, int j, uint8_t* out) {
  std::memcpy(out + 2 * j, file_block, 2);            // d, as the file's f16
  std::memcpy(out + 32 + 2 * j, file_block + 2, 2);   // dmin
  for (int s = 0; s < 8; ++s) {
    out[64 + 16 * s + j] = uint8_t(w.scale[2 * s]);
    out[192 + 32 * (s / 2) + 2 * j + s % 2] = uint8_t(w.min[2 * s]);
    for (int c = 0; c < 4; ++c) {
      for (int i = 0; i < 4; ++i) {
        const int value = 32 * s + 4 * c + i;
        out[320 + 256 * s + 64 * c + 4 * j + i] = uint8_t(w.q[value] | w.q[value + 16] << 4);
      }
    }
  }
}

// Column j of a Q6_K_R16 super-block from its unpacked Q6_K block (the inverse of unpack_q6_k_r16).
void pack_q6_k_r16_column(const uint8_t* file_block, const KBlock& w, int j, uint8_t* out) {
  std::memcpy(out + 2 * j, file_block + 208, 2);  // d, as the file's f16
  for (int g = 0; g < 16; ++g) {
    out[32 + 32 * (g / 2) + 2 * j + g % 2] = uint8_t(w.scale[g]);
    uint8_t* group = out + 288 + 192 * g;
    for (int i = 0; i < 4; ++i) {
      const uint8_t* q = w.q + 16 * g + i;  // q[4k]: the group's value 4k + i
      group[4 * j + i] = uint8_t((q[0] & 15) | (q[4] & 15) << 4);
      group[64 + 4 * j + i] = uint8_t((q[8] & 15) | (q[12] & 15) << 4);
      group[128 + 4 * j + i] = uint8_t(q[0] >> 4 | (q[4] >> 4) << 2 | (q[8] >> 4) << 4 | (q[12] >> 4) << 6);
    }
  }
}

}  // namespace

namespace {

// Block b of 16 MXFP4 rows to one MXFP4_R16 block: the E8M0 bytes side by side, the codes moved
// as they are (the inverse of unpack_32_r16).
void pack_mxfp4_r16(const uint8_t* rows, int64_t row_bytes, int64_t b, uint8_t* out) {
  std::memset(out, 0, size_t(kGroupRows) * 17);
  for (int j = 0; j < kGroupRows; ++j) {
    const uint8_t* block = rows + j * row_bytes + b * 17;
    out[j] = block[0];
    for (int v = 0; v < 32; ++v) {
      const uint8_t code = v < 16 ? block[1 + v] & 15 : block[1 + v - 16] >> 4;
      const int h = v / 16, c = (v % 16) / 4, i = v % 4;
      out[16 + 64 * c + 4 * j + i] |= uint8_t(code << (4 * h));
    }
  }
}

// Block b of 16 Q4_0 / Q5_0 / Q8_0 rows to one *_R16 block (the inverse of unpack_32_r16).
void pack_rows16_32(int qtype, const uint8_t* rows, int64_t row_bytes, int64_t b, uint8_t* out) {
  if (qtype == MXFP4) return pack_mxfp4_r16(rows, row_bytes, b, out);
  const int block_bytes = q32_block_bytes(qtype), offset = q32_offset(qtype);
  std::memset(out, 0, size_t(kGroupRows) * block_bytes);
  for (int j = 0; j < kGroupRows; ++j) {
    const uint8_t* block = rows + j * row_bytes + b * block_bytes;
    int8_t q[32];
    float d;
    unpack_32(qtype, block, q, &d);
    std::memcpy(out + 2 * j, block, 2);  // d, as the file's f16
    for (int v = 0; v < 32; ++v) {
      const uint8_t u = uint8_t(q[v] + offset);
      if (qtype == Q8_0) {
        out[32 + 64 * (v / 4) + 4 * j + v % 4] = u;
        continue;
      }
      const int h = v / 16, c = (v % 16) / 4, i = v % 4;
      out[32 + 64 * c + 4 * j + i] |= uint8_t((u & 15) << (4 * h));
      if (qtype == Q5_0 && (u & 16)) out[288 + 8 * (2 * c + h) + (4 * j + i) / 8] |= uint8_t(1 << ((4 * j + i) % 8));
    }
  }
}

}  // namespace

void pack_rows16(int qtype, const uint8_t* rows, int64_t row_bytes, int64_t b, uint8_t* out) {
  if (qtype == Q4_0 || qtype == Q5_0 || qtype == Q8_0 || qtype == MXFP4) {
    return pack_rows16_32(qtype, rows, row_bytes, b, out);
  }
  const int block_bytes = qtype == Q4_K ? 144 : 210;
  for (int j = 0; j < kGroupRows; ++j) {
    const uint8_t* block = rows + j * row_bytes + b * block_bytes;
    KBlock w;
    unpack_k(qtype, block, &w);
    if (qtype == Q4_K) pack_q4_k_r16_column(block, w, j, out);
    else pack_q6_k_r16_column(block, w, j, out);
  }
}

void dequantize_rows16_row(int qtype, const uint8_t* weights, int64_t row_bytes, int64_t n_total, int64_t n,
                           float* out) {
  const bool full_group = n < n_total / kGroupRows * kGroupRows;
  if (is_rows16_32(qtype)) {
    Format format;
    format_of(qtype, &format);
    const uint8_t* group = weights + n / kGroupRows * kGroupRows * row_bytes;
    for (int64_t b = 0; b < row_bytes / format.block_bytes; ++b) {
      if (!full_group) {
        dequantize_block(rows16_tail(qtype), weights + n * row_bytes + b * format.block_bytes, out + 32 * b);
        continue;
      }
      dequantize_32_r16(qtype, group + b * kGroupRows * format.block_bytes, int(n % kGroupRows), out + 32 * b);
    }
    return;
  }
  for (int64_t b = 0; b < row_bytes / (qtype == Q4_K_R16 ? 148 : 210); ++b) {
    KBlock w;
    unpack_rows16(qtype, weights, row_bytes, full_group, n, b, &w);
    for (int i = 0; i < 256; ++i) {
      out[256 * b + i] = w.d * float(w.scale[i / 16] * (int32_t(w.q[i]) - w.offset)) - w.dmin * float(w.min[i / 16]);
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
  float* d_out = reinterpret_cast<float*>(row + layout.d_offset);
  float* dsums16 = reinterpret_cast<float*>(row + layout.dsums16_offset);
  float* dsums32 = reinterpret_cast<float*>(row + layout.dsums32_offset);
  for (int64_t g = 0; g < layout.k / 16; ++g) {
    const float* xg = x + 16 * g;
    float amax = 0.0f;
    for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(xg[i]));
    const float d = amax / 127.0f;
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < 16; ++i) {
      q[16 * g + i] = int8_t(std::clamp(round_nearest(xg[i] * inverse), -127, 127));
      sum += q[16 * g + i];
      if (residual != nullptr) residual[16 * g + i] = xg[i] - d * float(q[16 * g + i]);
    }
    for (int i = 0; i < 4; ++i) d_out[4 * g + i] = d;
    dsums16[g] = d * float(sum);
    if (g % 2 == 1) dsums32[g / 2] = dsums16[g - 1] + dsums16[g];
  }
  if (!layout.k_quant || layout.q_order == kNatural) return;
  for (int64_t b = 0; b < layout.k / 256; ++b) {  // q and d to the variant's order
    int8_t* qb = q + 256 * b;
    float* db = d_out + 64 * b;
    if (layout.q_order == kNibbleHalves) reorder_nibble_halves(qb, db);
    if (layout.q_order == kSubblockLanes) reorder_subblock_lanes(qb, db);
  }
}

Variant scalar_variant() {
  return {"scalar",     tile_32<Q4_0>, tile_32<Q5_0>, tile_32<Q8_0>, tile_32<MXFP4>,
          k_tile<Q4_K>, k_tile<Q5_K>,   k_tile<Q6_K>, k_tile<Q4_K_X>,
          k_tile<Q4_K_R16>, k_tile<Q6_K_R16>,
          tile_32<Q4_0_R16>, tile_32<Q5_0_R16>, tile_32<Q8_0_R16>, tile_32<MXFP4_R16>,
          kNatural,     kNatural,       dequantize_row_impl, dequantize_group_impl};
}

}  // namespace specserve::gguf
