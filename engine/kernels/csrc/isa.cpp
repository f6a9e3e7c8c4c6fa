// What the CPU this process runs on offers: the kernels dispatch on it at run time (isa.h).
#include "isa.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

namespace specserve::cpu {
namespace {

// __builtin_cpu_supports takes only a literal, hence a macro; the init is idempotent.
#define SPECSERVE_HAS(feature) (__builtin_cpu_init(), __builtin_cpu_supports(feature) != 0)

// AMX-TILE and AMX-BF16 in CPUID leaf 7 (EDX bits 24 and 22), and the kernel's leave to use the
// tile registers: Linux hands them to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); a kernel that does not know the request refuses it.
bool ask_for_amx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!((edx >> 24) & 1) || !((edx >> 22) & 1)) return false;
  constexpr long kRequestPermission = 0x1023, kTileData = 18;
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

}  // namespace

bool avx2() {
  static const bool yes = SPECSERVE_HAS("avx2") && SPECSERVE_HAS("fma") && SPECSERVE_HAS("f16c");
  return yes;
}

bool avxvnni() {
  static const bool yes = avx2() && SPECSERVE_HAS("avxvnni");
  return yes;
}

bool avx512() {
  static const bool yes =
      avx2() && SPECSERVE_HAS("avx512f") && SPECSERVE_HAS("avx512bw") &&
      SPECSERVE_HAS("avx512vl") && SPECSERVE_HAS("avx512dq");
  return yes;
}

bool avx512vnni() {
  static const bool yes = avx512() && SPECSERVE_HAS("avx512vnni");
  return yes;
}

bool avx512bf16() {
  static const bool yes = avx512() && SPECSERVE_HAS("avx512bf16");
  return yes;
}

bool amx_bf16() {
  static const bool yes = ask_for_amx();
  return yes;
}

bool supports(const std::string& tier) {
  if (tier == "avx2") return avx2();
  if (tier == "avxvnni") return avxvnni();
  if (tier == "avx512") return avx512();
  if (tier == "avx512vnni") return avx512vnni();
  if (tier == "avx512bf16") return avx512bf16();
  if (tier == "amxbf16") return amx_bf16();
  return false;
}

RowIsa pick_row_isa(const std::string& name, const char* op) {
  if (name == "scalar") return RowIsa::kScalar;
  if (name == "avx2") {
    TORCH_CHECK(avx2(), op, ": this CPU has no AVX2");
    return RowIsa::kAvx2;
  }
  if (name == "avx512") {
    TORCH_CHECK(avx512(), op, ": this CPU has no AVX512F/BW");
    return RowIsa::kAvx512;
  }
  TORCH_CHECK(name == "auto", op, ": isa must be auto, scalar, avx2 or avx512");
  return avx512() ? RowIsa::kAvx512 : avx2() ? RowIsa::kAvx2 : RowIsa::kScalar;
}

}  // namespace specserve::cpu

TORCH_LIBRARY_FRAGMENT(specserve_kernels, m) {
  m.def("cpu_supports(str feature) -> bool", &specserve::cpu::supports);
}
