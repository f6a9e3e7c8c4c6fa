// Paged attention for short queries (decodes and speculative verify queries, 1-16 tokens a
// request), reading K and V in place from the KV pool through each request's block table.
//
// The pool, per layer, for K and for V: [kv_heads, num_blocks, block_size, head_dim], so the
// keys of one KV head in one block are block_size contiguous rows of head_dim values (float32 or
// bfloat16). Request b has start[b] tokens in the cache before this pass and qlen[b] new ones
// (already written to the pool); its queries are rows qoffset[b] .. qoffset[b] + qlen[b] of q
// [tokens, heads, head_dim]. Query j sees keys [0, start[b] + j]: the causal mask among a verify
// query's own tokens. A sliding-window layer's (window > 0) sees only the last `window` of them,
// keys (start[b] + j - window, start[b] + j]; its block table then starts at the request's block
// max(0, start[b] + 1 - window) / block_size, the first its first query sees, and only the
// blocks a query's window reaches are read.
//
// A draft tree's verify (tree_bits, optional, [tokens] int64): the pass's tokens are the tree's
// nodes in node order (parents before children, the known token first), each written to the slot
// of position start[b] + j whatever its depth. Query j then sees the cached keys and, of the
// pass's own keys, key i only where bit i of tree_bits[qoffset[b] + j] is set (its ancestors and
// itself); a chain's rows set bits 0..j, causal. Bits cover 64 keys: a request with tree bits has
// at most 64 tokens in the pass. The kernels mask the scores as for a window (below), by key
// position, so the ranges, tiles and merge are the causal ones.
//
// Work: one item per (request, KV head, range of blocks, tile of up to 16 queries). An item takes
// the group's query heads of that KV head (GQA: every key is loaded once for all of them) times
// the tile's queries as rows and runs in three passes over its range (256 tokens by default):
// every score (keys of a block loaded once for all rows), each row's softmax over the whole
// range in float32 (its max m and sum l), then the values weighted by the probabilities (each
// value row loaded once for a tile of up to 6 rows) into the row's accumulator acc. A context is
// split into ranges of split_tokens, so that both cores work even for one request at a long
// context; a second pass merges the ranges of each row by log-sum-exp: M = max m_s,
// out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M).
//
// Numerics follow engine/model/attention.py's eager path: a score is the dot product rounded to
// the cache dtype, then scaled; the softmax runs in float32. Unlike that path the
// probabilities are not rounded to bfloat16 before multiplying V (they are not normalized until
// the merge), except in the AVX512-BF16 variant, whose values pass takes them as bf16 pairs
// through `vdpbf16ps`; the output is rounded once, at the end.
//
// Batch invariance: a row's arithmetic depends on its own position and context only (never on
// the query length, the tile, the batch or the threads), so a verify row equals the decode of
// its position bit for bit; tests/engine/kernels/test_attention_kernel.py pins it for every
// variant. With a window too: the ranges stay aligned to multiples of split_tokens from key 0
// (a range before a row's window is one it sees none of, dropped by the merge), and keys an
// item reads before a row's window score -inf, adding exact zeros to its sums
// (test_attention_window.py). With a tree the same holds by slot: a row of the tree's first
// path (its ancestors at their own positions) equals the decode of its position bit for bit; a
// later branch's row has its ancestors at other slots, so the SIMD kernels sum the same terms in
// other lanes (test_attention_tree.py compares every variant with a dense masked reference).
//
// ISA: AMX-BF16 (bfloat16 caches in blocks of 16: the scores of a block for 16 rows in one
// `tdpbf16ps` per 32 dims, from the keys as stored), AVX512-BF16 (bfloat16 caches: the scores
// of 16 keys at once through `vdpbf16ps` on keys transposed per block, the values two keys an
// instruction through it too), AVX512 and AVX2 kernels,
// and the portable scalar one they are all tested against, chosen at run time; the library
// itself is built for baseline x86-64.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on its own intrinsics headers

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "isa.h"
#include "ops.h"

