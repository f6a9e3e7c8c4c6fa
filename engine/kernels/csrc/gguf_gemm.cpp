// GEMM and dequantization on GGUF weight blocks as the file stores them (formats described in
// gguf_blocks.h), registered as torch ops:
//
//   gguf_mm(x [M, K] float32, blocks [N, K / values * bytes] uint8, qtype, variant, passes)
//     -> [M, N] float32
//   gguf_dequantize(blocks [N, bytes per row] uint8, qtype) -> [N, K] float32
//   gguf_variants() -> the ISA variants this CPU runs, best first ("avx512vnni", "avxvnni", "avx2",
//                      "scalar")
//   gguf_pack(blocks, qtype, variant, layout) -> (blocks in the variant's layout, their qtype)
//
// Each activation row is rounded to int8 on its own (with passes = 2, what that rounding left is
// rounded again as a row of its own and the two results summed: int8 alone costs a model with
// outlier activations ~3% perplexity, two passes ~0.4%), then the weight rows are split across
// torch's intra-op threads in tiles of 16 (starting at multiples of 16); inside a tile, rows go 8
// at a time (16 for the 16-row layouts), so every weight block is unpacked once per pass of
// activation rows and stays in cache for the next pass. A row's result
// depends on neither the other rows nor the number of threads (batch invariance).
// The variant is chosen here once, from what the CPU reports; Python chooses nothing but may
// name one (the tests compare each against the scalar reference).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "isa.h"
#include "gguf_blocks.h"
#include "gguf_mm.h"
#include "memory.h"
#include "ops.h"

namespace specserve::gguf {
namespace {

constexpr int64_t kTileColumns = 16;

// Best first; a variant's functions run only once the CPU has said it has the instructions.
const std::vector<Variant>& variants() {
  static const std::vector<Variant> all = [] {
    std::vector<Variant> out;
    if (cpu::avx512vnni()) out.push_back(avx512_variant());
    if (cpu::avxvnni()) out.push_back(avxvnni_variant());
    if (cpu::avx2()) out.push_back(avx2_variant());
    out.push_back(scalar_variant());
    return out;
  }();
  return all;
}

const Variant& variant_named(const std::string& name) {
  if (name.empty()) return variants().front();
  for (const Variant& v : variants()) {
    if (name == v.name) return v;
  }
  TORCH_CHECK(false, "gguf_mm: variant '", name, "' does not run on this CPU");
}

const char* type_name(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return "Q4_0";
    case Q5_0: return "Q5_0";
    case Q8_0: return "Q8_0";
    case MXFP4: return "MXFP4";
    case Q4_K: return "Q4_K";
    case Q5_K: return "Q5_K";
    case Q6_K: return "Q6_K";
    case Q4_K_X: return "Q4_K_X";
    case Q4_K_R16: return "Q4_K_R16";
    case Q6_K_R16: return "Q6_K_R16";
    case Q4_0_R16: return "Q4_0_R16";
    case Q5_0_R16: return "Q5_0_R16";
    case Q8_0_R16: return "Q8_0_R16";
    case MXFP4_R16: return "MXFP4_R16";
    default: return "an unsupported type";
  }
}

Format checked_format(const at::Tensor& blocks, int64_t qtype) {
  Format format;
  TORCH_CHECK(format_of(int(qtype), &format), "gguf: GGML type ", qtype,
              " is not supported (Q4_0, Q5_0, Q8_0, MXFP4, Q4_K, Q5_K, Q6_K are)");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.device().is_cpu(),
              "gguf: blocks must be a 2-D uint8 CPU tensor [N, bytes per row]");
  TORCH_CHECK(blocks.size(1) % format.block_bytes == 0, "gguf: a ", type_name(qtype), " row of ",
              blocks.size(1), " bytes is not a whole number of ", format.block_bytes, "-byte blocks");
  return format;
}

}  // namespace

