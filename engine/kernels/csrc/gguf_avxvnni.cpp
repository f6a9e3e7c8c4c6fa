// AVX-VNNI variant (the 256-bit `vpdpbusd` of CPUs with AVX2 but without AVX512, e.g. Alder
// Lake): the AVX2 variant, with the row-interleaved layouts' kernels summing in `vpdpbusd`.
#include <immintrin.h>

#include "gguf_blocks.h"

#pragma GCC target("avx2,fma,f16c,avxvnni")

#include "gguf_rows16_avx2.h"  // after the pragma: compiled for this target

namespace specserve::gguf {

Variant avxvnni_variant() {
  Variant v = avx2_variant();
  v.name = "avxvnni";
  v.q4_k_r16 = rows16_tile<Q4_K_R16, true>;
  v.q6_k_r16 = rows16_tile<Q6_K_R16, true>;
  v.q4_0_r16 = rows16_tile<Q4_0_R16, true>;
  v.q5_0_r16 = rows16_tile<Q5_0_R16, true>;
  v.q8_0_r16 = rows16_tile<Q8_0_R16, true>;
  v.mxfp4_r16 = rows16_tile<MXFP4_R16, true>;
  return v;
}

}  // namespace specserve::gguf
