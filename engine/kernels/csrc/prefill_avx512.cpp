// The AVX512 half of the prefill GEMM (prefill.cpp): GGUF weight rows to bf16, compiled for
// AVX512 so that the dequantization loops of gguf_dequant.h and the ones here vectorize 16 wide.
// Runs only after prefill.cpp has seen the CPU report avx512f/bw/vl; the bf16 rounding uses
// `vcvtneps2bf16` only where the CPU also reports avx512bf16, else the same round-to-nearest-even
// in integer lanes (both give torch's `.to(torch.bfloat16)` bit for bit on finite values).
// avx512bf16 is in the target list for the intrinsic only: nothing here uses __bf16, so the
// compiler emits its instructions nowhere else, and those run only when the CPU reports them.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512bf16")
#include <immintrin.h>

#include "gguf_dequant.h"
#include "prefill.h"

namespace specserve::prefill {
namespace {

using gguf::half_to_float;

// 16 floats to bf16 at `out`, rounded to nearest even.
template <bool kNative>
void store_bf16(__m512 v, uint16_t* out) {
  __m256i packed;
  if constexpr (kNative) {
    const __m256bh rounded = _mm512_cvtneps_pbh(v);
    std::memcpy(&packed, &rounded, 32);
  } else {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd);
    packed = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
}

// Round to nearest even in integer lanes (finite inputs).
void round_bf16(const float* in, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store_bf16<false>(_mm512_loadu_ps(in + i), out + i);
  for (; i < n; ++i) out[i] = float_to_bf16(in[i]);
}

void round_bf16_native(const float* in, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    store_bf16<true>(_mm512_loadu_ps(in + i), out + i);
  }
  for (; i < n; ++i) out[i] = float_to_bf16(in[i]);
}

// Q4_K_X (gguf_blocks.h) straight to bf16. Byte p of half c holds, low nibble, value
// 16 (p / 4) + 8 c + p % 4 and, high nibble, the value 4 past it; both of group p / 4. So
// group g is [c0 low, c0 high, c1 low, c1 high] of bytes 4g..4g+3 of each half.
template <bool kNative>
void q4_k_x_row_bf16(const uint8_t* row, int64_t blocks, uint16_t* out) {
  const __m128i nibble = _mm_set1_epi8(15);
  for (int64_t b = 0; b < blocks; ++b, row += 148, out += 256) {
    const float d = half_to_float(row), dmin = half_to_float(row + 2);
    const uint8_t* qs = row + 20;
    for (int s = 0; s < 8; ++s) {
      const __m128i bytes = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * s)),
                                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 64 + 8 * s)));
      const __m128i low = _mm_and_si128(bytes, nibble), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
      // [c0 low, c0 high] of groups 2s, 2s + 1, then the same of c1
      const __m128i c0 = _mm_unpacklo_epi32(low, high), c1 = _mm_unpackhi_epi32(low, high);
      const __m512 scale = _mm512_set1_ps(d * row[4 + s]), neg_min = _mm512_set1_ps(-dmin * row[12 + s]);
      const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(c0, c1)));
      const __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi64(c0, c1)));
      store_bf16<kNative>(_mm512_fmadd_ps(scale, first, neg_min), out + 32 * s);
      store_bf16<kNative>(_mm512_fmadd_ps(scale, second, neg_min), out + 32 * s + 16);
    }
  }
}

}  // namespace

void dequantize_row_bf16_avx512(int qtype, const uint8_t* row, int64_t blocks, int64_t k, float* scratch,
                                uint16_t* out, bool native_bf16) {
  if (qtype == gguf::Q4_K_X) {
    return native_bf16 ? q4_k_x_row_bf16<true>(row, blocks, out) : q4_k_x_row_bf16<false>(row, blocks, out);
  }
  gguf::dequantize_row_impl(qtype, row, blocks, scratch);
  if (native_bf16) {
    round_bf16_native(scratch, k, out);
  } else {
    round_bf16(scratch, k, out);
  }
}

}  // namespace specserve::prefill
