// Prompt (prefill) GEMM on GGUF weight blocks, registered as torch ops:
//
//   gguf_dequantize_bf16(blocks [N, bytes per row] uint8, qtype, isa="") -> [N, K] bf16
//   gguf_mm_bf16(x [M, K] bf16, blocks, qtype, panel_rows=64, isa="") -> [M, N] bf16
//
// A prompt chunk has enough rows for torch's bf16 GEMM (oneDNN: AMX or AVX512-BF16 where the CPU
// has them) to beat the int8 row kernel of gguf_gemm.cpp, but the weights must be bf16 for it.
// gguf_mm_bf16 never makes a full bf16 copy of a weight: the N weight rows are cut into panels
// of `panel_rows`; each thread dequantizes one panel at a time into its own bf16 buffer (64 rows
// x K = 192 KiB at K = 1536, 1.1 MiB at K = 8960: it stays in L2) and multiplies the whole x by
// it with at::mm, single-threaded inside the parallel region, writing the panel's output columns
// in place (ldc = N), 64 rows of x per call (RowBlocks: a row's result independent of its batch).
// Memory is the blocks plus one panel per thread.
//
// `isa`: "" picks the best here ("avx512" where the CPU reports avx512f/bw/vl, else "avx2", else
// "scalar"; "avx2" is the AVX2 GEMM variant's float dequantization, then the portable rounding);
// "scalar" pins the portable path: the reference dequantization of the GEMM variant the blocks
// were packed for, rounded to bf16 one value at a time. Both round to nearest even, as torch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "isa.h"
#include "gguf_blocks.h"
#include "prefill.h"

