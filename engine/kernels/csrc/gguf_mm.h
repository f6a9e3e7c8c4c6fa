// The pieces of gguf_mm for ops that run several GGUF products in one parallel pass (moe.cpp:
// the chosen experts' matrices of a step, each with its own rows): activation rows rounded once
// for a packed type, and the tiles of many products split across the threads together. Each
// product's rows get exactly what gguf_mm gives them (batch invariance holds across both).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "gguf_blocks.h"

namespace specserve::gguf {

// Activation rows rounded for one (packed) weight type, as gguf_mm rounds them with one pass.
struct QuantizedRows {
  at::Tensor buffer;         // the rows' bytes (ActLayout::row_bytes each)
  std::vector<ActRow> rows;  // [m]: where each row's parts lie in buffer
};
QuantizedRows quantize_rows(const float* x, int64_t m, int64_t k, int64_t qtype);

// out[r * out_stride + j] = acts[r] . weight row j, r < rows, j < n.
struct Product {
  const uint8_t* weights;  // [n, row_bytes], the packed type's blocks
  int64_t row_bytes, n, qtype;
  const ActRow* acts;  // [rows], rounded for qtype (quantize_rows)
  int64_t rows;
  float* out;
  int64_t out_stride;
};
// Every product's tiles of 16 columns, split across torch's intra-op threads in one pass.
void run_products(const std::vector<Product>& products);

}  // namespace specserve::gguf
