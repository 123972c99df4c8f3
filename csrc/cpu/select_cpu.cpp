// Selection by magnitude (the keys of zen/magnitude.h), in O(numel).
// threshold_select: one pass marks the keys >= the threshold's and gathers the marked entries of each chunk
// while it is in cache; the output is then those lists, concatenated.
// topk_select: the k-th largest key t lies in bounds (lo, hi]. One pass gathers, per chunk, the entries of
// key > lo and counts those > hi; nth_element over the keys in (lo, hi] alone gives t exactly. The chosen
// entries are the keys > t and, of the keys == t, the first (k - keys above t) by index. The bounds come from
// a strided sample of the keys (from kSampleFrom elements), checked by the counts of that pass; or, when
// the sample misled or the tensor is small, from a histogram of the keys' top 15 bits (one more pass),
// whose bucket of the k-th key always holds. Either way the result is exact and the same.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/llvmMathExtras.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#include "zen/select.h"

namespace zen {
namespace {

constexpr int64_t kChunk = 1 << 16;             // elements per chunk: the unit of parallel work and of output order
constexpr int kBucketBits = 15;                 // a key's top bits below the (always clear) sign bit
constexpr int kWays = 4;                        // interleaved histograms, so that equal buckets do not stall
constexpr int64_t kWindow = int64_t{1} << 30;   // elements per flush of the 32-bit histograms
constexpr int64_t kSampleFrom = 1 << 20;        // top-k of this many elements first tries sampled bounds
constexpr int64_t kSampleSize = 1 << 17;        // keys in the sample

// The keys of zen/magnitude.h, held in the signed type of their width: the sign bit is always clear, so the
// order is the same, and SSE2's signed compares vectorise the tests.
template <typename scalar_t>
struct Keys {
  using bits_t = typename UnsignedOfSize<sizeof(scalar_t)>::type;
  using key_t = std::make_signed_t<bits_t>;
  static constexpr key_t kNan = static_cast<key_t>(Magnitude<scalar_t>::kNanKey);
  static constexpr key_t kAbs = std::numeric_limits<key_t>::max();
  static constexpr int kShift = 8 * sizeof(bits_t) - 1 - kBucketBits;  // 0 for the 16-bit types
  static key_t magnitude(bits_t bits) { return static_cast<key_t>(bits & kAbs); }
  static key_t key(bits_t bits) {
    const key_t m = magnitude(bits);
    return m < kNan ? m : kNan;
  }
  // For bounds below kNan, key > bound iff magnitude > bound: the tests of whole passes skip the NaN fold.
  // A bound at or past kNan, which no key exceeds, becomes the largest key_t, which no magnitude exceeds.
  static key_t magnitude_bound(key_t bound) { return bound < kNan ? bound : std::numeric_limits<key_t>::max(); }
};

inline int64_t num_chunks(int64_t numel) { return (numel + kChunk - 1) / kChunk; }
inline int64_t chunk_end(int64_t c, int64_t numel) { return std::min(numel, (c + 1) * kChunk); }

// The entries of one chunk whose key is > lo, ascending: their indices and bits.
template <typename scalar_t, typename index_t>
struct Marked {
  std::vector<index_t> indices;
  std::vector<typename Keys<scalar_t>::bits_t> bits;
  int64_t over = 0;  // how many of them have a key > hi
};

// Gathers the entries of [begin, end) whose key is > lo into `out`, and counts those > hi. Byte flags first,
// in a branch-free loop the compiler vectorises; then the flags eight at a time, most words of them clear
// when few entries are marked, the entries read again while the chunk is still in cache.
template <typename scalar_t, typename index_t>
void mark_chunk(const typename Keys<scalar_t>::bits_t* bits, int64_t begin, int64_t end,
                typename Keys<scalar_t>::key_t lo, typename Keys<scalar_t>::key_t hi, uint8_t* flags,
                Marked<scalar_t, index_t>& out) {
  using K = Keys<scalar_t>;
  const int64_t n = end - begin;
  const auto m_lo = K::magnitude_bound(lo), m_hi = K::magnitude_bound(hi);
  uint32_t marked = 0, over = 0;  // a chunk's counts fit, and 32-bit ones vectorise
  for (int64_t i = 0; i < n; ++i) {
    const typename K::key_t m = K::magnitude(bits[begin + i]);
    flags[i] = m > m_lo;
    marked += m > m_lo;
    over += m > m_hi;
  }
  out.over = over;
  out.indices.resize(marked);
  out.bits.resize(marked);
  if (marked == 0) return;
  int64_t k = 0;
  const auto take = [&](int64_t j) {
    out.indices[k] = static_cast<index_t>(begin + j);
    out.bits[k++] = bits[begin + j];
  };
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    uint64_t word;  // flag q of the eight in bits [8 q, 8 q + 8)
    std::memcpy(&word, flags + j, sizeof(word));
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    word = __builtin_bswap64(word);
#endif
    for (; word != 0; word &= word - 1)
      take(j + static_cast<int64_t>(c10::llvm::countTrailingZeros(word, c10::llvm::ZB_Undefined) / 8));
  }
  for (; j < n; ++j)
    if (flags[j]) take(j);
}

// What the writing pass takes of a chunk's marked entries: with ties < 0, all of them; otherwise the keys
// > t, and the first `ties` keys == t.
struct ChunkRule {
  int64_t chosen = 0;  // entries written
  int64_t ties = -1;
};

// The chosen entries, ascending: what each chunk's rule takes of its marked entries, at its prefix sum.
template <typename scalar_t, typename index_t>
void write_chosen(const std::vector<Marked<scalar_t, index_t>>& marked, typename Keys<scalar_t>::key_t t,
                  const std::vector<ChunkRule>& rules, at::Tensor& indices, at::Tensor& values) {
  using K = Keys<scalar_t>;
  using bits_t = typename K::bits_t;
  using key_t = typename K::key_t;
  const auto chunks = static_cast<int64_t>(rules.size());
  std::vector<int64_t> offset(chunks + 1, 0);
  for (int64_t c = 0; c < chunks; ++c) offset[c + 1] = offset[c] + rules[c].chosen;
  indices = at::empty({offset[chunks]}, at::TensorOptions().dtype(c10::CppTypeToScalarType<index_t>::value));
  values = at::empty({offset[chunks]}, at::TensorOptions().dtype(c10::CppTypeToScalarType<scalar_t>::value));
  auto* out_idx = indices.data_ptr<index_t>();
  auto* out_val = reinterpret_cast<bits_t*>(values.data_ptr());
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t out = offset[c];
      if (out == offset[c + 1]) continue;
      const auto& mine = marked[c];
      if (rules[c].ties < 0) {
        std::memcpy(out_idx + out, mine.indices.data(), mine.indices.size() * sizeof(index_t));
        std::memcpy(out_val + out, mine.bits.data(), mine.bits.size() * sizeof(bits_t));
        out += static_cast<int64_t>(mine.indices.size());
      } else {
        int64_t met = 0;  // keys == t so far
        for (size_t e = 0; e < mine.indices.size(); ++e) {
          const key_t key = K::key(mine.bits[e]);
          if (key > t || (key == t && met++ < rules[c].ties)) {
            out_idx[out] = mine.indices[e];
            out_val[out++] = mine.bits[e];
          }
        }
      }
      TORCH_INTERNAL_ASSERT(out == offset[c + 1]);
    }
  });
}

