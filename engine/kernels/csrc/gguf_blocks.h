// GGUF weight blocks as stored in the file, the int8 activation rows they are multiplied with,
// and the interface every ISA variant of the GEMM implements.
//
// Weight formats (one row of a matrix is a run of blocks, little-endian; w = weight value):
//   Q8_0  34 B / 32 values:  d (f16), q[32] int8                        w = d * q
//   Q5_0  22 B / 32 values:  d (f16), qh (u32: bit i = 5th bit of value i), qs[16]
//                            value i < 16 in qs[i] & 15, value i + 16 in qs[i] >> 4;  w = d * (q - 16)
//   Q4_0  18 B / 32 values:  d (f16), qs[16] as Q5_0 without qh;          w = d * (q - 8)
//   MXFP4 17 B / 32 values:  e (E8M0), qs[16] of 4-bit codes as Q4_0's;     w = 2^(e - 128) * v[q]
//                            (v = kMxfp4Values, doubled E2M1; more below)
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
//                            then holds 4 values of every group of 16 (lane i: group i),
//                            so a block's four `vpdpbusd` accumulate in one register, lane i holding group i's sum.
//
// Row-interleaved layouts (load-time too, for the SIMD variants): the SIMD lanes run across 16
// output columns instead of along K, so one `vpdpbusd` multiplies 4 consecutive K values of 16
// weight rows (64 bytes, int32 lane j = column j) by one broadcast group of 4 activations, and
// every per-block cost (scales, conversion, float multiply-add) is paid once per 16 columns.
// Rows 16G..16G+15 (a group) are stored together: the group's 16 * row_bytes bytes are its
// super-blocks b = 0, 1, ... one after the other, each the 16 columns' block b interleaved as
// below (j = column 0..15, i = 0..3). The last N % 16 rows (a partial group) stay in the
// per-row form named as their tail, so the tensor is still [N, row_bytes].
//   Q4_K_R16 2368 B (16 x 148) per super-block, tail rows as Q4_K_X:
//     [0, 32)      d[j] (f16)             [32, 64)   dmin[j] (f16)
//     [64, 192)    sc: byte 16s + j = sub-block s's 6-bit scale of column j, s = 0..7
//     [192, 320)   m: byte 32p + 2j + t = min of sub-block 2p + t of column j
//     [320, 2368)  qs: byte 256s + 64c + 4j + i: low nibble = value 32s + 4c + i,
//                  high nibble = value 32s + 16 + 4c + i of column j (c = 0..3)
//   Q6_K_R16 3360 B (16 x 210) per super-block, tail rows as Q6_K:
//     [0, 32)      d[j] (f16)
//     [32, 288)    sc: byte 32p + 2j + t = int8 scale of group 2p + t (16 values) of column j
//     [288, 3360)  group g = 0..15 at 288 + 192g: ql at +0, +64 (c = 0, 1): byte 64c + 4j + i
//                  has value 16g + 8c + i in its low and 16g + 8c + 4 + i in its high nibble;
//                  qh at +128: byte 4j + i has bits 2k, 2k + 1 = bits 4, 5 of value 16g + 4k + i
//   Q4_0_R16 288 B (16 x 18), Q5_0_R16 352 B (16 x 22), Q8_0_R16 544 B (16 x 34) per block of 32
//   values, tail rows as Q4_0 / Q5_0 / Q8_0:
//     [0, 32)      d[j] (f16)
//     Q4_0, Q5_0:  [32, 288) qs: byte 64c + 4j + i: low nibble = value 4c + i, high nibble = value
//                  16 + 4c + i of column j (c = 0..3); Q5_0 then [288, 352): 8 little-endian u64
//                  masks, mask 2c + h bit 4j + i = the 5th bit of value 16h + 4c + i of column j
//     Q8_0:        [32, 544) qs: byte 64t + 4j + i = value 4t + i of column j plus 128 (t = 0..7)
//   MXFP4_R16 272 B (16 x 17) per block of 32 values, tail rows as MXFP4:
//     [0, 16)      e[j] (E8M0)
//     [16, 272)    codes: byte 64c + 4j + i: low nibble = code of value 4c + i, high nibble = code of
//                  value 16 + 4c + i of column j (c = 0..3), the file's 4-bit codes as they were
// The values are unsigned (0..15, 0..31, 0..63, 0..255: Q4_0's -8, Q5_0's -16, Q6_K's -32 and
// Q8_0's -128 are applied with the activation sums), which is the operand order `vpdpbusd` takes.
// MXFP4's codes become unsigned at unpacking: one byte shuffle (`vpshufb`) of the nibbles through
// kMxfp4Unsigned gives 12 + the code's value, 0..24, and its -12 comes off as Q4_0's -8 does.
//
// MXFP4 (GGML type 39, gpt-oss's experts; the OCP microscaling format): 17 B per 32 values, one
// E8M0 byte e, then 16 bytes of 4-bit E2M1 codes (byte i: value i in its low nibble, value
// 16 + i in its high one). A code is a sign bit and a 3-bit magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6;
// ggml stores these doubled (kMxfp4Values: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives) and
// halves the scale instead: w = 2^(e - 128) * kMxfp4Values[code] (ggml_e8m0_to_fp32_half). Every
// weight is thus a small integer times a power of two, exact in float32 and in int8.
//
// Activations: each row is rounded on its own (so a row's result never depends on its batch),
// per group of 16 values whatever the weight format: d = max|x| / 127 and q = nearbyint(x / d) in
// -127..127. Groups of 16 match Q6_K's and split Q4_K's sub-blocks in two; they keep outlier
// channels from flattening their neighbours (the bundled 1.5B, 2,008 positions: 98.5% greedy
// top-1 agreement with its float32 weights and +0.4% perplexity, against 97.0% / +4.3% for one
// scale per 256 values, at the same integer work). A row is stored as
//   [q: K int8, in the variant's QOrder]
//   [d: K/4 float: for each 4 bytes of q in their stored order, the scale of their group, so a
//    SIMD lane of 4 products loads its own scale]
//   [dsums16: K/16 float, d * (sum of q) per group of 16 (Q6_K's -32);
//    dsums32: K/32 float, the same per 32 values (the Q4_K / Q5_K mins, the 32-value formats'
//    offsets in the *_R16 layouts)]; see ActLayout.
// Every integer product of a weight block and an activation block is exact in int32; variants
// differ only in the order their float accumulation adds the blocks' products.
//
// Header-only helpers are `static inline` on purpose: the SIMD files are compiled for other
// targets, and a shared inline symbol could let the linker pick an AVX copy for baseline code.
#pragma once

