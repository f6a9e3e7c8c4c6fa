// A decoder's layer stack for one decode or verify forward in a single native call:
// `torch.classes.specserve_kernels.DecoderStack`, built once per model by
// engine/model/decoder_stack.py when every linear layer is GGUF blocks on the native kernels.
//
// It computes what engine/model/decoder.py's DecoderModel.run_layers computes for a batch of
// short queries, op for op and rounding for rounding (bit-identical: tests/test_decoder_stack.py),
// calling the same entry points (ops.h) without Python or torch's dispatcher between them: about
// 150 µs a layer, a quarter of the bundled 0.5B draft's decode step. Per layer:
//
//   h, residual = add_rmsnorm(x, residual)        first layer: h = rmsnorm(x), residual = x
//   qkv = cat(gguf_mm(h) per kernel).to(dtype) + bias
//   q   = rope_write_kv(qk, v, cos, sin, caches)  this pass's K and V into their slots
//   x   = gguf_mm(paged_attention(q, caches))     o_proj, float32 (a draft tree's rows: its bits)
//   h, residual = add_rmsnorm(x, residual)
//   x   = gguf_mm(silu_mul(gguf_mm(h)))           gate_up, down, float32
//
// and after the last layer add_rmsnorm(x, residual) in the model's dtype. Qwen3's q/k norms
// (`qk_norm` layers: RMSNorm over each head in float32, rounded before the weight) come between
// qkv and rope, as torch's eager ops compute them in decoder.py. A routed layer (Qwen3-MoE) has,
// in place of gate_up and down,
//
//   weights, ids = top_k(softmax(router_logits(h, W_router), float32))   each row alone, as moe.py
//   x   = moe::forward(experts, h, ids, weights)  the chosen experts' products (moe.cpp)
//
// Gemma 3's layer (`gemma`), with gemma.cpp's ops in place of the eager ones decoder.py calls:
//
//   h, residual = offset_rmsnorm(x, residual)     input norm, x * (1 + w)
//   qkv = gguf_mm(h); qk = offset_rmsnorm(q and k heads)   q/k norms
//   q   = rope_write_kv(qk, v, its rope)          a local layer's rope (base 10,000), a global's
//   x   = gguf_mm(paged_attention(q, its tables, its window))   a local layer's window
//   x   = offset_rmsnorm(x)                       post-attention norm (sandwich)
//   h, residual = offset_rmsnorm(x, residual)     pre-feedforward norm
//   x   = offset_rmsnorm(gguf_mm(gelu_tanh_mul(gguf_mm(h))))   post-feedforward norm
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/div.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/topk.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "moe.h"
#include "ops.h"

namespace specserve {
namespace {

// y = x W^T (+ bias), W as one or more GGUF matrices whose outputs are concatenated (q, k and v
// of different formats, say).
struct Linear {
  std::vector<at::Tensor> blocks;  // per kernel: [rows, bytes per row] uint8, packed at load
  std::vector<int64_t> qtypes;
  at::Tensor bias;  // [out] in the model dtype; undefined: none

  at::Tensor operator()(const at::Tensor& x) const {  // [T, in] float32 -> [T, out] float32
    if (blocks.size() == 1) return gguf::gguf_mm(x, blocks[0], qtypes[0], "", 1);
    std::vector<at::Tensor> parts;
    for (size_t i = 0; i < blocks.size(); ++i) parts.push_back(gguf::gguf_mm(x, blocks[i], qtypes[i], "", 1));
    return at::cat(parts, -1);
  }
};

// A routed MLP: the router's weight [experts, hidden] in the model dtype and the experts.
struct Routed {
  at::Tensor router;
  int64_t top_k = 0;
  bool norm_topk_prob = false;  // the top k's probabilities rescaled to sum to 1
  moe::Experts experts;
};

// Layout flags a layer's entry starts with.
constexpr int64_t kQkNorm = 1;  // Llama's layer with Qwen3's q/k norms
constexpr int64_t kRouted = 2;  // a routed MLP in place of gate_up and down

struct Layer {
  at::Tensor input_norm, post_norm;  // [hidden] in the model dtype
  at::Tensor q_norm, k_norm;         // Gemma's, or Qwen3's (kQkNorm): [head_dim]
  at::Tensor pre_ff_norm, post_ff_norm;  // Gemma's: [hidden]
  bool sliding = false;              // Gemma's local layers: their rope, tables and window
  Linear qkv, o, gate_up, down;
  std::optional<Routed> routed;
};

// Reads the flat arguments DecoderStack is built from (decoder_stack.py `_flatten`): per layer
// its flags in `layout` (kQkNorm, kRouted), the two norms' weights (Gemma, or kQkNorm: then q_norm
// and k_norm; Gemma: then pre- and post-feedforward norms), then for each of qkv, o, gate_up and
// down its kernels' blocks and its bias if any; `layout` holds per linear the kernel count, their
// qtypes and a has-bias flag. A routed layer has in place of gate_up and down its router's weight,
// then every expert's gate_up blocks and every expert's down blocks, and in `layout` top k, the
// renormalization flag, the expert count and the gate_up and down qtypes.
class Reader {
 public:
  Reader(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& layout)
      : tensors_(tensors), layout_(layout) {}

