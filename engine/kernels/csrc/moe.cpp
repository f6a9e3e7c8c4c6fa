// The routed experts of a mixture-of-experts MLP for a whole step in two parallel passes:
//
//   pairs    = each (row, chosen expert), grouped by expert, rows ascending in each group
//   gate_up  = x W_gate_up[e]^T for every pair    one pass over every chosen expert's tiles
//   act      = silu_mul(gate_up)                  fused.cpp's op, rounded as the model rounds
//   y        = act W_down[e]^T for every pair     the second pass
//   out[row] = sum over its experts, in increasing id, of round(round(y) * weight)
//
// What engine/model/moe.py computes with two gguf_mm calls per chosen expert (gate_up and down),
// bit for bit: x is rounded to int8 once for all experts (gguf_mm rounds the same row the same
// way each call), every product's rows go through gguf_mm's tiles (gguf_mm.h), and the sum is
// index_add_'s in the model dtype. A decode step of Qwen3-30B-A3B's shape makes 2 parallel
// passes a layer here instead of 16 calls, each with its own rounding of x, thread fork and
// output tensor. A row's result depends on that row alone (batch invariance), as in gguf_mm.
//
//   torch.classes.specserve_kernels.MoeExperts(gate_up [E], down [E], gate_up_qtype, down_qtype)
//     .forward(x [T, H] float32, ids [T, k] int64, weights [T, k]) -> [T, H] in weights' dtype
#pragma GCC optimize("fp-contract=off")  // the weighted sum rounds as torch's ops do: no FMA

#include "moe.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <utility>

#include "fused_rows.h"
#include "gguf_mm.h"
#include "isa.h"
#include "ops.h"

namespace specserve::moe {
namespace {

int64_t row_values(const at::Tensor& blocks, int64_t qtype) {
  gguf::Format format;
  TORCH_CHECK(gguf::format_of(int(qtype), &format), "moe: GGML type ", qtype, " has no native kernel");
  return blocks.size(1) / format.block_bytes * format.block_values;
}

// pairs (t * k + j) grouped by expert id, t ascending in each group
std::vector<int64_t> pairs_by_expert(const at::Tensor& ids) {
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> order(ids.numel());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [id](int64_t a, int64_t b) { return id[a] < id[b]; });
  return order;
}

// One product per run of pairs with the same expert: its matrix times those pairs' rows.
std::vector<gguf::Product> grouped(const std::vector<at::Tensor>& matrices, int64_t qtype, const int64_t* id,
                                   const std::vector<int64_t>& order, const std::vector<gguf::ActRow>& acts,
                                   float* out, int64_t width) {
  std::vector<gguf::Product> products;
  for (size_t start = 0; start < order.size();) {
    size_t end = start;
    while (end < order.size() && id[order[end]] == id[order[start]]) ++end;
    const at::Tensor& m = matrices[id[order[start]]];
    products.push_back({m.data_ptr<uint8_t>(), m.size(1), m.size(0), qtype, acts.data() + start,
                        int64_t(end - start), out + int64_t(start) * width, width});
    start = end;
  }
  return products;
}

// out[t] += round(round(y[i]) * w) over the pairs in order, in T (float or c10::BFloat16)
template <typename T>
void add_weighted(const at::Tensor& y, const std::vector<int64_t>& order, const at::Tensor& weights,
                  at::Tensor& out) {
  const int64_t h = y.size(1), k = weights.size(1);
  const float* ys = y.data_ptr<float>();
  const T* w = weights.data_ptr<T>();
  T* o = out.data_ptr<T>();
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t t = order[i] / k;
    const T weight = w[order[i]];
    for (int64_t c = 0; c < h; ++c) o[t * h + c] += T(ys[int64_t(i) * h + c]) * weight;
  }
}

}  // namespace

