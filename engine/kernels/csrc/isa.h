// The one truth about the CPU the kernels run on (isa.cpp): each kernel family dispatches on these
// tiers, never on its own reading of the feature bits, so "avx2" means the same in every file.
#pragma once

#include <string>

namespace specserve::cpu {

// AVX2 with FMA and F16C (x86-64-v3's vector set): what every `avx2` variant is compiled for.
bool avx2();
// avx2() plus AVX-VNNI (int8 dot products in 256-bit registers).
bool avxvnni();
// avx2() plus AVX512 F, BW, VL and DQ (x86-64-v4's vector set): every `avx512` variant.
bool avx512();
// avx512() plus AVX512-VNNI.
bool avx512vnni();
// avx512() plus AVX512-BF16.
bool avx512bf16();
// AMX-TILE and AMX-BF16, and this process may use the tile registers (asked of the OS once).
bool amx_bf16();

// One of the tiers above by name ("avx2", "avxvnni", "avx512", "avx512vnni", "avx512bf16",
// "amxbf16"): the op Python asks; false for any other name.
bool supports(const std::string& tier);

// The vector tier of the row-wise ops (fused.cpp, gemma.cpp): "auto" the best this CPU has;
// "scalar", "avx2" or "avx512" as asked (the tests' variants), refused where the CPU lacks it.
// `op` names the caller in the error.
enum class RowIsa { kScalar, kAvx2, kAvx512 };
RowIsa pick_row_isa(const std::string& name, const char* op);

}  // namespace specserve::cpu
