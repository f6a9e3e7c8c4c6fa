// advise_huge_pages(t): memory.h's advice as an op, for buffers Python allocates (the KV pool).
#include <torch/library.h>

#include "memory.h"

TORCH_LIBRARY_FRAGMENT(specserve_kernels, m) {
  m.def("advise_huge_pages(Tensor t) -> ()", [](const at::Tensor& t) { specserve::advise_huge_pages(t); });
}
