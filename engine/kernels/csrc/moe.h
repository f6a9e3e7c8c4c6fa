// A mixture-of-experts MLP's routed experts on GGUF blocks (moe.cpp), for the op Python calls
// and for the native layer stack (layers.cpp), which therefore compute the same bits.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace specserve::moe {

// Every expert a gated SiLU MLP (Qwen3-MoE's): gate_up [2I, bytes] then down [H, bytes], each one
// GGUF matrix in its packed type, one type for all experts' gate_up and one for their down.
struct Experts {
  std::vector<at::Tensor> gate_up, down;  // [experts] each
  int64_t gate_up_qtype = 0, down_qtype = 0;
};

// -> [T, H] in weights' dtype: for each row, the sum over its k experts (in increasing id) of
// the expert's output rounded to that dtype times its weight, as engine/model/moe.py adds them.
at::Tensor forward(const Experts& experts,
                   const at::Tensor& x,         // [T, H] float32: the model dtype's values
                   const at::Tensor& ids,       // [T, k] int64: each row's experts
                   const at::Tensor& weights);  // [T, k] in the model dtype (float32, bfloat16)

// -> [T, E] in weight's dtype: logits[t, e] = x_t . W_e, x rounded to that dtype first (as
// `x.to(dtype)`), the products summed in float32 over 16 lanes then a fixed tree, rounded once.
// Each row alone, the same bits in every ISA variant ("auto", "scalar", "avx2", "avx512").
at::Tensor router_logits(const at::Tensor& x,       // [T, H] float32
                         const at::Tensor& weight,  // [E, H] float32 or bfloat16
                         const std::string& isa = "auto");

}  // namespace specserve::moe