namespace specserve {
namespace {

using namespace attention;

// ---------------------------------------------------------------------------- scalar reference

struct Scalar {
  template <typename T>
  static void scores(const Range<T>& a) {
    for (int64_t i = 0; i < a.nblocks; ++i)
      for (int64_t r = 0; r < a.rows; ++r) {
        float* s = a.scores + r * a.stride() + i * a.slots;
        const int64_t n = a.visible(r, i);
        for (int64_t t = 0; t < a.slots; ++t) {
          if (t >= n) {
            s[t] = kNegInf;
            continue;
          }
          float dot = 0.f;
          for (int64_t d = 0; d < a.dim; ++d)
            dot += static_cast<float>(a.q[r * a.dim + d]) * static_cast<float>(a.k[i][t * a.dim + d]);
          s[t] = score_of<T>(dot, a.scale);
        }
      }
  }
  static float softmax(float* p, int64_t n, float* l) {  // -> m; p := e^(p - m), l := their sum
    float mx = kNegInf;
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, p[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      p[t] = p[t] == kNegInf ? 0.f : std::exp(p[t] - mx);
      sum += p[t];
    }
    *l = sum;
    return mx;
  }
  // acc[r] += sum over the block's keys t of p[r][t] * v[t]
  template <typename T>
  static void values(const float* p, int64_t pstride, const T* v, int64_t n, int64_t rows,
                     int64_t dim, float* acc, Feed&) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t d = 0; d < dim; ++d)
          acc[r * dim + d] += p[r * pstride + t] * static_cast<float>(v[t * dim + d]);
  }
};

// ---------------------------------------------------------------------------- dispatch

enum class Isa { kAuto, kScalar, kAvx2, kAvx512, kAvx512Bf16, kAmx };

template <typename T>
RangeFn<T> kernel_for(Isa isa, int64_t dim) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (isa == Isa::kAmx) return amx_for(dim);
    if (isa == Isa::kAvx512Bf16) return bf16_for(dim);
  }
  if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16 || isa == Isa::kAmx) return avx512_for<T>(dim);
  if (isa == Isa::kAvx2) return avx2_for<T>(dim);
  return attend<Scalar, T>;
}

Isa pick(const std::string& isa, int64_t dim, bool bf16, int64_t block_size) {
  const bool avx512_ok = cpu::avx512() && avx512_for<float>(dim) != nullptr;
  const bool avx2_ok = cpu::avx2() && avx2_for<float>(dim) != nullptr;
  const bool bf16_ok = bf16 && cpu::avx512bf16() && bf16_for(dim) != nullptr;
  const bool amx_ok = bf16_ok && block_size == 16 && amx_for(dim) != nullptr && cpu::amx_bf16();
  if (isa == "scalar") return Isa::kScalar;
  if (isa == "amx") {
    TORCH_CHECK(amx_ok, "paged_attention: amx needs a bfloat16 cache, blocks of 16, head_dim 64, "
                "128 or 256 and a CPU with AMX-BF16 (head_dim ", dim, ", blocks of ", block_size, ")");
    return Isa::kAmx;
  }
  if (isa == "avx512bf16") {
    TORCH_CHECK(bf16_ok, "paged_attention: avx512bf16 needs a bfloat16 cache and the CPU (head_dim ",
                dim, ")");
    return Isa::kAvx512Bf16;
  }
  if (isa == "avx512") {
    TORCH_CHECK(avx512_ok, "paged_attention: avx512 unavailable (CPU or head_dim ", dim, ")");
    return Isa::kAvx512;
  }
  if (isa == "avx2") {
    TORCH_CHECK(avx2_ok, "paged_attention: avx2 unavailable (CPU or head_dim ", dim, ")");
    return Isa::kAvx2;
  }
  TORCH_CHECK(isa == "auto",
              "paged_attention: isa must be auto, scalar, avx2, avx512, avx512bf16 or amx");
  return amx_ok ? Isa::kAmx
         : bf16_ok ? Isa::kAvx512Bf16
         : avx512_ok ? Isa::kAvx512
         : avx2_ok ? Isa::kAvx2
                   : Isa::kScalar;
}

// ---------------------------------------------------------------------------- the op