namespace {

ActLayout layout_for(const Variant& variant, int64_t qtype, int64_t k) {
  const QOrder order = qtype == Q4_K || qtype == Q5_K ? variant.q4_k_order
                       : qtype == Q4_K_X              ? variant.q4_k_x_order
                                                      : kNatural;
  return ActLayout(k, is_k_quant(int(qtype)), order);
}

// Rows [0, m) of x rounded once; with two passes, rows [m, 2m) are what that rounding left,
// rounded in turn (a row's result is then the sum of its two).
QuantizedRows quantize(const Variant& variant, const float* x, int64_t m, int64_t k, int64_t qtype,
                       int64_t passes) {
  const ActLayout layout = layout_for(variant, qtype, k);
  QuantizedRows out;
  out.buffer = at::empty({passes * m * layout.row_bytes}, at::TensorOptions().dtype(at::kByte));
  uint8_t* base = out.buffer.data_ptr<uint8_t>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> residual(passes == 2 ? k : 0);
    for (int64_t r = begin; r < end; ++r) {
      quantize_row(x + r * k, layout, base + r * layout.row_bytes, passes == 2 ? residual.data() : nullptr);
      if (passes == 2) quantize_row(residual.data(), layout, base + (m + r) * layout.row_bytes);
    }
  });
  out.rows.resize(passes * m);
  for (int64_t r = 0; r < passes * m; ++r) out.rows[r] = layout.row(base, r);
  return out;
}

// Tiles [tile_begin, tile_end) (16 columns each) of one product.
void run_tiles(const Variant& variant, const Product& p, int64_t tile_begin, int64_t tile_end) {
  const int qtype = int(p.qtype);
  const TileKernel kernel = variant.for_type(qtype);
  // a group of 16 rows short of its 16 (the last N % 16) is per row: the reference takes it
  const TileKernel tail_kernel = is_rows16(qtype) ? scalar_variant().for_type(qtype) : kernel;
  const int64_t rows_per_pass = is_rows16(qtype) ? kMaxRows16 : kMaxRows;
  Format format;
  format_of(qtype, &format);
  const int64_t blocks_per_row = p.row_bytes / format.block_bytes;
  for (int64_t tile = tile_begin * kTileColumns; tile < std::min(tile_end * kTileColumns, p.n); tile += kTileColumns) {
    const int64_t end = std::min(tile + kTileColumns, p.n);
    const TileKernel run = end - tile == kTileColumns ? kernel : tail_kernel;
    for (int64_t r = 0; r < p.rows; r += rows_per_pass) {
      TileArgs args{p.weights, p.row_bytes, blocks_per_row, tile, end, p.acts + r,
                    int(std::min<int64_t>(rows_per_pass, p.rows - r)), p.out + r * p.out_stride, p.out_stride};
      run(args);
    }
  }
}

// Tiles start at multiples of 16 whatever the thread split (the *_R16 groups need it).
void run_all(const Variant& variant, const std::vector<Product>& products) {
  std::vector<int64_t> first_tile{0};  // [products + 1]: prefix sums of their tile counts
  for (const Product& p : products) first_tile.push_back(first_tile.back() + (p.n + kTileColumns - 1) / kTileColumns);
  at::parallel_for(0, first_tile.back(), 1, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < products.size(); ++i) {
      const int64_t lo = std::max(begin, first_tile[i]), hi = std::min(end, first_tile[i + 1]);
      if (lo < hi) run_tiles(variant, products[i], lo - first_tile[i], hi - first_tile[i]);
    }
  });
}

}  // namespace

QuantizedRows quantize_rows(const float* x, int64_t m, int64_t k, int64_t qtype) {
  return quantize(variants().front(), x, m, k, qtype, 1);
}

void run_products(const std::vector<Product>& products) {
  const Variant& variant = variants().front();
  for (const Product& p : products)
    TORCH_CHECK(p.n == 0 || variant.for_type(int(p.qtype)) != nullptr, "gguf: the ", variant.name,
                " variant has no kernel for ", type_name(p.qtype));
  run_all(variant, products);
}

