// The hash bitmap (ZEN's pull format). I_j = sorted {i in [0, M) : h0(i) = j}; a subset S of I_j travels
// as |I_j| bits (bit r set iff I_j[r] in S) plus the values of S in index order.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "zen/bits.h"
#include "zen/checks.h"
#include "zen/hash.h"

namespace zen {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the bitmap's words are read little-endian");

template <typename index_t>
void build_index_sets(int64_t numel, uint32_t n, uint64_t seed, index_t* sets, int64_t* offsets) {
  // Two passes over [0, M) in chunks: count per (chunk, partition), then write at the prefix sums.
  const int64_t chunk = 1 << 16;
  const int64_t num_chunks = (numel + chunk - 1) / chunk;
  std::vector<int64_t> counts(num_chunks * n, 0);
  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* cnt = counts.data() + c * n;
      for (int64_t i = c * chunk, e = std::min(numel, i + chunk); i < e; ++i) ++cnt[partition_of(i, seed, n)];
    }
  });
  std::vector<int64_t> cursor(num_chunks * n);
  int64_t total = 0;
  for (uint32_t j = 0; j < n; ++j) {
    offsets[j] = total;
    for (int64_t c = 0; c < num_chunks; ++c) {
      cursor[c * n + j] = total;
      total += counts[c * n + j];
    }
  }
  offsets[n] = total;
  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* cur = cursor.data() + c * n;
      for (int64_t i = c * chunk, e = std::min(numel, i + chunk); i < e; ++i)
        sets[cur[partition_of(i, seed, n)]++] = static_cast<index_t>(i);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> bitmap_index_sets_cpu(const at::Tensor& device_like, int64_t numel,
                                                         int64_t num_partitions, int64_t seed) {
  check_partitions(num_partitions);
  TORCH_CHECK(numel >= 0, "numel must be >= 0, got ", numel);
  auto opts = device_like.options();
  auto sets = at::empty({numel}, opts.dtype(index_type_for(numel)));
  auto offsets = at::empty({num_partitions + 1}, opts.dtype(at::kLong));
  AT_DISPATCH_INDEX_TYPES(sets.scalar_type(), "zen_bitmap_index_sets", [&] {
    build_index_sets(numel, (uint32_t)num_partitions, (uint64_t)seed, sets.data_ptr<index_t>(),
                     offsets.data_ptr<int64_t>());
  });
  return {sets, offsets};
}

at::Tensor bitmap_encode_cpu(const at::Tensor& indices, const at::Tensor& index_set) {
  check_index(indices, "indices");
  check_index(index_set, "index_set");
  TORCH_CHECK(indices.scalar_type() == index_set.scalar_type(), "indices and index_set must have the same dtype");
  const int64_t bits = index_set.numel(), count = indices.numel();
  auto bitmap = at::zeros({(bits + 7) / 8}, indices.options().dtype(at::kByte));
  uint8_t* out = bitmap.data_ptr<uint8_t>();
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "zen_bitmap_encode", [&] {
    const index_t* idx = indices.const_data_ptr<index_t>();
    const index_t* set_begin = index_set.const_data_ptr<index_t>();
    const index_t* set_end = set_begin + bits;
    // Both are ascending: each search starts where the previous one ended. The next index is looked for
    // among the next 8 entries of I_j, then the next 64 (branch-free counts of the entries below it), then
    // by galloping, O(log gap): a dense subset costs a short count per index, a sparse one a search.
    const index_t* cursor = set_begin;
    auto count_below = [&](int64_t width, index_t x) {
      const int size = static_cast<int>(std::min<int64_t>(width, set_end - cursor));
      int below = 0;
      for (int j = 0; j < size; ++j) below += cursor[j] < x;
      return below;
    };
    for (int64_t i = 0; i < count; ++i) {
      const index_t x = idx[i];
      TORCH_CHECK(i == 0 || x > idx[i - 1], "bitmap_encode: indices must be strictly ascending");
      const int64_t left = set_end - cursor;
      if (left <= 8 || cursor[7] >= x) {
        cursor += count_below(8, x);
      } else if (left <= 64 || cursor[63] >= x) {
        cursor += count_below(64, x);
      } else {
        int64_t step = 128;
        while (step < left && cursor[step - 1] < x) step *= 2;
        cursor = std::lower_bound(cursor + step / 2, cursor + std::min<int64_t>(step, left), x);
      }
      TORCH_CHECK(cursor != set_end && *cursor == x, "bitmap_encode: index ", (int64_t)x,
                  " is not in the partition's index set");
      const int64_t r = cursor - set_begin;
      out[r >> 3] |= uint8_t(1u << (r & 7));
    }
  });
  return bitmap;
}

at::Tensor bitmap_decode_cpu(const at::Tensor& bitmap, const at::Tensor& index_set, int64_t count) {
  check_1d(bitmap, "bitmap");
  check_index(index_set, "index_set");
  TORCH_CHECK(bitmap.scalar_type() == at::kByte, "bitmap must be uint8, got ", bitmap.scalar_type());
  const int64_t bits = index_set.numel();
  TORCH_CHECK(bitmap.numel() == (bits + 7) / 8, "bitmap has ", bitmap.numel(), " bytes, expected ", (bits + 7) / 8,
              " for an index set of ", bits, ": truncated or corrupt buffer");
  const uint8_t* in = bitmap.const_data_ptr<uint8_t>();
  // Read as 64-bit words (little-endian: bit r of the bitmap is bit r % 64 of word r / 64), the tail bytes
  // zero-padded; a branch per word, not per byte.
  const int64_t num_bytes = bitmap.numel(), num_words = (num_bytes + 7) / 8;
  auto word = [&](int64_t w) {
    uint64_t x = 0;
    std::memcpy(&x, in + 8 * w, std::min<int64_t>(8, num_bytes - 8 * w));
    return x;
  };
  int64_t set_bits = 0;
  for (int64_t w = 0; w < num_words; ++w) set_bits += popcount64(word(w));
  if (bits % 8) {
    TORCH_CHECK((in[num_bytes - 1] >> (bits % 8)) == 0, "bitmap has bits set past its index set: corrupt buffer");
  }
  TORCH_CHECK(count < 0 || set_bits == count, "bitmap has ", set_bits, " bits set, expected ", count,
              ": corrupt buffer");
  auto out = at::empty({set_bits}, index_set.options());
  AT_DISPATCH_INDEX_TYPES(index_set.scalar_type(), "zen_bitmap_decode", [&] {
    const index_t* set = index_set.const_data_ptr<index_t>();
    index_t* o = out.data_ptr<index_t>();
    int64_t k = 0;
    for (int64_t w = 0; w < num_words; ++w) {
      for (uint64_t x = word(w); x; x &= x - 1) o[k++] = set[64 * w + __builtin_ctzll(x)];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(zen, CPU, m) {
  m.impl("bitmap_index_sets", &bitmap_index_sets_cpu);
  m.impl("bitmap_encode", &bitmap_encode_cpu);
  m.impl("bitmap_decode", &bitmap_decode_cpu);
}

}  // namespace zen