// A scratch buffer whose data is 64-byte aligned, so that no 512-bit load or store splits a line.
template <typename T>
class Scratch {
 public:
  T* get(size_t n) {
    raw_.resize(n + 64 / sizeof(T));
    const auto at = (reinterpret_cast<uintptr_t>(raw_.data()) + 63) & ~uintptr_t{63};
    return reinterpret_cast<T*>(at);
  }

 private:
  std::vector<T> raw_;
};

// Rows of a (request, KV head) are ordered query-major, row j * group + g: query j of head
// h * group + g, so a tile of queries is a contiguous run of rows.
struct Item {
  int64_t b, h, block_begin, block_end;
  int64_t row_offset;        // of the (request, KV head, range)'s first row, into the partials
  int64_t q_begin, q_end;    // the tile of queries this item computes
};

// Queries an item takes at once: a prompt chunk's rows are tiled so that a tile's queries and
// accumulators stay in cache while its blocks stream past, and so that a long prompt gives the
// threads many items. A row's arithmetic does not depend on the tile it is in.
constexpr int64_t kQueryTile = 16;

struct Batch {
  std::vector<int64_t> start, qlen, qoffset, splits;
  std::vector<int64_t> skip;  // blocks before a request's table starts (its first query's window)
  std::vector<Item> items;
  int64_t total_rows = 0;
};

// The first block a query at `pos` sees through a window (0 without one).
int64_t window_block(int64_t pos, int64_t window, int64_t block_size) {
  return window > 0 ? std::max<int64_t>(0, pos + 1 - window) / block_size : 0;
}

// Ranges per (request, KV head) of split_tokens each (the last one shorter). The split depends
// on the request's own context only, never on the batch or the thread count, so a request's
// output does not change with what it is batched with (and a tensor-parallel rank, holding
// some KV heads, computes each head as the whole model would). With a window, the ranges before
// the first query's window are left out, and each item starts at its first query's window.
Batch plan(const at::Tensor& start, const at::Tensor& qlen, int64_t kv_heads, int64_t group,
           int64_t block_size, int64_t max_blocks, int64_t split_tokens, int64_t window) {
  Batch p;
  const int64_t batch = start.size(0);
  const auto* s = start.data_ptr<int64_t>();
  const auto* q = qlen.data_ptr<int64_t>();
  const int64_t split_blocks = std::max<int64_t>(1, split_tokens / block_size);
  int64_t offset = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t blocks = (s[b] + q[b] + block_size - 1) / block_size;
    const int64_t skip = window_block(s[b], window, block_size);
    TORCH_CHECK(q[b] >= 1 && blocks - skip <= max_blocks, "paged_attention: bad request ", b);
    const int64_t first_split = skip / split_blocks;
    const int64_t splits = (blocks + split_blocks - 1) / split_blocks - first_split;
    p.start.push_back(s[b]);
    p.qlen.push_back(q[b]);
    p.qoffset.push_back(offset);
    p.splits.push_back(splits);
    p.skip.push_back(skip);
    offset += q[b];
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t i = first_split; i < first_split + splits; ++i) {
        for (int64_t j = 0; j < q[b]; j += kQueryTile) {
          const int64_t begin = std::max(i * split_blocks, window_block(s[b] + j, window, block_size));
          p.items.push_back({b, h, begin, std::min(blocks, (i + 1) * split_blocks), p.total_rows, j,
                             std::min(q[b], j + kQueryTile)});
        }
        p.total_rows += group * q[b];
      }
  }
  return p;
}