// One pass over the tensor: every chunk's entries of key > lo, and how many of them are > hi.
template <typename scalar_t, typename index_t>
std::vector<Marked<scalar_t, index_t>> mark(const typename Keys<scalar_t>::bits_t* bits, int64_t numel,
                                            typename Keys<scalar_t>::key_t lo, typename Keys<scalar_t>::key_t hi) {
  std::vector<Marked<scalar_t, index_t>> marked(num_chunks(numel));
  at::parallel_for(0, num_chunks(numel), 1, [&](int64_t c0, int64_t c1) {
    std::vector<uint8_t> flags(kChunk);
    for (int64_t c = c0; c < c1; ++c)
      mark_chunk<scalar_t, index_t>(bits, c * kChunk, chunk_end(c, numel), lo, hi, flags.data(), marked[c]);
  });
  return marked;
}

// Every key > lo.
template <typename scalar_t, typename index_t>
void select_above(const typename Keys<scalar_t>::bits_t* bits, int64_t numel, typename Keys<scalar_t>::key_t lo,
                  at::Tensor& indices, at::Tensor& values) {
  using K = Keys<scalar_t>;
  const auto marked = mark<scalar_t, index_t>(bits, numel, lo, K::kNan);
  std::vector<ChunkRule> rules(marked.size());
  for (size_t c = 0; c < marked.size(); ++c) rules[c].chosen = static_cast<int64_t>(marked[c].indices.size());
  write_chosen<scalar_t, index_t>(marked, K::kNan, rules, indices, values);
}