at::Tensor gguf_mm(const at::Tensor& x_in, const at::Tensor& blocks_in, int64_t qtype,
                   const std::string& variant_name, int64_t passes) {
  TORCH_CHECK(passes == 1 || passes == 2, "gguf_mm: passes is 1 or 2");
  const Format format = checked_format(blocks_in, qtype);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "gguf_mm: x must be a 2-D float32 CPU tensor [M, K]");
  const int64_t m = x_in.size(0), k = x_in.size(1), n = blocks_in.size(0);
  TORCH_CHECK(k % format.block_values == 0, "gguf_mm: in_features ", k, " is not a multiple of the ",
              type_name(qtype), " block (", format.block_values, " values)");
  const int64_t blocks_per_row = k / format.block_values;
  TORCH_CHECK(blocks_in.size(1) == blocks_per_row * format.block_bytes, "gguf_mm: x has K = ", k,
              " but the weight rows hold ", blocks_in.size(1) / format.block_bytes * format.block_values,
              " values");
  const Variant& variant = variant_named(variant_name);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor blocks = blocks_in.contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  TORCH_CHECK(variant.for_type(int(qtype)) != nullptr, "gguf_mm: the ", variant.name, " variant has no kernel for ",
              type_name(qtype), " (blocks repacked for another variant)");
  const QuantizedRows acts = quantize(variant, x.data_ptr<float>(), m, k, qtype, passes);
  at::Tensor partial = passes == 2 ? at::empty({passes * m, n}, x.options()) : out;
  run_all(variant, {Product{blocks.data_ptr<uint8_t>(), blocks.size(1), n, qtype, acts.rows.data(), passes * m,
                            partial.data_ptr<float>(), n}});
  if (passes == 2) at::add_out(out, partial.narrow(0, 0, m), partial.narrow(0, m, m));
  return out;
}

at::Tensor gguf_dequantize(const at::Tensor& blocks_in, int64_t qtype) {
  const Format format = checked_format(blocks_in, qtype);
  const at::Tensor blocks = blocks_in.contiguous();
  const int64_t n = blocks.size(0), per_row = blocks.size(1) / format.block_bytes;
  at::Tensor out = at::empty({n, per_row * format.block_values}, blocks.options().dtype(at::kFloat));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const Variant& best = variants().front();
  const int64_t k = per_row * format.block_values, row_bytes = blocks.size(1);
  if (is_rows16(int(qtype))) {  // by groups of 16 interleaved rows; the tail per row
    const int64_t groups = n / kGroupRows;
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        best.dequantize_group(int(qtype), src + g * kGroupRows * row_bytes, per_row, dst + g * kGroupRows * k);
      }
    });
    for (int64_t i = groups * kGroupRows; i < n; ++i) dequantize_rows16_row(int(qtype), src, row_bytes, n, i, dst + i * k);
    return out;
  }
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) best.dequantize_row(int(qtype), src + i * row_bytes, per_row, dst + i * k);
  });
  return out;
}