at::Tensor forward(const Experts& experts, const at::Tensor& x_in, const at::Tensor& ids_in,
                   const at::Tensor& weights_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "moe: x must be [T, H] float32");
  TORCH_CHECK(ids_in.dim() == 2 && ids_in.size(0) == x_in.size(0) && ids_in.scalar_type() == at::kLong,
              "moe: ids must be [T, k] int64");
  TORCH_CHECK(weights_in.sizes() == ids_in.sizes(), "moe: weights must be [T, k] as ids");
  const at::ScalarType dtype = weights_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "moe: weights in float32 or bfloat16");
  const at::Tensor x = x_in.contiguous(), ids = ids_in.contiguous(), weights = weights_in.contiguous();
  const int64_t tokens = x.size(0), hidden = x.size(1), count = int64_t(experts.gate_up.size());
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < count, "moe: expert ", id[i], " of ", count);
  at::Tensor out = at::zeros({tokens, hidden}, x.options().dtype(dtype));
  if (ids.numel() == 0) return out;
  const int64_t width = experts.gate_up[0].size(0) / 2;
  TORCH_CHECK(row_values(experts.gate_up[0], experts.gate_up_qtype) == hidden && experts.down[0].size(0) == hidden &&
                  row_values(experts.down[0], experts.down_qtype) == width,
              "moe: x has ", hidden, " values a row, the experts take ", row_values(experts.gate_up[0], experts.gate_up_qtype),
              " and give ", experts.down[0].size(0));
  const std::vector<int64_t> order = pairs_by_expert(ids);
  const int64_t k = ids.size(1), pairs = int64_t(order.size());

  const gguf::QuantizedRows xq = gguf::quantize_rows(x.data_ptr<float>(), tokens, hidden, experts.gate_up_qtype);
  std::vector<gguf::ActRow> pair_rows(pairs);
  for (int64_t i = 0; i < pairs; ++i) pair_rows[i] = xq.rows[order[i] / k];
  at::Tensor gate_up = at::empty({pairs, 2 * width}, x.options());  // [P, 2I]
  gguf::run_products(grouped(experts.gate_up, experts.gate_up_qtype, id, order, pair_rows,
                             gate_up.data_ptr<float>(), 2 * width));

  const at::Tensor act = fused::silu_mul(gate_up, dtype, at::kFloat, "auto");  // [P, I]
  const gguf::QuantizedRows aq = gguf::quantize_rows(act.data_ptr<float>(), pairs, width, experts.down_qtype);
  at::Tensor y = at::empty({pairs, hidden}, x.options());  // [P, H]
  gguf::run_products(grouped(experts.down, experts.down_qtype, id, order, aq.rows, y.data_ptr<float>(), hidden));

  if (dtype == at::kBFloat16) add_weighted<c10::BFloat16>(y, order, weights, out);
  else add_weighted<float>(y, order, weights, out);
  return out;
}

