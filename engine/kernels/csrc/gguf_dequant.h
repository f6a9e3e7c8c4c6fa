// Dequantization of whole rows, written as plain loops that the compiler vectorizes: each ISA's
// file includes this after its target pragma, so every variant gets its own vector width (the
// functions are static: one private copy per file, never shared across targets). Q4_K and Q6_K
// (the bulk of a Q4_K_M file) have their own loops; the other formats use the reference.
#pragma once

#include "gguf_blocks.h"

namespace specserve::gguf {
namespace {

void dequantize_q4_k_row(const uint8_t* row, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b, row += 144, out += 256) {
    const float d = half_to_float(row), dmin = half_to_float(row + 2);
    uint8_t scales_mins[16];
    k_scales_mins(row + 4, scales_mins);
    const uint8_t* qs = row + 16;
    for (int j = 0; j < 4; ++j) {
      const float scale_low = d * scales_mins[2 * j], min_low = dmin * scales_mins[8 + 2 * j];
      const float scale_high = d * scales_mins[2 * j + 1], min_high = dmin * scales_mins[9 + 2 * j];
      for (int l = 0; l < 32; ++l) out[64 * j + l] = scale_low * float(qs[32 * j + l] & 15) - min_low;
      for (int l = 0; l < 32; ++l) out[64 * j + 32 + l] = scale_high * float(qs[32 * j + l] >> 4) - min_high;
    }
  }
}

void dequantize_q6_k_row(const uint8_t* row, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b, row += 210, out += 256) {
    const float d = half_to_float(row + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = row + 64 * h;
      const uint8_t* qh = row + 128 + 32 * h;
      float* o = out + 128 * h;
      for (int part = 0; part < 2; ++part) {  // l in [16 part, 16 part + 16): one scale each
        const int g = 8 * h + part;
        const float s0 = d * sc[g], s1 = d * sc[g + 2], s2 = d * sc[g + 4], s3 = d * sc[g + 6];
        for (int l = 16 * part; l < 16 * part + 16; ++l) {
          o[l] = s0 * float(((ql[l] & 15) | (qh[l] & 3) << 4) - 32);
          o[l + 32] = s1 * float(((ql[l + 32] & 15) | (qh[l] >> 2 & 3) << 4) - 32);
          o[l + 64] = s2 * float(((ql[l] >> 4) | (qh[l] >> 4 & 3) << 4) - 32);
          o[l + 96] = s3 * float(((ql[l + 32] >> 4) | (qh[l] >> 6) << 4) - 32);
        }
      }
    }
  }
}

// Super-block b of a full group of 16 Q4_K_R16 rows (gguf_blocks.h) to floats: row j's values
// go to out[j * k + 256 b ...]. The same products as dequantize_q4_k_row, so the same floats.
// Each 64-byte run (16 columns x 4 values) is converted whole into a buffer, where the loop is
// contiguous and vectorizes, and then copied out 4 floats per row.
void dequantize_q4_k_r16_block(const uint8_t* block, int64_t b, int64_t k, float* out) {
  float d[kGroupRows], dmin[kGroupRows];
  for (int j = 0; j < kGroupRows; ++j) d[j] = half_to_float(block + 2 * j), dmin[j] = half_to_float(block + 32 + 2 * j);
  for (int s = 0; s < 8; ++s) {
    float scale[64], min[64];  // per byte of a run: its column's
    for (int p = 0; p < 64; ++p) {
      scale[p] = d[p / 4] * block[64 + 16 * s + p / 4];
      min[p] = dmin[p / 4] * block[192 + 32 * (s / 2) + 2 * (p / 4) + s % 2];
    }
    for (int c = 0; c < 4; ++c) {
      const uint8_t* run = block + 320 + 256 * s + 64 * c;
      float low[64], high[64];
      for (int p = 0; p < 64; ++p) {
        low[p] = scale[p] * float(run[p] & 15) - min[p];
        high[p] = scale[p] * float(run[p] >> 4) - min[p];
      }
      for (int j = 0; j < kGroupRows; ++j) {
        std::memcpy(out + j * k + 256 * b + 32 * s + 4 * c, low + 4 * j, 16);
        std::memcpy(out + j * k + 256 * b + 32 * s + 16 + 4 * c, high + 4 * j, 16);
      }
    }
  }
}

// The same for Q6_K_R16, with dequantize_q6_k_row's products.
void dequantize_q6_k_r16_block(const uint8_t* block, int64_t b, int64_t k, float* out) {
  float d[kGroupRows];
  for (int j = 0; j < kGroupRows; ++j) d[j] = half_to_float(block + 2 * j);
  for (int g = 0; g < 16; ++g) {
    const uint8_t* values = block + 288 + 192 * g;
    float w[4][64];  // w[k][p]: value 16g + 4k + p % 4 of column p / 4
    for (int p = 0; p < 64; ++p) {
      const float scale = d[p / 4] * int8_t(block[32 + 32 * (g / 2) + 2 * (p / 4) + g % 2]);
      const uint8_t low0 = values[p], low1 = values[64 + p], high = values[128 + p];
      w[0][p] = scale * float(((low0 & 15) | (high & 3) << 4) - 32);
      w[1][p] = scale * float(((low0 >> 4) | (high >> 2 & 3) << 4) - 32);
      w[2][p] = scale * float(((low1 & 15) | (high >> 4 & 3) << 4) - 32);
      w[3][p] = scale * float(((low1 >> 4) | (high >> 6) << 4) - 32);
    }
    for (int j = 0; j < kGroupRows; ++j) {
      for (int q = 0; q < 4; ++q) std::memcpy(out + j * k + 256 * b + 16 * g + 4 * q, w[q] + 4 * j, 16);
    }
  }
}

// A full group of 16 *_R16 rows, `blocks` super-blocks each, to floats [16, k].
void dequantize_group_impl(int qtype, const uint8_t* group, int64_t blocks, float* out) {
  if (is_rows16_32(qtype)) {  // a block is 16 columns x 32 values
    Format format;
    format_of(qtype, &format);
    for (int64_t b = 0; b < blocks; ++b) {
      for (int j = 0; j < kGroupRows; ++j) {
        dequantize_32_r16(qtype, group + b * kGroupRows * format.block_bytes, j, out + j * 32 * blocks + 32 * b);
      }
    }
    return;
  }
  const int64_t k = 256 * blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    if (qtype == Q4_K_R16) dequantize_q4_k_r16_block(group + b * 16 * 148, b, k, out);
    else dequantize_q6_k_r16_block(group + b * 16 * 210, b, k, out);
  }
}

// One weight row of `blocks` blocks to floats.
void dequantize_row_impl(int qtype, const uint8_t* row, int64_t blocks, float* out) {
  if (qtype == Q4_K) return dequantize_q4_k_row(row, blocks, out);
  if (qtype == Q6_K) return dequantize_q6_k_row(row, blocks, out);
  Format format;
  format_of(qtype, &format);
  for (int64_t b = 0; b < blocks; ++b) {
    dequantize_block(qtype, row + b * format.block_bytes, out + b * format.block_values);
  }
}

}  // namespace
}  // namespace specserve::gguf