#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace specserve::gguf {

// GGML's type ids, the numbers the file and gguf-py use.
enum QType : int { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q4_K_X = 1012,
             MXFP4 = 39, Q4_K_R16 = 1013, Q6_K_R16 = 1014, Q4_0_R16 = 1015, Q5_0_R16 = 1016,
             Q8_0_R16 = 1017, MXFP4_R16 = 1018 };

struct Format {
  int block_values;  // weights per block
  int block_bytes;
};

static inline bool format_of(int qtype, Format* out) {
  switch (qtype) {
    case Q4_0: *out = {32, 18}; return true;
    case Q5_0: *out = {32, 22}; return true;
    case Q8_0: *out = {32, 34}; return true;
    case MXFP4: *out = {32, 17}; return true;
    case Q4_K: *out = {256, 144}; return true;
    case Q5_K: *out = {256, 176}; return true;
    case Q6_K: *out = {256, 210}; return true;
    case Q4_K_X: *out = {256, 148}; return true;
    case Q4_K_R16: *out = {256, 148}; return true;
    case Q6_K_R16: *out = {256, 210}; return true;
    case Q4_0_R16: *out = {32, 18}; return true;
    case Q5_0_R16: *out = {32, 22}; return true;
    case Q8_0_R16: *out = {32, 34}; return true;
    case MXFP4_R16: *out = {32, 17}; return true;
    default: return false;
  }
}

constexpr int kGroupRows = 16;  // weight rows interleaved by the *_R16 layouts

// The kernels stream their weights once a step, far more than the caches hold. The hardware
// prefetchers stop at every 4 KiB page, and a software prefetch into L1 (T0) holds one of the
// core's few line-fill buffers until its line lands, so a stream asked for two blocks (~5 KiB)
// ahead into L1 read 17.8 GB/s where a sum reduction reads 27.4 on this host. Asked into L2 (T1)
// kPrefetchBytes ahead: 23-24 GB/s (the bundled target's 127 matrices at one row, 55.9 -> 42-43 ms,
// docs/KERNELS.md "Prefetching into L2").
constexpr int kPrefetchBytes = 16 * 1024;