namespace {

// x . w over n values: 16 float32 lanes (lane l takes values l, l + 16, ...), then halves added
// pairwise; separate multiplies and adds (no FMA in this file), so every ISA gets the same bits.
template <typename W>
SPECSERVE_INLINE float dot_rounded(const float* x, const W* w, int64_t n) {
  float lanes[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += x[i + l] * fused::widen(w[i + l]);
  for (; i < n; ++i) lanes[i % 16] += x[i] * fused::widen(w[i]);
  for (int width = 8; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
}

struct LogitArgs {
  const float* x;  // [T, H], already rounded to W's dtype
  const void* w;   // [E, H]
  void* out;       // [T, E]
  int64_t experts, hidden;
};

template <typename W>
SPECSERVE_INLINE void logit_range(const LogitArgs& a, int64_t begin, int64_t end) {  // (t, e) pairs
  const W* w = static_cast<const W*>(a.w);
  W* out = static_cast<W*>(a.out);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t t = i / a.experts, e = i % a.experts;
    fused::store(out + i, fused::round_to<W>(dot_rounded(a.x + t * a.hidden, w + e * a.hidden, a.hidden)));
  }
}

#define SPECSERVE_LOGIT_VARIANT(NAME, TARGET) \
  template <typename W>                        \
  TARGET void logits_##NAME(const LogitArgs& a, int64_t begin, int64_t end) { logit_range<W>(a, begin, end); }
SPECSERVE_LOGIT_VARIANT(scalar, )
SPECSERVE_LOGIT_VARIANT(avx2, __attribute__((target("avx2,f16c"))))
SPECSERVE_LOGIT_VARIANT(avx512, __attribute__((target("avx512f,avx512bw"))))

}  // namespace

at::Tensor router_logits(const at::Tensor& x_in, const at::Tensor& weight_in, const std::string& isa_name) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "router_logits: x must be [T, H] float32");
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.size(1) == x_in.size(1), "router_logits: weight must be [E, H]");
  const at::ScalarType dtype = weight_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "router_logits: weight in float32 or bfloat16");
  const cpu::RowIsa isa = cpu::pick_row_isa(isa_name, "router_logits");
  const at::Tensor x = x_in.to(dtype).to(at::kFloat).contiguous();  // rounded as x.to(dtype)
  const at::Tensor weight = weight_in.contiguous();
  const int64_t tokens = x.size(0), experts = weight.size(0);
  at::Tensor out = at::empty({tokens, experts}, weight.options());
  const LogitArgs args{x.data_ptr<float>(), weight.data_ptr(), out.data_ptr(), experts, x.size(1)};
  at::parallel_for(0, tokens * experts, 16, [&](int64_t begin, int64_t end) {
    if (dtype == at::kBFloat16) {
      if (isa == cpu::RowIsa::kAvx512) return logits_avx512<c10::BFloat16>(args, begin, end);
      if (isa == cpu::RowIsa::kAvx2) return logits_avx2<c10::BFloat16>(args, begin, end);
      return logits_scalar<c10::BFloat16>(args, begin, end);
    }
    if (isa == cpu::RowIsa::kAvx512) return logits_avx512<float>(args, begin, end);
    if (isa == cpu::RowIsa::kAvx2) return logits_avx2<float>(args, begin, end);
    logits_scalar<float>(args, begin, end);
  });
  return out;
}

namespace {

class MoeExperts : public torch::CustomClassHolder {
 public:
  MoeExperts(std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, int64_t gate_up_qtype,
             int64_t down_qtype) {
    TORCH_CHECK(!gate_up.empty() && gate_up.size() == down.size(), "MoeExperts: one gate_up and one down per expert");
    for (size_t e = 0; e < gate_up.size(); ++e) {
      TORCH_CHECK(gate_up[e].dim() == 2 && gate_up[e].scalar_type() == at::kByte && down[e].dim() == 2 &&
                      down[e].scalar_type() == at::kByte,
                  "MoeExperts: blocks are 2-D uint8 tensors");
      TORCH_CHECK(gate_up[e].sizes() == gate_up[0].sizes() && down[e].sizes() == down[0].sizes(),
                  "MoeExperts: every expert of one shape");
    }
    experts_.gate_up = std::move(gate_up);
    experts_.down = std::move(down);
    experts_.gate_up_qtype = gate_up_qtype;
    experts_.down_qtype = down_qtype;
  }

  at::Tensor forward(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights) const {
    return moe::forward(experts_, x, ids, weights);
  }

 private:
  Experts experts_;
};

}  // namespace
}  // namespace specserve::moe

TORCH_LIBRARY_FRAGMENT(specserve_kernels, m) {
  m.def("router_logits(Tensor x, Tensor weight, str isa=\"auto\") -> Tensor", &specserve::moe::router_logits);
  m.class_<specserve::moe::MoeExperts>("MoeExperts")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t>())
      .def("forward", &specserve::moe::MoeExperts::forward);
}
