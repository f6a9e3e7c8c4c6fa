// Paged attention's kernels share these (attention.cpp: the overview, the scalar reference, the
// dispatch and the op; attention_avx2.cpp, attention_avx512.cpp: the SIMD variants, each compiled
// for its own target and run only once the CPU has said it has the instructions, isa.h).
#pragma once
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on its own intrinsics headers

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace specserve::attention {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One item's result per row: the range's max score m, the sum l of e^(s - m), and the output
// accumulator acc = sum of e^(s - m) * v (merged over ranges afterwards).
struct RowState {
  float* m;    // [rows]
  float* l;    // [rows]
  float* acc;  // [rows, dim]
};

// The lines a range will read next, asked of L2 as the kernel reads: each `advance(bytes)`
// asks for as many bytes ahead as the kernel has just read, so the memory system streams the
// next blocks while this one is computed. The pool's blocks are scattered 4 KB runs, so the
// hardware prefetcher stops at each block's end. A whole block's prefetches at once (what this
// replaced) helped little on Zen 4: the core stalls on a burst of 64 misses. Spread over the
// block's loads, the same lines took 0.64-0.68x the burst's time for a decode at 2,700 and 8,000
// tokens, 0.78x for a 4-token verify (cold, 28 layers; docs/ATTENTION.md).
struct Feed {
  const char* next = nullptr;
  const char* end = nullptr;
  // What to read next (the rest of the last queue asked at once, a rare leftover).
  void queue(const void* p, int64_t bytes) {
    advance(end - next);
    next = static_cast<const char*>(p);
    end = next + bytes;
  }
  void advance(int64_t bytes) {
    for (; bytes > 0 && next < end; bytes -= 64, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// Blocks ahead of the one being read that the feed asks for: two measured best on Zen 4 (one
// and three within 5%, six 15% slower).
constexpr int64_t kFeedBlocks = 2;

// What an item's kernels read: `rows` query rows against the blocks of one range of a request's
// context. Keys at positions < limit[r] are visible to row r (its causal limit), and with a
// window only the last `window` of them (positions >= limit[r] - window); with a draft tree, of
// this pass's keys (positions tree_first + j, j < 64) only those whose bit j is set in tree[r];
// a block's slots past its keys, and keys a row does not see, score -inf.
template <typename T>
struct Range {
  const T* q;             // [rows, dim] as stored
  float* qf;              // scratch [rows, dim]: the rows in float32 (kernels that score in it)
  const int64_t* limit;   // [rows]
  const T* const* k;      // [nblocks]: a block's keys [block_size, dim]
  const T* const* v;      // [nblocks]: its values
  const int64_t* nkeys;   // [nblocks]: keys in the block (the last one may be partial)
  int64_t first;          // position of the range's first key
  int64_t rows, nblocks, block_size, dim;
  int64_t slots;          // score slots per block: block_size rounded up to 16
  int64_t window;         // a sliding-window layer's: keys a row sees (0: all before its limit)
  const uint64_t* tree;   // [rows]: bit j, the row sees this pass's key j (null: no tree)
  int64_t tree_first;     // position of this pass's first key (the request's start)
  float scale;
  float* scores;          // scratch [max(rows, 16), nblocks * slots]: scores, then probabilities
                          // (row-major; the AMX kernel's key-major [nblocks * 16][16 rows])
  float* kf;              // scratch [block_size, dim]: a block's keys in float32
  int32_t* keys_t;        // scratch [slots / 16, dim / 2, 16]: the bf16 kernel's transposed keys
  Feed* feed;             // the thread's prefetch queue
  bool fed;               // the first kFeedBlocks blocks' keys are asked for (by the last range)
  const T* then[kFeedBlocks];  // the thread's next range's first key blocks (null: none)
  int64_t stride() const { return nblocks * slots; }
  // Bytes of block i's keys (or values) the range reads.
  int64_t bytes(int64_t i) const { return nkeys[i] * dim * int64_t(sizeof(T)); }
  // Keys of block i row r sees: a prefix of the block.
  int64_t visible(int64_t r, int64_t i) const {
    return std::clamp<int64_t>(limit[r] - (first + i * block_size), 0, nkeys[i]);
  }
  // Slots of block i before row r's window: a prefix of the block (none without a window).
  int64_t before_window(int64_t r, int64_t i) const {
    if (window <= 0) return 0;
    return std::clamp<int64_t>(limit[r] - window - (first + i * block_size), 0, slots);
  }
};

// A sliding window on top of the causal scores the kernels wrote (row-major scores): the keys
// before each row's window score -inf. Only the range's leading blocks hold any (the items
// start at the block of their first row's window), so this touches a block or two per row, and
// every kernel's softmax and values read the masked scores as the causal ones (e^-inf = 0), so a
// row's arithmetic is the same wherever its range starts.
template <typename T>
inline void mask_window(const Range<T>& a) {
  for (int64_t r = 0; r < a.rows; ++r)
    for (int64_t i = 0; i < a.nblocks; ++i) {
      const int64_t n = a.before_window(r, i);
      if (n == 0) break;
      float* s = a.scores + r * a.stride() + i * a.slots;
      std::fill(s, s + n, kNegInf);
    }
}

// A draft tree on top of the causal scores: of this pass's keys (at most 64, in node order after
// the cached ones), those not among row r's ancestors and itself. Work by key position, as the
// ranges split the context anywhere: `hide(n)` for the range's n-th key, at most 64 per row.
template <typename T, class F>
inline void tree_hidden(const Range<T>& a, int64_t r, F&& hide) {
  const int64_t end = std::min(a.first + a.nblocks * a.block_size, a.limit[r]);
  for (int64_t pos = std::max(a.first, a.tree_first); pos < end; ++pos)
    if (((a.tree[r] >> (pos - a.tree_first)) & 1) == 0) hide(pos - a.first);
}

// The tree's hidden keys score -inf (row-major scores), as the window's above: the softmax and
// the values add exact zeros for them, so a row sums its visible keys' terms in key order.
template <typename T>
inline void mask_tree(const Range<T>& a) {
  for (int64_t r = 0; r < a.rows; ++r) {
    float* s = a.scores + r * a.stride();
    tree_hidden(a, r, [&](int64_t n) { s[n / a.block_size * a.slots + n % a.block_size] = kNegInf; });
  }
}

// The scores pass reads the keys block by block, then the values pass the values: while block
// i's scores are computed, the feed brings in block i + kFeedBlocks's keys, past the last block
// the first values; while block i's values are added, block i + kFeedBlocks's values, past the
// last block the keys the thread reads next (its next range's first blocks).
template <typename T>
inline void feed_scores(const Range<T>& a, int64_t i) {
  if (i == 0 && !a.fed)
    for (int64_t j = 1; j < std::min(kFeedBlocks, a.nblocks); ++j) a.feed->queue(a.k[j], a.bytes(j));
  const int64_t j = i + kFeedBlocks;
  if (j < a.nblocks) a.feed->queue(a.k[j], a.bytes(j));
  else if (j - a.nblocks < a.nblocks) a.feed->queue(a.v[j - a.nblocks], a.bytes(j - a.nblocks));
}

template <typename T>
inline void feed_values(const Range<T>& a, int64_t i) {
  const int64_t j = i + kFeedBlocks;
  if (j < a.nblocks) a.feed->queue(a.v[j], a.bytes(j));
  else if (j - a.nblocks < kFeedBlocks && a.then[j - a.nblocks] != nullptr)
    a.feed->queue(a.then[j - a.nblocks], a.block_size * a.dim * int64_t(sizeof(T)));
}

// A score as the eager path computes it: the dot product rounded to the cache dtype, then scaled.
template <typename T>
inline float score_of(float dot, float scale) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) dot = static_cast<float>(c10::BFloat16(dot));
  return dot * scale;
}

// Kernels whose values leave acc in their own lane order (specialized true where one does), put
// back by K::unpermute.
template <class K>
constexpr bool kPermutedAcc = false;

// ---------------------------------------------------------------------------- one range

// An item's rows against its range: every score, then each row's softmax over the whole range
// (its max and sum are the item's m and l), then the values weighted by the probabilities.
template <class K, typename T>
void attend(const Range<T>& a, RowState st) {
  K::scores(a);
  if (a.window > 0) mask_window(a);
  if (a.tree != nullptr) mask_tree(a);
  for (int64_t r = 0; r < a.rows; ++r)
    st.m[r] = K::softmax(a.scores + r * a.stride(), a.stride(), st.l + r);
  std::fill(st.acc, st.acc + a.rows * a.dim, 0.f);
  for (int64_t i = 0; i < a.nblocks; ++i) {
    feed_values(a, i);
    K::values(a.scores + i * a.slots, a.stride(), a.v[i], a.nkeys[i], a.rows, a.dim, st.acc, *a.feed);
  }
  if constexpr (kPermutedAcc<K>) K::unpermute(st.acc, a.rows);
}

template <typename T>
using RangeFn = void (*)(const Range<T>&, RowState);

// The SIMD kernels by head_dim; null where none is compiled for it (attention_avx2.cpp,
// attention_avx512.cpp).
template <typename T>
RangeFn<T> avx2_for(int64_t dim);
template <typename T>
RangeFn<T> avx512_for(int64_t dim);
RangeFn<c10::BFloat16> bf16_for(int64_t dim);
RangeFn<c10::BFloat16> amx_for(int64_t dim);

}  // namespace specserve::attention