template <typename T>
void run_items(const Batch& p, const at::Tensor& q, const at::Tensor& k_cache,
               const at::Tensor& v_cache, const at::Tensor& tables, float scale, int64_t window,
               const uint64_t* tree_bits, Isa isa, float* m, float* l, float* acc) {
  const int64_t heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1);
  const int64_t block_size = k_cache.size(2), group = heads / kv_heads;
  const int64_t max_blocks = tables.size(1), slots = (block_size + 15) / 16 * 16;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const RangeFn<T> kernel = kernel_for<T>(isa, dim);
  // where block n of an item's range starts in each cache; null past the item's last block
  const auto block = [&](const Item& it, int64_t n) -> std::optional<int64_t> {
    if (it.block_begin + n >= it.block_end) return std::nullopt;
    const int64_t id = tp[it.b * max_blocks + it.block_begin + n - p.skip[it.b]];
    TORCH_CHECK(id >= 0 && id < num_blocks, "paged_attention: block id out of range");
    return ((it.h * num_blocks) + id) * block_size * dim;
  };
  at::parallel_for(0, static_cast<int64_t>(p.items.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<T> qrows;
    Scratch<float> scores, queries_f32, keys_f32;
    Scratch<int32_t> keys_t;
    Feed feed;
    float* kf = keys_f32.get(block_size * dim);
    int32_t* kt = keys_t.get(slots * dim / 2);
    std::vector<int64_t> limit, nkeys;
    std::vector<uint64_t> tree;
    std::vector<const T*> kb, vb;
    bool fed = false;
    for (int64_t i = lo; i < hi; ++i) {
      const Item& it = p.items[i];
      const int64_t qn = p.qlen[it.b], start = p.start[it.b];
      const int64_t rows = group * (it.q_end - it.q_begin), first_row = group * it.q_begin;
      const int64_t at = it.row_offset + first_row;
      const RowState st{m + at, l + at, acc + at * dim};
      // the blocks up to the tile's last query: later ones are seen by none of its rows
      const int64_t end = std::min(it.block_end, (start + it.q_end - 1) / block_size + 1);
      const int64_t nblocks = std::max<int64_t>(0, end - it.block_begin);
      if (nblocks == 0) {
        std::fill(st.m, st.m + rows, kNegInf);
        std::fill(st.l, st.l + rows, 0.f);
        std::fill(st.acc, st.acc + rows * dim, 0.f);
        fed = false;  // what the last range queued was this one's blocks
        continue;
      }
      qrows.resize(rows * dim);
      limit.resize(rows);
      for (int64_t j = it.q_begin; j < it.q_end; ++j)  // row j * group + g: query j, head h * group + g
        std::copy_n(qp + ((p.qoffset[it.b] + j) * heads + it.h * group) * dim, group * dim,
                    qrows.data() + (j - it.q_begin) * group * dim);
      for (int64_t r = 0; r < rows; ++r) limit[r] = start + it.q_begin + r / group + 1;
      if (tree_bits != nullptr) {
        tree.resize(rows);
        for (int64_t r = 0; r < rows; ++r) tree[r] = tree_bits[p.qoffset[it.b] + it.q_begin + r / group];
      }
      kb.resize(nblocks);
      vb.resize(nblocks);
      nkeys.resize(nblocks);
      for (int64_t n = 0; n < nblocks; ++n) {
        const int64_t base = *block(it, n);
        kb[n] = kp + base;
        vb[n] = vp + base;
        nkeys[n] = std::min(block_size, start + qn - (it.block_begin + n) * block_size);
      }
      Range<T> a{qrows.data(), queries_f32.get(rows * dim), limit.data(), kb.data(), vb.data(), nkeys.data(),
                 it.block_begin * block_size, rows, nblocks, block_size, dim, slots, window,
                 tree_bits != nullptr ? tree.data() : nullptr, start, scale,
                 scores.get(std::max<int64_t>(rows, 16) * nblocks * slots), kf, kt, &feed, fed, {}};
      for (int64_t n = 0; n < kFeedBlocks && i + 1 < hi; ++n) {
        const std::optional<int64_t> next = block(p.items[i + 1], n);
        a.then[n] = next ? kp + *next : nullptr;
      }
      kernel(a, st);
      fed = i + 1 < hi && nblocks >= kFeedBlocks;
    }
  });
}

