// The AVX512 half of the prefill GEMM (prefill.cpp): GGUF weight rows to bf16, compiled for
// AVX512 so that the dequantization loops of gguf_dequant.h and the ones here vectorize 16 wide.
// Runs only after prefill.cpp has seen the CPU report avx512f/bw/vl; the bf16 rounding uses
// `vcvtneps2bf16` only where the CPU also reports avx512bf16, else the same round-to-nearest-even
// in integer lanes (both give torch's `.to(torch.bfloat16)` bit for bit on finite values).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#include <immintrin.h>

#include "gguf_dequant.h"
#include "prefill.h"

namespace specserve::prefill {
namespace {

using gguf::half_to_float;

// Q4_K_X (gguf_blocks.h): byte p of half c holds, low nibble, value 32 (p / 8) + 16 c + p % 8 and,
// high nibble, the value 8 past it; both of sub-block p / 8 (scale sc[p / 8], min m[p / 8]).
void dequantize_q4_k_x_row(const uint8_t* row, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b, row += 148, out += 256) {
    const float d = half_to_float(row), dmin = half_to_float(row + 2);
    const uint8_t* qs = row + 20;
    for (int s = 0; s < 8; ++s) {
      const float scale = d * row[4 + s], min = dmin * row[12 + s];
      for (int c = 0; c < 2; ++c) {
        const uint8_t* q = qs + 64 * c + 8 * s;
        float* o = out + 32 * s + 16 * c;
        for (int j = 0; j < 8; ++j) o[j] = scale * float(q[j] & 15) - min;
        for (int j = 0; j < 8; ++j) o[8 + j] = scale * float(q[j] >> 4) - min;
      }
    }
  }
}

// Round to nearest even in integer lanes (finite inputs).
void round_bf16(const float* in, int64_t n, uint16_t* out) {
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(in + i));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    const __m512i top = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(bias, odd)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(top));
  }
  for (; i < n; ++i) out[i] = float_to_bf16(in[i]);
}

__attribute__((target("avx512bf16"))) void round_bf16_native(const float* in, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256bh packed = _mm512_cvtneps_pbh(_mm512_loadu_ps(in + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), reinterpret_cast<const __m256i&>(packed));
  }
  for (; i < n; ++i) out[i] = float_to_bf16(in[i]);
}

}  // namespace

void dequantize_row_bf16_avx512(int qtype, const uint8_t* row, int64_t blocks, int64_t k, float* scratch,
                                uint16_t* out, bool native_bf16) {
  if (qtype == gguf::Q4_K_X) {
    dequantize_q4_k_x_row(row, blocks, scratch);
  } else {
    gguf::dequantize_row_impl(qtype, row, blocks, scratch);
  }
  if (native_bf16) {
    round_bf16_native(scratch, k, out);
  } else {
    round_bf16(scratch, k, out);
  }
}

}  // namespace specserve::prefill