// The top k when the k-th largest key t lies in (lo, hi] (lo >= 0); or, when lo is 0 and there are at most k
// non-zeros, all of them. Returns false, having written nothing, when t is not there.
template <typename scalar_t, typename index_t>
bool select_between(const typename Keys<scalar_t>::bits_t* bits, int64_t numel, int64_t k,
                    typename Keys<scalar_t>::key_t lo, typename Keys<scalar_t>::key_t hi, at::Tensor& indices,
                    at::Tensor& values) {
  using K = Keys<scalar_t>;
  using key_t = typename K::key_t;
  const auto marked = mark<scalar_t, index_t>(bits, numel, lo, hi);
  const auto chunks = static_cast<int64_t>(marked.size());
  int64_t total = 0, over = 0;
  for (const auto& mine : marked) {
    total += static_cast<int64_t>(mine.indices.size());
    over += mine.over;
  }
  std::vector<ChunkRule> rules(chunks);
  if (lo == 0 && total <= k) {  // every non-zero
    for (int64_t c = 0; c < chunks; ++c) rules[c].chosen = static_cast<int64_t>(marked[c].indices.size());
    write_chosen<scalar_t, index_t>(marked, K::kNan, rules, indices, values);
    return true;
  }
  if (over >= k || total < k) return false;

  // t: the (k - over)-th largest of the keys in (lo, hi].
  std::vector<key_t> candidates;
  candidates.reserve(total - over);
  for (const auto& mine : marked)
    for (const auto b : mine.bits) {
      const key_t key = K::key(b);
      if (key <= hi) candidates.push_back(key);
    }
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(candidates.size()) == total - over);
  const auto nth = candidates.begin() + (k - over - 1);
  std::nth_element(candidates.begin(), nth, candidates.end(), std::greater<key_t>());
  const key_t t = *nth;

  // The ties taken: the first (k - keys above t) keys == t by index, i.e. chunk by chunk in order.
  std::vector<int64_t> ties(chunks, 0);
  int64_t left = k;
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t above = 0;
    for (const auto b : marked[c].bits) {
      const key_t key = K::key(b);
      above += key > t;
      ties[c] += key == t;
    }
    rules[c].chosen = above;
    left -= above;
  }
  for (int64_t c = 0; c < chunks; ++c) {
    rules[c].ties = std::min(ties[c], left);
    rules[c].chosen += rules[c].ties;
    left -= rules[c].ties;
  }
  TORCH_INTERNAL_ASSERT(left == 0);
  write_chosen<scalar_t, index_t>(marked, t, rules, indices, values);
  return true;
}