// Step i of n over a block of `bytes` at `block`: ask L2 for the matching share of the bytes
// kPrefetchBytes ahead (past a group's end, the next group's: groups are stored one after another).
static inline void prefetch_ahead(const uint8_t* block, int bytes, int i, int n) {
  const int lines = (bytes + 63) / 64, per_step = (lines + n - 1) / n;
  const char* ahead = reinterpret_cast<const char*>(block) + kPrefetchBytes;
  for (int l = i * per_step; l < std::min(lines, (i + 1) * per_step); ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
}

static constexpr bool is_rows16_32(int qtype) {
  return qtype == Q4_0_R16 || qtype == Q5_0_R16 || qtype == Q8_0_R16 || qtype == MXFP4_R16;
}

static constexpr bool is_rows16(int qtype) { return qtype == Q4_K_R16 || qtype == Q6_K_R16 || is_rows16_32(qtype); }

static inline bool is_k_quant(int qtype) {
  return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K || qtype == Q4_K_X || is_rows16(qtype);
}

// The form of a row-interleaved type's last N % 16 rows.
static constexpr int rows16_tail(int qtype) {
  switch (qtype) {
    case Q4_K_R16: return Q4_K_X;
    case Q6_K_R16: return Q6_K;
    case Q4_0_R16: return Q4_0;
    case Q5_0_R16: return Q5_0;
    case MXFP4_R16: return MXFP4;
    default: return Q8_0;
  }
}

// The row-interleaved type of a file type, or 0 where it has none.
static inline int rows16_of(int qtype) {
  switch (qtype) {
    case Q4_K: return Q4_K_R16;
    case Q6_K: return Q6_K_R16;
    case Q4_0: return Q4_0_R16;
    case Q5_0: return Q5_0_R16;
    case Q8_0: return Q8_0_R16;
    case MXFP4: return MXFP4_R16;
    default: return 0;
  }
}

// What a 32-value format's unsigned values are offset by (w = d * (q - offset)).
static constexpr int q32_offset(int qtype) {
  return qtype == Q4_0 || qtype == Q4_0_R16   ? 8
         : qtype == Q5_0 || qtype == Q5_0_R16 ? 16
         : qtype == MXFP4 || qtype == MXFP4_R16 ? 12
                                                : 128;
}

// Bytes of one block of a 32-value file format.
static constexpr int q32_block_bytes(int qtype) {
  return qtype == Q8_0 ? 34 : qtype == Q5_0 ? 22 : qtype == MXFP4 ? 17 : 18;
}

// Where a *_R16 block's values start: after its 16 columns' scales (f16, or MXFP4's E8M0 bytes).
static constexpr int r16_values_at(int qtype) { return qtype == MXFP4_R16 ? 16 : 32; }

// MXFP4's code -> value (doubled E2M1, as ggml and gguf-py hold it), and 12 + that value.
alignas(16) static constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
alignas(16) static constexpr uint8_t kMxfp4Unsigned[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                                           12, 11, 10, 9,  8,  6,  4,  0};

// E8M0 e to float, halved: 2^(e - 128) (ggml_e8m0_to_fp32_half; e = 0, 1 give subnormals).
static inline float e8m0_half_to_float(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t(0x00200000) << e : uint32_t(e - 1) << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// Q4_K_X: the super-block value that zmm k (0..3) holds at byte p (0..63): lane p / 4 belongs
// to group of 16 p / 4 (sub-block p / 8), and the four zmm split each group's 16 values 4 apiece.
static inline int value_in_lanes(int k, int p) { return 16 * (p / 4) + 4 * k + p % 4; }

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

// Column j of one Q4_0_R16 / Q5_0_R16 / Q8_0_R16 / MXFP4_R16 block: its 32 values unsigned, and d.
static inline void unpack_32_r16(int qtype, const uint8_t* block, int j, uint8_t q[32], float* d) {
  if (qtype == MXFP4_R16) {
    *d = e8m0_half_to_float(block[j]);
    for (int c = 0; c < 4; ++c) {
      for (int i = 0; i < 4; ++i) {
        const uint8_t byte = block[16 + 64 * c + 4 * j + i];
        q[4 * c + i] = kMxfp4Unsigned[byte & 15];
        q[16 + 4 * c + i] = kMxfp4Unsigned[byte >> 4];
      }
    }
    return;
  }
  *d = half_to_float(block + 2 * j);
  if (qtype == Q8_0_R16) {
    for (int t = 0; t < 8; ++t) std::memcpy(q + 4 * t, block + 32 + 64 * t + 4 * j, 4);
    return;
  }
  for (int c = 0; c < 4; ++c) {
    for (int i = 0; i < 4; ++i) {
      const uint8_t byte = block[32 + 64 * c + 4 * j + i];
      q[4 * c + i] = byte & 15;
      q[16 + 4 * c + i] = byte >> 4;
    }
  }
  if (qtype != Q5_0_R16) return;
  for (int m = 0; m < 8; ++m) {
    uint64_t mask;
    std::memcpy(&mask, block + 288 + 8 * m, 8);
    const int c = m / 2, h = m % 2;
    for (int i = 0; i < 4; ++i) q[16 * h + 4 * c + i] |= uint8_t(((mask >> (4 * j + i)) & 1) << 4);
  }
}

// Column j of one 32-value *_R16 block to its 32 floats, d * (q - offset).
static inline void dequantize_32_r16(int qtype, const uint8_t* block, int j, float out[32]) {
  uint8_t q[32];
  float d;
  unpack_32_r16(qtype, block, j, q, &d);
  for (int i = 0; i < 32; ++i) out[i] = d * float(int(q[i]) - q32_offset(qtype));
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
  const int8_t* q;        // [K]
  const float* d;         // [K / 4]: the group's scale for each 4 values of q (in q's order)
  const float* dsums16;   // [K / 16]: d * (sum of q) per 16 values
  const float* dsums32;   // [K / 32]: d * (sum of q) per 32 values
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
  int64_t d_offset, dsums16_offset, dsums32_offset, row_bytes;  // bytes

  ActLayout(int64_t k_, bool k_quant_, QOrder order) : k(k_), k_quant(k_quant_), q_order(order) {
    d_offset = k;
    dsums16_offset = d_offset + k;  // K / 4 floats
    dsums32_offset = dsums16_offset + k / 16 * 4;
    const int64_t end = dsums32_offset + k / 32 * 4;
    row_bytes = (end + 63) / 64 * 64;  // rows start 64-byte aligned
  }

  ActRow row(const uint8_t* base, int64_t r) const {
    const uint8_t* p = base + r * row_bytes;
    return {reinterpret_cast<const int8_t*>(p), reinterpret_cast<const float*>(p + d_offset),
            reinterpret_cast<const float*>(p + dsums16_offset),
            reinterpret_cast<const float*>(p + dsums32_offset)};
  }
};

// One tile of the product: out[r * out_stride + n] = row r of the activations . weight row n,
// for n in [n_begin, n_end) and r < rows (1 to kMaxRows, or to kMaxRows16 for the *_R16 types).
// For the *_R16 types a tile is one group: n_begin a multiple of 16, and n_end = n_begin + 16
// except for the tail group. Each weight block is unpacked once
// and multiplied with every row; a row's result is computed the same way whatever `rows` is.
constexpr int kMaxRows = 8;
// The 16-row layouts take up to 16 rows a pass: AVX512 holds their 16 accumulators in zmm, so
// the weights are unpacked once for a whole verify of 16 (narrower variants split the pass).
constexpr int kMaxRows16 = 16;

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
  TileKernel q4_0, q5_0, q8_0, mxfp4, q4_k, q5_k, q6_k, q4_k_x;
  TileKernel q4_k_r16, q6_k_r16;  // full groups only: the op sends a tail group to the reference
  TileKernel q4_0_r16, q5_0_r16, q8_0_r16, mxfp4_r16;
  QOrder q4_k_order, q4_k_x_order;  // how its Q4_K / Q5_K and Q4_K_X kernels want the activations
  void (*dequantize_row)(int qtype, const uint8_t* row, int64_t blocks, float* out);
  // a full group of 16 rows of a *_R16 type to floats [16, 256 * blocks]
  void (*dequantize_group)(int qtype, const uint8_t* group, int64_t blocks, float* out);

  TileKernel for_type(int qtype) const {
    switch (qtype) {
      case Q4_0: return q4_0;
      case Q5_0: return q5_0;
      case Q8_0: return q8_0;
      case MXFP4: return mxfp4;
      case Q4_K: return q4_k;
      case Q5_K: return q5_k;
      case Q6_K: return q6_k;
      case Q4_K_X: return q4_k_x;
      case Q4_K_R16: return q4_k_r16;
      case Q6_K_R16: return q6_k_r16;
      case Q4_0_R16: return q4_0_r16;
      case Q5_0_R16: return q5_0_r16;
      case Q8_0_R16: return q8_0_r16;
      case MXFP4_R16: return mxfp4_r16;
      default: return nullptr;
    }
  }
};

// Defined in gguf_scalar.cpp (portable C++), gguf_avx2.cpp, gguf_avxvnni.cpp and gguf_avx512.cpp.
Variant scalar_variant();
Variant avx2_variant();
Variant avxvnni_variant();
Variant avx512_variant();

// The reference's own pieces, shared with the op: one block to floats, and one activation row
// rounded into `row` (ActLayout::row_bytes bytes).
void dequantize_block(int qtype, const uint8_t* block, float* out);
// `residual` (optional, [K]): what the rounding left, x - d * q, for a second pass.
void quantize_row(const float* x, const ActLayout& layout, uint8_t* row, float* residual = nullptr);
// One Q4_K block (144 B) to Q4_K_X (148 B).
void pack_q4_k_x(const uint8_t* block, uint8_t* out);
// Block b of 16 Q4_K, Q6_K, Q4_0, Q5_0, Q8_0 or MXFP4 rows (`rows` points at the first, rows
// `row_bytes` apart) to one *_R16 block.
void pack_rows16(int qtype, const uint8_t* rows, int64_t row_bytes, int64_t b, uint8_t* out);
// Weight row n (of n_total) of a *_R16 matrix to floats.
void dequantize_rows16_row(int qtype, const uint8_t* weights, int64_t row_bytes, int64_t n_total,
                           int64_t n, float* out);

}  // namespace specserve::gguf
