// Shared between prefill.cpp (the ops, the portable path) and prefill_avx512.cpp.
#pragma once

#include <cstdint>
#include <cstring>

namespace specserve::prefill {

// float -> bf16 bits, round to nearest even (torch's rounding; inputs are finite weights).
static inline uint16_t float_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

// One weight row of `blocks` GGUF blocks (k values) to bf16 in `out`, through `scratch` (k floats).
void dequantize_row_bf16_avx512(int qtype, const uint8_t* row, int64_t blocks, int64_t k, float* scratch,
                                uint16_t* out, bool native_bf16);

}  // namespace specserve::prefill