namespace specserve::prefill {
namespace {

using RowFn = void (*)(int qtype, const uint8_t* row, int64_t blocks, int64_t k, float* scratch,
                       uint16_t* out, bool native_bf16);


void dequantize_row_bf16_portable(int qtype, const uint8_t* row, int64_t blocks, int64_t k, float* scratch,
                                  uint16_t* out, bool) {
  gguf::scalar_variant().dequantize_row(qtype, row, blocks, scratch);
  for (int64_t i = 0; i < k; ++i) out[i] = float_to_bf16(scratch[i]);
}

// AVX2 hosts: the AVX2 GEMM variant's vectorized dequantization, then the portable rounding.
void dequantize_row_bf16_avx2(int qtype, const uint8_t* row, int64_t blocks, int64_t k, float* scratch,
                              uint16_t* out, bool) {
  gguf::avx2_variant().dequantize_row(qtype, row, blocks, scratch);
  for (int64_t i = 0; i < k; ++i) out[i] = float_to_bf16(scratch[i]);
}


RowFn row_fn(const std::string& isa) {
  if (isa == "scalar") return dequantize_row_bf16_portable;
  TORCH_CHECK(isa.empty() || isa == "avx512" || isa == "avx2", "prefill: unknown isa '", isa, "'");
  if (isa == "avx2") {
    TORCH_CHECK(cpu::avx2(), "prefill: this CPU does not run the avx2 variant");
    return dequantize_row_bf16_avx2;
  }
  if (cpu::avx512()) return dequantize_row_bf16_avx512;
  TORCH_CHECK(isa.empty(), "prefill: this CPU does not run the avx512 variant");
  return cpu::avx2() ? dequantize_row_bf16_avx2 : dequantize_row_bf16_portable;
}

struct Weights {
  const uint8_t* data;
  int qtype;
  int64_t n, k, blocks_per_row, row_bytes;
};

Weights checked_weights(const at::Tensor& blocks, int64_t qtype) {
  gguf::Format format;
  TORCH_CHECK(gguf::format_of(int(qtype), &format), "prefill: GGML type ", qtype, " is not supported");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.device().is_cpu() &&
                  blocks.is_contiguous(),
              "prefill: blocks must be a contiguous 2-D uint8 CPU tensor [N, bytes per row]");
  TORCH_CHECK(blocks.size(1) % format.block_bytes == 0, "prefill: a row of ", blocks.size(1),
              " bytes is not a whole number of ", format.block_bytes, "-byte blocks");
  const int64_t per_row = blocks.size(1) / format.block_bytes;
  return {blocks.data_ptr<uint8_t>(), int(qtype), blocks.size(0), per_row * format.block_values, per_row,
          blocks.size(1)};
}

// The 16-row interleaved layouts (Q4_K_R16, Q6_K_R16: gguf_blocks.h) hold a row's values across
// its group's bytes: they dequantize a group at a time, through the GEMM variant's float loops.
const gguf::Variant& group_variant(const std::string& isa) {
  static const gguf::Variant scalar = gguf::scalar_variant();
  static const gguf::Variant avx2 = gguf::avx2_variant();
  return isa != "scalar" && cpu::avx2() ? avx2 : scalar;
}

// Weight rows [begin, end) of a *_R16 tensor to bf16 rows of `out`; begin is a multiple of 16.
void dequantize_rows16(const Weights& w, int64_t begin, int64_t end, const std::string& isa,
                       std::vector<float>& scratch, uint16_t* out) {
  TORCH_CHECK(begin % gguf::kGroupRows == 0, "prefill: 16-row layouts dequantize by whole groups");
  scratch.resize(gguf::kGroupRows * w.k);
  const int64_t full_end = std::min(end, w.n / gguf::kGroupRows * gguf::kGroupRows);
  for (int64_t g = begin; g < full_end; g += gguf::kGroupRows) {
    group_variant(isa).dequantize_group(w.qtype, w.data + g * w.row_bytes, w.blocks_per_row, scratch.data());
    const int64_t rows = std::min<int64_t>(gguf::kGroupRows, end - g);
    for (int64_t i = 0; i < rows * w.k; ++i) out[(g - begin) * w.k + i] = float_to_bf16(scratch[i]);
  }
  for (int64_t i = std::max(begin, full_end); i < end; ++i) {  // the tail rows are stored per row
    gguf::dequantize_rows16_row(w.qtype, w.data, w.row_bytes, w.n, i, scratch.data());
    for (int64_t j = 0; j < w.k; ++j) out[(i - begin) * w.k + j] = float_to_bf16(scratch[j]);
  }
}

// Weight rows [begin, end) to bf16 rows of `out` (row stride w.k).
void dequantize_rows(const Weights& w, int64_t begin, int64_t end, RowFn fn, bool native_bf16,
                     const std::string& isa, std::vector<float>& scratch, uint16_t* out) {
  if (gguf::is_rows16(w.qtype)) return dequantize_rows16(w, begin, end, isa, scratch, out);
  scratch.resize(w.k);
  for (int64_t i = begin; i < end; ++i) {
    fn(w.qtype, w.data + i * w.row_bytes, w.blocks_per_row, w.k, scratch.data(), out + (i - begin) * w.k,
       native_bf16);
  }
}

uint16_t* bf16_data(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// x times a panel, kRowBlock rows of x per GEMM call, the last block zero-padded: every call has
// one shape, so a row's result never depends on how many rows came with it (oneDNN picks its
// blocking, and with it the summation order, from the shape). A prompt chunk's rows are then the
// same whatever decodes or verify rows share its step: speculative greedy equals plain greedy.
constexpr int64_t kRowBlock = 64;

class RowBlocks {
 public:
  explicit RowBlocks(const at::Tensor& x) : x_(x), m_(x.size(0)) {
    const int64_t tail = m_ % kRowBlock;
    if (tail == 0) return;
    padded_ = at::zeros({kRowBlock, x.size(1)}, x.options());  // [kRowBlock, K]
    padded_.narrow(0, 0, tail).copy_(x.narrow(0, m_ - tail, tail));
  }

  // out [M, rows] (row stride N) = x [M, K] . panel [rows, K]^T
  void multiply(const at::Tensor& panel, at::Tensor out) {
    const at::Tensor weights = panel.t();  // [K, rows]
    const int64_t full = m_ - m_ % kRowBlock;
    for (int64_t r = 0; r < full; r += kRowBlock) {
      at::Tensor block = out.narrow(0, r, kRowBlock);
      at::mm_out(block, x_.narrow(0, r, kRowBlock), weights);
    }
    if (full == m_) return;
    at::Tensor tail = at::mm(padded_, weights);  // [kRowBlock, rows]
    out.narrow(0, full, m_ - full).copy_(tail.narrow(0, 0, m_ - full));
  }

 private:
  const at::Tensor& x_;
  int64_t m_;
  at::Tensor padded_;
};

}  // namespace

at::Tensor gguf_dequantize_bf16(const at::Tensor& blocks, int64_t qtype, const std::string& isa) {
  const Weights w = checked_weights(blocks, qtype);
  const RowFn fn = row_fn(isa);
  const bool native_bf16 = cpu::avx512bf16();
  at::Tensor out = at::empty({w.n, w.k}, blocks.options().dtype(at::kBFloat16));
  uint16_t* dst = bf16_data(out);
  // by groups of 16 rows, so that a 16-row layout's groups are never split between threads
  const int64_t groups = (w.n + gguf::kGroupRows - 1) / gguf::kGroupRows;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    const int64_t first = begin * gguf::kGroupRows, last = std::min(w.n, end * gguf::kGroupRows);
    dequantize_rows(w, first, last, fn, native_bf16, isa, scratch, dst + first * w.k);
  });
  return out;
}

