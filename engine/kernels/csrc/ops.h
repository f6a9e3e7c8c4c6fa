// The ops' C++ entry points, for code in this library that chains them (layers.cpp) without
// going through torch's dispatcher. Each is registered as `torch.ops.specserve_kernels.<name>`
// by the file that defines it.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace specserve {

// attention.cpp
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& start_pos,
                           const at::Tensor& query_lens, double scale, const std::string& isa_name,
                           int64_t split_tokens, int64_t window,
                           const std::optional<at::Tensor>& tree_bits = std::nullopt);

namespace gguf {  // gguf_gemm.cpp
at::Tensor gguf_mm(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                   const std::string& variant_name, int64_t passes);
}  // namespace gguf

namespace fused {  // fused.cpp
at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps, at::ScalarType out_dtype,
                   const std::string& isa);
std::tuple<at::Tensor, at::Tensor> add_rmsnorm(const at::Tensor& x, const at::Tensor& residual,
                                               const at::Tensor& weight, double eps,
                                               at::ScalarType out_dtype, const std::string& isa);
at::Tensor silu_mul(const at::Tensor& gate_up, at::ScalarType dtype, at::ScalarType out_dtype,
                    const std::string& isa);
at::Tensor rope_write_kv(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& slots, int64_t heads);
}  // namespace fused

namespace gemma {  // gemma.cpp
std::tuple<at::Tensor, at::Tensor> offset_rmsnorm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                  const at::Tensor& weight, double eps, at::ScalarType dtype,
                                                  at::ScalarType out_dtype, const std::string& isa);
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up, at::ScalarType dtype, at::ScalarType out_dtype,
                         const std::string& isa);
}  // namespace gemma

}  // namespace specserve