  at::Tensor tensor() {
    TORCH_CHECK(t_ < tensors_.size(), "DecoderStack: fewer tensors than the layout names");
    return tensors_[t_++];
  }
  int64_t value() {
    TORCH_CHECK(l_ < layout_.size(), "DecoderStack: the layout ends early");
    return layout_[l_++];
  }
  Linear linear() {
    Linear out;
    const int64_t kernels = value();
    TORCH_CHECK(kernels >= 1, "DecoderStack: a linear layer needs a kernel");
    for (int64_t i = 0; i < kernels; ++i) {
      out.qtypes.push_back(value());
      out.blocks.push_back(tensor());
    }
    if (value() != 0) out.bias = tensor();
    return out;
  }
  Routed routed() {
    Routed out;
    out.router = tensor();
    out.top_k = value();
    out.norm_topk_prob = value() != 0;
    const int64_t experts = value();
    out.experts.gate_up_qtype = value();
    out.experts.down_qtype = value();
    for (int64_t e = 0; e < experts; ++e) out.experts.gate_up.push_back(tensor());
    for (int64_t e = 0; e < experts; ++e) out.experts.down.push_back(tensor());
    return out;
  }
  bool done() const { return t_ == tensors_.size() && l_ == layout_.size(); }

 private:
  const std::vector<at::Tensor>& tensors_;
  const std::vector<int64_t>& layout_;
  size_t t_ = 0, l_ = 0;
};

class DecoderStack : public torch::CustomClassHolder {
 public:
  // gemma: Gemma 3's layer; sliding: per layer 1 for a local one (Gemma), window their window
  DecoderStack(std::vector<at::Tensor> tensors, std::vector<int64_t> layout, at::Tensor final_norm,
               double eps, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, bool gemma,
               std::vector<int64_t> sliding, int64_t window)
      : final_norm_(std::move(final_norm)), eps_(eps), heads_(heads), kv_heads_(kv_heads),
        head_dim_(head_dim), scale_(scale), gemma_(gemma), window_(window) {
    Reader read(tensors, layout);
    while (!read.done()) {
      Layer layer;
      const int64_t flags = read.value();
      TORCH_CHECK(!gemma || flags == 0, "DecoderStack: q/k norms and routed MLPs on Llama's layer only");
      layer.input_norm = read.tensor();
      layer.post_norm = read.tensor();
      if (gemma || (flags & kQkNorm)) {
        layer.q_norm = read.tensor();
        layer.k_norm = read.tensor();
      }
      if (gemma) {
        layer.pre_ff_norm = read.tensor();
        layer.post_ff_norm = read.tensor();
      }
      TORCH_CHECK(sliding.empty() || layers_.size() < sliding.size(), "DecoderStack: a sliding flag per layer");
      layer.sliding = !sliding.empty() && sliding[layers_.size()] != 0;
      layer.qkv = read.linear();
      layer.o = read.linear();
      if (flags & kRouted) {
        layer.routed = read.routed();
      } else {
        layer.gate_up = read.linear();
        layer.down = read.linear();
      }
      TORCH_CHECK(!layer.o.bias.defined() && !layer.gate_up.bias.defined() && !layer.down.bias.defined(),
                  "DecoderStack: only qkv may have a bias");
      layers_.push_back(std::move(layer));
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Keep the stream entering these layers (j = num_layers: the last layer's output before the
  // final norm) in each forward, as DecoderModel.run_layers keeps an EAGLE-3 head's features:
  // entering layer j > 0 it is x + residual in the residual's dtype. Llama's layer only.
  void keep_aux(std::vector<int64_t> layers) {
    TORCH_CHECK(!gemma_ || layers.empty(), "DecoderStack: aux streams of Llama's layer only");
    for (const int64_t j : layers)
      TORCH_CHECK(j >= 0 && j <= num_layers(), "DecoderStack: aux layer ", j, " out of range");
    aux_layers_ = std::move(layers);
  }

  // [T, n * hidden]: the kept streams of the last forward, in layer order (empty: none kept).
  at::Tensor aux() const { return aux_; }

  // -> [T, hidden] in x's dtype: the final norm's output, as DecoderModel.run_layers returns.
  at::Tensor forward(const at::Tensor& embedded,            // [T, hidden]: the embedded tokens
                     const at::Tensor& cos,                 // [T, 1, head_dim]
                     const at::Tensor& sin,                 // [T, 1, head_dim]: first half negated
                     const std::vector<at::Tensor>& k_caches,  // per layer [kv_heads, blocks, block, D]
                     const std::vector<at::Tensor>& v_caches,
                     const at::Tensor& slots,         // [T] int64
                     const at::Tensor& block_tables,  // [batch, max_blocks] int64
                     const at::Tensor& start_pos,     // [batch] int64: tokens cached before
                     const at::Tensor& query_lens,    // [batch] int64: new tokens, summing to T
                     const at::Tensor& local_cos,     // the local layers' (Gemma; else cos)
                     const at::Tensor& local_sin,
                     const at::Tensor& local_tables,  // from each request's window's first block
                     const std::optional<at::Tensor>& tree_bits) {  // [T] int64: a draft tree's
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "DecoderStack: one K and one V cache per layer");
    TORCH_CHECK(!gemma_ || !tree_bits.has_value(), "DecoderStack: draft trees on Llama's layer only");
    if (gemma_) return gemma_forward(embedded, cos, sin, k_caches, v_caches, slots, block_tables, start_pos,
                                     query_lens, local_cos, local_sin, local_tables);
    const at::ScalarType dtype = embedded.scalar_type();
    const int64_t tokens = embedded.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    at::Tensor x = embedded, residual, h;
    std::vector<at::Tensor> aux;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      if (keeps(i)) aux.push_back(i == 0 ? x : at::add(x.to(residual.scalar_type()), residual));
      if (i == 0) {
        h = fused::rmsnorm(x, layer.input_norm, eps_, at::kFloat, "auto");
        residual = x;
      } else {
        std::tie(h, residual) = fused::add_rmsnorm(x, residual, layer.input_norm, eps_, at::kFloat, "auto");
      }
      at::Tensor qkv = layer.qkv(h).to(dtype);  // [T, q + 2 kv]
      if (layer.qkv.bias.defined()) qkv = at::add(qkv, layer.qkv.bias);
      at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, heads_ + kv_heads_, head_dim_});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads_, head_dim_});
      if (layer.q_norm.defined())
        qk = at::cat({head_norm(qk.narrow(1, 0, heads_), layer.q_norm), head_norm(qk.narrow(1, heads_, kv_heads_), layer.k_norm)}, 1);
      at::Tensor k_cache = k_caches[i], v_cache = v_caches[i];
      const at::Tensor q = fused::rope_write_kv(qk, v, cos, sin, k_cache, v_cache, slots, heads_);
      const at::Tensor attended = paged_attention(q, k_cache, v_cache, block_tables, start_pos, query_lens,
                                                  scale_, "auto", 256, 0, tree_bits);  // [T, heads, D]
      x = layer.o(attended.view({tokens, q_size}).to(at::kFloat).contiguous());
      std::tie(h, residual) = fused::add_rmsnorm(x, residual, layer.post_norm, eps_, at::kFloat, "auto");
      x = layer.routed ? routed_mlp(*layer.routed, h)
                       : layer.down(fused::silu_mul(layer.gate_up(h), dtype, at::kFloat, "auto"));
    }
    auto [out, stream] = fused::add_rmsnorm(x, residual, final_norm_, eps_, dtype, "auto");
    if (keeps(layers_.size())) aux.push_back(stream.to(dtype));
    aux_ = aux.empty() ? at::empty({0}) : at::cat(aux, -1);
    return out;
  }

 private:
  // Qwen3's q/k norm over each head (norms.py RMSNorm.forward: float32, rounded before the weight).
  at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight) const {  // [T, heads, D] in dtype
    const at::Tensor x32 = x.to(at::kFloat);
    const at::Tensor normed = at::mul(x32, at::rsqrt(at::add(at::mean(x32.pow(2), {-1}, true), eps_)));
    return at::mul(weight, normed.to(x.scalar_type()));
  }

  // moe.py's MoE: the router's logits by moe.cpp's kernel, their softmax in float32, the top k
  // (rescaled to sum to 1 where norm_topk_prob says) in the model dtype, then the experts.
  static at::Tensor routed_mlp(const Routed& r, const at::Tensor& h) {  // [T, H] float32
    const at::Tensor logits = moe::router_logits(h, r.router);  // [T, experts] in dtype
    auto [top, ids] = at::topk(at::softmax(logits, -1, at::kFloat), r.top_k, -1);
    if (r.norm_topk_prob) top = at::div(top, top.sum(-1, true));
    return moe::forward(r.experts, h, ids, top.to(logits.scalar_type()));  // [T, H] in dtype
  }

  // DecoderModel.run_layers of Gemma 3 (decoder.py's DecoderLayer with sandwich norms).
  at::Tensor gemma_forward(const at::Tensor& embedded, const at::Tensor& cos, const at::Tensor& sin,
                           const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                           const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& start_pos,
                           const at::Tensor& query_lens, const at::Tensor& local_cos,
                           const at::Tensor& local_sin, const at::Tensor& local_tables) {
    const at::ScalarType dtype = embedded.scalar_type();
    const int64_t tokens = embedded.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const auto norm = [&](const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& w,
                          at::ScalarType out) { return gemma::offset_rmsnorm(x, residual, w, eps_, dtype, out, "auto"); };
    at::Tensor x = embedded, residual, h;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      std::tie(h, residual) = norm(x, i == 0 ? std::nullopt : std::optional<at::Tensor>(residual), layer.input_norm,
                                   at::kFloat);
      const at::Tensor qkv = layer.qkv(h).to(dtype);  // [T, q + 2 kv]
      // each head a row (a view where the rows are evenly spaced, else a copy)
      const at::Tensor q_rows = qkv.narrow(1, 0, q_size).reshape({tokens * heads_, head_dim_});
      const at::Tensor k_rows = qkv.narrow(1, q_size, kv_size).reshape({tokens * kv_heads_, head_dim_});
      const at::Tensor qn = std::get<0>(norm(q_rows, std::nullopt, layer.q_norm, dtype));
      const at::Tensor kn = std::get<0>(norm(k_rows, std::nullopt, layer.k_norm, dtype));
      const at::Tensor qk = at::cat({qn.view({tokens, heads_, head_dim_}), kn.view({tokens, kv_heads_, head_dim_})}, 1);
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads_, head_dim_});
      at::Tensor k_cache = k_caches[i], v_cache = v_caches[i];
      const bool local = layer.sliding;
      const at::Tensor q = fused::rope_write_kv(qk, v, local ? local_cos : cos, local ? local_sin : sin, k_cache,
                                                v_cache, slots, heads_);
      const at::Tensor attended = paged_attention(q, k_cache, v_cache, local ? local_tables : block_tables, start_pos,
                                                  query_lens, scale_, "auto", 256, local ? window_ : 0);
      x = layer.o(attended.view({tokens, q_size}).to(at::kFloat).contiguous());
      x = std::get<0>(norm(x, std::nullopt, layer.post_norm, dtype));
      std::tie(h, residual) = norm(x, residual, layer.pre_ff_norm, at::kFloat);
      x = layer.down(gemma::gelu_tanh_mul(layer.gate_up(h), dtype, at::kFloat, "auto"));
      x = std::get<0>(norm(x, std::nullopt, layer.post_ff_norm, dtype));
    }
    return std::get<0>(norm(x, residual, final_norm_, dtype));
  }

  bool keeps(size_t layer) const {
    for (const int64_t j : aux_layers_)
      if (static_cast<size_t>(j) == layer) return true;
    return false;
  }

  std::vector<Layer> layers_;
  std::vector<int64_t> aux_layers_;
  at::Tensor aux_ = at::empty({0});
  at::Tensor final_norm_;
  double eps_;
  int64_t heads_, kv_heads_, head_dim_;
  double scale_;
  bool gemma_;
  int64_t window_;
};

}  // namespace
}  // namespace specserve

TORCH_LIBRARY_FRAGMENT(specserve_kernels, m) {
  m.class_<specserve::DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, at::Tensor, double, int64_t, int64_t,
                       int64_t, double, bool, std::vector<int64_t>, int64_t>())
      .def("num_layers", &specserve::DecoderStack::num_layers)
      .def("keep_aux", &specserve::DecoderStack::keep_aux)
      .def("aux", &specserve::DecoderStack::aux)
      .def("forward", &specserve::DecoderStack::forward);
}
