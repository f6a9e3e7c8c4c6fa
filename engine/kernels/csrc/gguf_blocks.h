// GGUF weight blocks as stored in the file, the int8 activation rows they are multiplied with,
// and the interface every ISA variant of the GEMM implements.
//
// Weight formats (one row of a matrix is a run of blocks, little-endian; w = weight value):
//   Q8_0  34 B / 32 values:  d (f16), q[32] int8                        w = d * q
//   Q5_0  22 B / 32 values:  d (f16), qh (u32: bit i = 5th bit of value i), qs[16]
//                            value i < 16 in qs[i] & 15, value i + 16 in qs[i] >> 4;  w = d * (q - 16)
//   Q4_0  18 B / 32 values:  d (f16), qs[16] as Q5_0 without qh;          w = d * (q - 8)
//   Q4_K 144 B / 256 values: d, dmin (f16), 12 B of 6-bit scales sc[8] and mins m[8], qs[128];
//                            64-value chunk j: qs[32j + l] & 15 is value 64j + l (sub-block 2j),
//                            qs[32j + l] >> 4 is value 64j + 32 + l (sub-block 2j + 1);
//                            w = d * sc[s] * q - dmin * m[s] for s = value / 32
//   Q5_K 176 B / 256 values: d, dmin, the same 12 B, qh[32], qs[128]; as Q4_K with a 5th bit
//                            (qh[l] >> (2j)) & 1 for value 64j + l, >> (2j + 1) for 64j + 32 + l
//   Q6_K 210 B / 256 values: ql[128], qh[64], sc[16] int8, d (f16); half h, l < 32:
//                            value 128h + l       = ql[64h + l] & 15      | (qh[32h + l] & 3) << 4
//                            value 128h + 32 + l  = ql[64h + 32 + l] & 15 | (qh[32h + l] >> 2 & 3) << 4
//                            value 128h + 64 + l  = ql[64h + l] >> 4      | (qh[32h + l] >> 4 & 3) << 4
//                            value 128h + 96 + l  = ql[64h + 32 + l] >> 4 | (qh[32h + l] >> 6) << 4
//                            w = d * sc[value / 16] * (q - 32)
// Repacked at load (never stored in a file; the id is ours, past GGML's):
//   Q4_K_X 148 B / 256 values: d, dmin (f16), sc[8], m[8] (decoded), qs[128] where byte p of
//                            64-byte half c holds, in its low / high nibble, the value that zmm
//                            k = 2c / 2c + 1 wants at byte p: value_in_lanes(k, p) below. Each zmm
//                            then holds 8 values of every sub-block (lanes 2s, 2s + 1: sub-block s),
//                            so a block's four `vpdpbusd` accumulate in one register.
//
// Activations: each row is rounded on its own (so a row's result never depends on its batch):
// per block of 256 (K-quants) or 32 values, d = max|x| / 127 and q = nearbyint(x / d) in
// -127..127. A row is stored as [q: K int8][sums: K/16 int16, dsums: K/32 float (K-quants)]
// [d: one float per block, each repeated 8 times for the 32-value formats so a SIMD lane reads
// its own]; see ActLayout.
// Every integer product of a weight block and an activation block is exact in int32; variants
// differ only in the order their float accumulation adds the blocks' products.
//
// Header-only helpers are `static inline` on purpose: the SIMD files are compiled for other
// targets, and a shared inline symbol could let the linker pick an AVX copy for baseline code.
#pragma once

#include <cstdint>
#include <cstring>

namespace specserve::gguf {

// GGML's type ids, the numbers the file and gguf-py use.
enum QType : int { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q4_K_X = 1012 };

struct Format {
  int block_values;  // weights per block
  int block_bytes;
};

static inline bool format_of(int qtype, Format* out) {
  switch (qtype) {
    case Q4_0: *out = {32, 18}; return true;
    case Q5_0: *out = {32, 22}; return true;
    case Q8_0: *out = {32, 34}; return true;
    case Q4_K: *out = {256, 144}; return true;
    case Q5_K: *out = {256, 176}; return true;
    case Q6_K: *out = {256, 210}; return true;
    case Q4_K_X: *out = {256, 148}; return true;
    default: return false;
  }
}

static inline bool is_k_quant(int qtype) {
  return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K || qtype == Q4_K_X;
}

// Q4_K_X: the super-block value that zmm k (0..3) holds at byte p (0..63): lane p / 4 belongs
// to sub-block p / 8, and the four zmm split each sub-block's 32 values 8 apiece.
static inline int value_in_lanes(int k, int p) { return 32 * (p / 8) + 8 * k + 4 * ((p / 4) % 2) + p % 4; }

// IEEE half to float without F16C (the portable path and the reference use it).
static inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// Q4_K / Q5_K's 12 bytes -> 8 scales (bytes 0-7 of `out`) and 8 mins (bytes 8-15).
// Bytes 0-3 hold sc[0..3] in their low 6 bits and the top 2 bits of sc[4..7]; bytes 4-7 the same
// for the mins; bytes 8-11 the low 4 bits of sc[4..7] (low nibble) and of m[4..7] (high nibble).
static inline void k_scales_mins(const uint8_t* packed, uint8_t out[16]) {
  uint32_t a, b, c;
  std::memcpy(&a, packed, 4);
  std::memcpy(&b, packed + 4, 4);
  std::memcpy(&c, packed + 8, 4);
  const uint32_t words[4] = {
      a & 0x3F3F3F3Fu,
      (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u),
      b & 0x3F3F3F3Fu,
      ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u),
  };
  std::memcpy(out, words, 16);
}

