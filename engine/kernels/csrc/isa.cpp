// What the CPU this process runs on offers: the kernels dispatch on it at run time.
#include <torch/library.h>

#include <string>

namespace specserve {

// True when the running CPU reports `feature` (a GCC feature name: "avx2", "avx512vnni", "avx512bf16"...).
bool cpu_supports(const std::string& feature) {
  __builtin_cpu_init();
  if (feature == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (feature == "avxvnni") return __builtin_cpu_supports("avxvnni");
  if (feature == "avx512f") return __builtin_cpu_supports("avx512f");
  if (feature == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (feature == "avx512vnni") return __builtin_cpu_supports("avx512vnni");
  if (feature == "avx512bf16") return __builtin_cpu_supports("avx512bf16");
  return false;
}

}  // namespace specserve

TORCH_LIBRARY_FRAGMENT(specserve_kernels, m) {
  m.def("cpu_supports(str feature) -> bool", &specserve::cpu_supports);
}