// Bounds (lo, hi] that hold the k-th largest key with near certainty, from a strided sample of the keys: the
// keys at the sample ranks k' -+ (4 sqrt(k') + 16), k' = k sample / numel, the k-th's expected rank there.
template <typename scalar_t>
void sampled_bounds(const typename Keys<scalar_t>::bits_t* bits, int64_t numel, int64_t k,
                    typename Keys<scalar_t>::key_t& lo, typename Keys<scalar_t>::key_t& hi) {
  using K = Keys<scalar_t>;
  using key_t = typename K::key_t;
  const int64_t stride = numel / kSampleSize;  // >= 8: sampled only from kSampleFrom elements
  std::vector<key_t> sample(kSampleSize);
  for (int64_t j = 0; j < kSampleSize; ++j) sample[j] = K::key(bits[j * stride + stride / 2]);
  const double expected = static_cast<double>(k) * kSampleSize / numel;
  const double margin = 4 * std::sqrt(expected) + 16;
  const auto rank_hi = static_cast<int64_t>(std::floor(expected - margin));  // 1-based ranks
  const auto rank_lo = std::min<int64_t>(kSampleSize + 1, static_cast<int64_t>(std::ceil(expected + margin)));
  // After the first nth_element, the ranks above rank_lo all lie before it.
  auto end = sample.end();
  lo = 0;
  if (rank_lo <= kSampleSize) {
    end = sample.begin() + (rank_lo - 1);
    std::nth_element(sample.begin(), end, sample.end(), std::greater<key_t>());
    lo = std::max<key_t>(0, *end - 1);
  }
  hi = K::kNan;
  if (rank_hi >= 1) {
    const auto at = sample.begin() + (rank_hi - 1);
    std::nth_element(sample.begin(), at, end, std::greater<key_t>());
    hi = *at;
  }
}

// Histogram of the buckets (key >> kShift) of the non-zero keys, and (in nnz) their number.
template <typename scalar_t>
std::vector<int64_t> bucket_histogram(const typename Keys<scalar_t>::bits_t* bits, int64_t numel, int64_t& nnz) {
  using K = Keys<scalar_t>;
  constexpr int64_t kBuckets = int64_t{1} << kBucketBits;
  // One histogram per contiguous part of the tensor (a thread's), counted in kWays 32-bit ones, element
  // i in histogram i % kWays, flushed into 64-bit counts every kWindow elements.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_chunks(numel)));
  std::vector<int64_t> hist(parts * kBuckets, 0), zeros(parts, 0);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint32_t> ways(kWays * kBuckets);
    for (int64_t p = p0; p < p1; ++p) {
      int64_t* h = hist.data() + p * kBuckets;
      for (int64_t w = numel * p / parts, e = numel * (p + 1) / parts; w < e; w += kWindow) {
        std::fill(ways.begin(), ways.end(), 0);
        uint32_t* way = ways.data();
        const int64_t we = std::min(e, w + kWindow);
        uint32_t z = 0;
        int64_t i = w;
        for (; i + kWays <= we; i += kWays) {
          for (int j = 0; j < kWays; ++j) {
            const typename K::key_t key = K::key(bits[i + j]);
            ++way[j * kBuckets + (key >> K::kShift)];
            z += key == 0;
          }
        }
        for (; i < we; ++i) {
          const typename K::key_t key = K::key(bits[i]);
          ++way[key >> K::kShift];
          z += key == 0;
        }
        zeros[p] += z;
        for (int j = 0; j < kWays; ++j)
          for (int64_t b = 0; b < kBuckets; ++b) h[b] += way[j * kBuckets + b];
      }
    }
  });
  for (int64_t p = 1; p < parts; ++p)
    for (int64_t b = 0; b < kBuckets; ++b) hist[b] += hist[p * kBuckets + b];
  hist.resize(kBuckets);
  nnz = numel;
  for (const int64_t z : zeros) {
    nnz -= z;
    hist[0] -= z;  // bucket 0 holds the non-zeros of key < 2^kShift only
  }
  return hist;
}

