// Large buffers on 2 MB pages where the kernel allows it (transparent huge pages in "madvise" or
// "always" mode). A decode step streams every weight and the whole KV cache once; on 4 KB pages
// each 4 KB of that is a TLB miss and a page walk. The advice must come before the first write:
// pages already touched stay small until khugepaged merges them, minutes later.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <sys/mman.h>

#include <cstdint>

namespace specserve {

inline void advise_huge_pages(const at::Tensor& t) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (!t.is_cpu() || t.nbytes() < 2 * kHuge) return;
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);  // the 2 MB pages inside t
  const uintptr_t last = (begin + t.nbytes()) & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
}

// at::empty, its pages advised huge before anything touches them.
inline at::Tensor empty_huge(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  advise_huge_pages(t);
  return t;
}

}  // namespace specserve
