// Run-time CPU features the kernels dispatch on (isa.cpp).
#pragma once

namespace specserve {

// The CPU has AMX-BF16 and this process may use the tile registers (asked of the OS once).
bool amx_bf16_ready();

}  // namespace specserve