// Where the parts of one quantized activation row lie.
struct ActRow {
  const int8_t* q;       // [K]
  const int16_t* sums;   // [K / 16], K-quants only: sums of q per 16 values
  const float* dsums;    // [K / 32], K-quants only: d * (sum of q) per 32 values, for the mins
  const float* d;        // [K / 256] (K-quants) or [K / 32 * 8] (32-value formats, repeated)
};

// `q_order` lets a variant read a K-quant super-block's activations in the order its unpacked
// weights come in (kNatural, or kNibbleHalves: the 32-value runs 0, 2, 1, 3, 4, 6, 5, 7, which
// is what the low and high nibbles of Q4_K's two 64-byte halves hold, so no shuffle is needed).
// kSubblockLanes: byte 64k + p holds value_in_lanes(k, p) (Q4_K_X).
enum QOrder { kNatural = 0, kNibbleHalves = 1, kSubblockLanes = 2 };

struct ActLayout {
  int64_t k;
  bool k_quant;
  QOrder q_order;
  int64_t sums_offset, dsums_offset, d_offset, row_bytes;  // bytes

  ActLayout(int64_t k_, bool k_quant_, QOrder order) : k(k_), k_quant(k_quant_), q_order(order) {
    sums_offset = k;
    dsums_offset = sums_offset + (k_quant ? k / 16 * 2 : 0);
    d_offset = dsums_offset + (k_quant ? k / 32 * 4 : 0);
    const int64_t d_count = k_quant ? k / 256 : k / 32 * 8;
    row_bytes = (d_offset + d_count * 4 + 63) / 64 * 64;  // rows start 64-byte aligned
  }

  ActRow row(const uint8_t* base, int64_t r) const {
    const uint8_t* p = base + r * row_bytes;
    return {reinterpret_cast<const int8_t*>(p), reinterpret_cast<const int16_t*>(p + sums_offset),
            reinterpret_cast<const float*>(p + dsums_offset), reinterpret_cast<const float*>(p + d_offset)};
  }
};

// One tile of the product: out[r * out_stride + n] = row r of the activations . weight row n,
// for n in [n_begin, n_end) and r < rows (1 to kMaxRows). Each weight block is unpacked once
// and multiplied with every row; a row's result is computed the same way whatever `rows` is.
constexpr int kMaxRows = 8;

struct TileArgs {
  const uint8_t* weights;  // [N, row_bytes]
  int64_t weight_row_bytes;
  int64_t blocks;  // per weight row
  int64_t n_begin, n_end;
  const ActRow* acts;  // [rows]
  int rows;
  float* out;
  int64_t out_stride;
};

using TileKernel = void (*)(const TileArgs&);

// The kernels of one ISA, by format; nullptr where the variant has none for that format.
struct Variant {
  const char* name;
  TileKernel q4_0, q5_0, q8_0, q4_k, q5_k, q6_k, q4_k_x;
  QOrder q4_k_order, q4_k_x_order;  // how its Q4_K / Q5_K and Q4_K_X kernels want the activations
  void (*dequantize_row)(int qtype, const uint8_t* row, int64_t blocks, float* out);

  TileKernel for_type(int qtype) const {
    switch (qtype) {
      case Q4_0: return q4_0;
      case Q5_0: return q5_0;
      case Q8_0: return q8_0;
      case Q4_K: return q4_k;
      case Q5_K: return q5_k;
      case Q6_K: return q6_k;
      case Q4_K_X: return q4_k_x;
      default: return nullptr;
    }
  }
};

// Defined in gguf_scalar.cpp (portable C++), gguf_avx2.cpp and gguf_avx512.cpp.
Variant scalar_variant();
Variant avx2_variant();
Variant avx512_variant();

// The reference's own pieces, shared with the op: one block to floats, and one activation row
// rounded into `row` (ActLayout::row_bytes bytes).
void dequantize_block(int qtype, const uint8_t* block, float* out);
// `residual` (optional, [K]): what the rounding left, x - d * q, for a second pass.
void quantize_row(const float* x, const ActLayout& layout, uint8_t* row, float* residual = nullptr);
// One Q4_K block (144 B) to Q4_K_X (148 B).
void pack_q4_k_x(const uint8_t* block, uint8_t* out);

}  // namespace specserve::gguf