template <typename T>
void merge(const Batch& p, int64_t heads, int64_t kv_heads, int64_t dim, const float* m,
           const float* l, const float* acc, at::Tensor& out) {
  const int64_t group = heads / kv_heads;
  T* op = out.data_ptr<T>();
  // item index of (b, h, split 0, tile 0): items are laid out b-major, then h, split, tile
  std::vector<int64_t> first_item(p.start.size()), tiles(p.start.size());
  for (size_t b = 0, n = 0; b < p.start.size(); ++b) {
    first_item[b] = static_cast<int64_t>(n);
    tiles[b] = (p.qlen[b] + kQueryTile - 1) / kQueryTile;
    n += kv_heads * p.splits[b] * tiles[b];
  }
  const int64_t batch = static_cast<int64_t>(p.start.size());
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> row(dim);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / kv_heads, h = bh % kv_heads, qn = p.qlen[b];
      const int64_t splits = p.splits[b], stride = tiles[b];  // items of one range: its tiles
      const Item* items = p.items.data() + first_item[b] + h * splits * stride;
      for (int64_t r = 0; r < group * qn; ++r) {
        float mx = kNegInf;
        for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, m[items[s * stride].row_offset + r]);
        float total = 0.f;
        std::fill(row.begin(), row.end(), 0.f);
        for (int64_t s = 0; s < splits; ++s) {
          const int64_t at = items[s * stride].row_offset + r;
          if (m[at] == kNegInf) continue;  // a range this row sees none of
          const float w = std::exp(m[at] - mx);
          total += l[at] * w;
          for (int64_t d = 0; d < dim; ++d) row[d] += acc[at * dim + d] * w;
        }
        const int64_t g = r % group, j = r / group;
        T* dst = op + ((p.qoffset[b] + j) * heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(row[d] / total);
      }
    }
  });
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& start_pos, const at::Tensor& query_lens,
                           double scale, const std::string& isa_name, int64_t split_tokens,
                           int64_t window, const std::optional<at::Tensor>& tree_bits) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: q [tokens, heads, dim], caches [kv_heads, blocks, block, dim]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: contiguous tensors only");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_attention: q and the caches share one dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(0) == 0,
              "paged_attention: head_dim or GQA grouping mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && start_pos.scalar_type() == at::kLong &&
                  query_lens.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "paged_attention: int64 block tables, start positions and query lengths");
  const at::Tensor start = start_pos.contiguous(), qlen = query_lens.contiguous();
  TORCH_CHECK(start.size(0) == qlen.size(0) && block_tables.size(0) == start.size(0),
              "paged_attention: one block table, start and length per request");
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(0);
  TORCH_CHECK(window >= 0, "paged_attention: window must be >= 0 (0: none)");
  const Batch p = plan(start, qlen, kv_heads, heads / kv_heads, k_cache.size(2),
                       block_tables.size(1), split_tokens, window);
  TORCH_CHECK(p.qoffset.empty() || p.qoffset.back() + p.qlen.back() == q.size(0),
              "paged_attention: query lengths must sum to q's tokens");
  const Isa isa = pick(isa_name, dim, q.scalar_type() == at::kBFloat16, k_cache.size(2));
  at::Tensor bits;
  if (tree_bits.has_value()) {
    bits = tree_bits->contiguous();
    TORCH_CHECK(bits.scalar_type() == at::kLong && bits.dim() == 1 && bits.size(0) == q.size(0),
                "paged_attention: tree_bits [tokens] int64");
    for (const int64_t n : p.qlen)
      TORCH_CHECK(n <= 64, "paged_attention: a tree's bits cover 64 tokens a pass, not ", n);
  }
  const auto* tree = bits.defined() ? reinterpret_cast<const uint64_t*>(bits.data_ptr<int64_t>()) : nullptr;
  std::vector<float> m(p.total_rows), l(p.total_rows), acc(p.total_rows * dim);
  at::Tensor out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    run_items<float>(p, q, k_cache, v_cache, block_tables, s, window, tree, isa, m.data(), l.data(),
                     acc.data());
    merge<float>(p, heads, kv_heads, dim, m.data(), l.data(), acc.data(), out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_attention: float32 or bfloat16");
    run_items<c10::BFloat16>(p, q, k_cache, v_cache, block_tables, s, window, tree, isa, m.data(),
                             l.data(), acc.data());
    merge<c10::BFloat16>(p, heads, kv_heads, dim, m.data(), l.data(), acc.data(), out);
  }
  return out;
}

}  // namespace specserve

TORCH_LIBRARY_FRAGMENT(specserve_kernels, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor start_pos, Tensor query_lens, float scale, str isa='auto', "
      "int split_tokens=256, int window=0, Tensor? tree_bits=None) -> Tensor",
      &specserve::paged_attention);
}
