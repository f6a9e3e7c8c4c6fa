// What the CPU this process runs on offers: the kernels dispatch on it at run time.
#include <cpuid.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <string>

#include "isa.h"

namespace specserve {

// AMX-TILE and AMX-BF16 in CPUID leaf 7 (EDX bits 24 and 22), and the kernel's leave to use the
// tile registers: Linux hands them to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); a kernel that does not know the request refuses it.
bool amx_bf16_ready() {
  static const bool ready = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!((edx >> 24) & 1) || !((edx >> 22) & 1)) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ready;
}

// True when the running CPU reports `feature` (a GCC feature name: "avx2", "avx512vnni", "avx512bf16"...).
bool cpu_supports(const std::string& feature) {
  __builtin_cpu_init();
  if (feature == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (feature == "avxvnni") return __builtin_cpu_supports("avxvnni");
  if (feature == "avx512f") return __builtin_cpu_supports("avx512f");
  if (feature == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (feature == "avx512vnni") return __builtin_cpu_supports("avx512vnni");
  if (feature == "avx512bf16") return __builtin_cpu_supports("avx512bf16");
  if (feature == "amxbf16") return amx_bf16_ready();
  return false;
}

}  // namespace specserve

TORCH_LIBRARY_FRAGMENT(specserve_kernels, m) {
  m.def("cpu_supports(str feature) -> bool", &specserve::cpu_supports);
}