template <typename scalar_t, typename index_t>
void topk(const scalar_t* data, int64_t numel, int64_t k, at::Tensor& indices, at::Tensor& values) {
  using K = Keys<scalar_t>;
  using bits_t = typename K::bits_t;
  using key_t = typename K::key_t;
  constexpr int64_t kBuckets = int64_t{1} << kBucketBits;
  const auto* bits = reinterpret_cast<const bits_t*>(data);
  if (k == 0)
    return write_chosen<scalar_t, index_t>({}, K::kNan, std::vector<ChunkRule>(), indices, values);
  key_t lo = 0, hi = K::kNan;
  if (numel >= kSampleFrom) {  // bounds from a sample: one pass over the tensor when they hold
    sampled_bounds<scalar_t>(bits, numel, k, lo, hi);
    if (select_between<scalar_t, index_t>(bits, numel, k, lo, hi, indices, values)) return;
  }
  // Exact bounds from the histogram: the bucket of the k-th largest key.
  int64_t nnz = 0;
  const std::vector<int64_t> hist = bucket_histogram<scalar_t>(bits, numel, nnz);
  if (k >= nnz) return select_above<scalar_t, index_t>(bits, numel, 0, indices, values);
  int64_t bucket = kBuckets - 1, above = 0;
  for (; bucket > 0 && above + hist[bucket] < k; --bucket) above += hist[bucket];
  lo = bucket == 0 ? 0 : static_cast<key_t>((bucket << K::kShift) - 1);  // bucket 0: its non-zeros
  hi = static_cast<key_t>(((bucket + 1) << K::kShift) - 1);
  const bool found = select_between<scalar_t, index_t>(bits, numel, k, lo, hi, indices, values);
  TORCH_INTERNAL_ASSERT(found, "topk_select: the k-th magnitude is not in its histogram bucket");
}

template <typename scalar_t>
const typename Keys<scalar_t>::bits_t* bits_of(const at::Tensor& dense) {
  return reinterpret_cast<const typename Keys<scalar_t>::bits_t*>(dense.const_data_ptr<scalar_t>());
}

std::tuple<at::Tensor, at::Tensor> topk_select_cpu(const at::Tensor& dense, int64_t k) {
  check_select(dense, "topk_select");
  check_topk_k(k);
  at::Tensor indices, values;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dense.scalar_type(), "zen_topk_select", [&] {
    if (index_type_for(dense.numel()) == at::kInt) {
      topk<scalar_t, int32_t>(dense.const_data_ptr<scalar_t>(), dense.numel(), k, indices, values);
    } else {
      topk<scalar_t, int64_t>(dense.const_data_ptr<scalar_t>(), dense.numel(), k, indices, values);
    }
  });
  return {indices, values};
}

std::tuple<at::Tensor, at::Tensor> threshold_select_cpu(const at::Tensor& dense, double threshold) {
  check_select(dense, "threshold_select");
  check_threshold(threshold);
  at::Tensor indices, values;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dense.scalar_type(), "zen_threshold_select", [&] {
    using key_t = typename Keys<scalar_t>::key_t;
    const auto lo = static_cast<key_t>(threshold_key<scalar_t>(threshold) - 1);  // keys >= the threshold's
    if (index_type_for(dense.numel()) == at::kInt) {
      select_above<scalar_t, int32_t>(bits_of<scalar_t>(dense), dense.numel(), lo, indices, values);
    } else {
      select_above<scalar_t, int64_t>(bits_of<scalar_t>(dense), dense.numel(), lo, indices, values);
    }
  });
  return {indices, values};
}

}  // namespace

TORCH_LIBRARY_IMPL(zen, CPU, m) {
  m.impl("topk_select", &topk_select_cpu);
  m.impl("threshold_select", &threshold_select_cpu);
}

}  // namespace zen