namespace {

// Whether `variant` multiplies `qtype` (a file type) in its row-interleaved layout: every SIMD
// variant does, except plain AVX2 for Q8_0 (values past 127 overflow `vpmaddubsw`'s pairs).
bool runs_rows16(const std::string& variant, int64_t qtype) {
  if (rows16_of(int(qtype)) == 0) return false;
  if (variant == "avx2") return qtype != Q8_0;
  return variant == "avx512vnni" || variant == "avxvnni";
}

// Rows of a file type to its *_R16 layout: full groups of 16 interleaved, the tail per row.
at::Tensor pack_rows16_matrix(const at::Tensor& blocks, int64_t qtype) {
  Format file, packed;
  format_of(int(qtype), &file);
  format_of(rows16_of(int(qtype)), &packed);
  const int64_t n = blocks.size(0), per_row = blocks.size(1) / file.block_bytes;
  const int64_t out_row_bytes = per_row * packed.block_bytes, groups = n / kGroupRows;
  at::Tensor out = empty_huge({n, out_row_bytes}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t block_bytes = kGroupRows * packed.block_bytes;
  at::parallel_for(0, groups * per_row, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / per_row, b = i % per_row;
      pack_rows16(int(qtype), src + g * kGroupRows * blocks.size(1), blocks.size(1), b,
                  dst + g * kGroupRows * out_row_bytes + b * block_bytes);
    }
  });
  for (int64_t row = groups * kGroupRows; row < n; ++row) {  // the tail, in the tail's form
    for (int64_t b = 0; b < per_row; ++b) {
      const uint8_t* block = src + row * blocks.size(1) + b * file.block_bytes;
      uint8_t* target = dst + row * out_row_bytes + b * packed.block_bytes;
      if (qtype == Q4_K) pack_q4_k_x(block, target); else std::memcpy(target, block, file.block_bytes);
    }
  }
  return out;
}

at::Tensor pack_q4_k_x_matrix(const at::Tensor& blocks) {
  const int64_t n = blocks.size(0), per_row = blocks.size(1) / 144;
  at::Tensor out = empty_huge({n, per_row * 148}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n * per_row, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) pack_q4_k_x(src + i * 144, dst + i * 148);
  });
  return out;
}

}  // namespace

// The blocks in the layout `variant` (default: the best here) multiplies fastest, and their type.
// layout "" is that best: Q4_K and Q6_K become Q4_K_R16 and Q6_K_R16 for every SIMD variant, Q4_0,
// Q5_0, MXFP4 (and Q8_0 but on plain avx2) their *_R16 layouts; "tiles" keeps the per-row layouts (Q4_K_X for
// avx512vnni); "rows16" asks for the interleaved ones.
// Other types come back as they are.
std::tuple<at::Tensor, int64_t> gguf_pack(const at::Tensor& blocks_in, int64_t qtype, const std::string& variant_name,
                                          const std::string& layout) {
  checked_format(blocks_in, qtype);
  TORCH_CHECK(layout.empty() || layout == "tiles" || layout == "rows16", "gguf_pack: layout '", layout,
              "' is none of \"\", \"tiles\", \"rows16\"");
  const std::string name = variant_name.empty() ? variants().front().name : variant_name;
  const at::Tensor blocks = blocks_in.contiguous();
  const bool rows16 = layout == "rows16" || (layout.empty() && runs_rows16(name, qtype));
  if (rows16 && rows16_of(int(qtype)) != 0) return {pack_rows16_matrix(blocks, qtype), int64_t(rows16_of(int(qtype)))};
  if (qtype == Q4_K && name == "avx512vnni") return {pack_q4_k_x_matrix(blocks), int64_t(Q4_K_X)};
  return {blocks_in, qtype};
}

std::vector<std::string> gguf_variants() {
  std::vector<std::string> names;
  for (const Variant& v : variants()) names.emplace_back(v.name);
  return names;
}

}  // namespace specserve::gguf

// The tensor ops are CPU kernels (Python registers their shapes for torch.compile's fake tensors).
TORCH_LIBRARY_FRAGMENT(specserve_kernels, m) {
  m.def("gguf_mm(Tensor x, Tensor blocks, int qtype, str variant=\"\", int passes=1) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int qtype) -> Tensor");
  m.def("gguf_pack(Tensor blocks, int qtype, str variant=\"\", str layout=\"\") -> (Tensor, int)");
  m.def("gguf_variants() -> str[]", &specserve::gguf::gguf_variants);
}

TORCH_LIBRARY_IMPL(specserve_kernels, CPU, m) {
  m.impl("gguf_mm", &specserve::gguf::gguf_mm);
  m.impl("gguf_dequantize", &specserve::gguf::gguf_dequantize);
  m.impl("gguf_pack", &specserve::gguf::gguf_pack);
}