at::Tensor gguf_mm_bf16(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t panel_rows,
                        const std::string& isa) {
  const Weights w = checked_weights(blocks, qtype);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(),
              "gguf_mm_bf16: x must be a 2-D bf16 CPU tensor [M, K]");
  TORCH_CHECK(x_in.size(1) == w.k, "gguf_mm_bf16: x has K = ", x_in.size(1), ", the weight rows ", w.k);
  TORCH_CHECK(panel_rows > 0, "gguf_mm_bf16: panel_rows must be > 0");
  TORCH_CHECK(!gguf::is_rows16(w.qtype) || panel_rows % gguf::kGroupRows == 0,
              "gguf_mm_bf16: panels of a 16-row layout are whole groups (panel_rows a multiple of 16)");
  const RowFn fn = row_fn(isa);
  const bool native_bf16 = cpu::avx512bf16();
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), w.n}, x.options());  // [M, N]
  if (x.size(0) == 0 || w.n == 0) return out;
  const int64_t panels = (w.n + panel_rows - 1) / panel_rows;
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the workers lack it
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard(inference);
    at::Tensor panel = at::empty({panel_rows, w.k}, x.options());  // [panel_rows, K]
    std::vector<float> scratch;
    RowBlocks blocks(x);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t first = p * panel_rows, rows = std::min(panel_rows, w.n - first);
      dequantize_rows(w, first, first + rows, fn, native_bf16, isa, scratch, bf16_data(panel));
      blocks.multiply(panel.narrow(0, 0, rows), out.narrow(1, first, rows));
    }
  });
  return out;
}

}  // namespace specserve::prefill

TORCH_LIBRARY_FRAGMENT(specserve_kernels, m) {
  m.def("gguf_dequantize_bf16(Tensor blocks, int qtype, str isa=\"\") -> Tensor");
  m.def("gguf_mm_bf16(Tensor x, Tensor blocks, int qtype, int panel_rows=64, str isa=\"\") -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_kernels, CPU, m) {
  m.impl("gguf_dequantize_bf16", &specserve::prefill::gguf_dequantize_bf16);
  m.impl("gguf_mm_bf16", &specserve::prefill::gguf_mm_bf16);
}
