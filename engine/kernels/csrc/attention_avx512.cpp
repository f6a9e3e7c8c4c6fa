// Paged attention, the AVX512 variant's table (the kernel: attention_avx512.h).
#include "attention_avx512.h"

namespace specserve::attention {

// The AVX512 kernels by head_dim / 16; null where none is compiled.
template <typename T>
RangeFn<T> avx512_for(int64_t dim) {
  switch (dim) {
    case 16: return attend<Avx512<1>, T>;
    case 32: return attend<Avx512<2>, T>;
    case 64: return attend<Avx512<4>, T>;
    case 80: return attend<Avx512<5>, T>;
    case 96: return attend<Avx512<6>, T>;
    case 128: return attend<Avx512<8>, T>;
    case 256: return attend<Avx512<16>, T>;
    default: return nullptr;
  }
}

template RangeFn<float> avx512_for<float>(int64_t);
template RangeFn<c10::BFloat16> avx512_for<c10::BFloat16>(int64_t);

}  // namespace specserve::attention
