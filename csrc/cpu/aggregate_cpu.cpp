// Aggregation of one partition: the (index, value) pairs every peer pushed, summed per index.
// An open-addressing table keyed by index + 1 sums in arrival order (peer 0 first, so the result is
// deterministic); the union is then sorted by index, the order the hash bitmap and the scatter expect.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "zen/checks.h"
#include "zen/hash.h"

namespace zen {
namespace {

template <typename index_t, typename scalar_t>
void aggregate(const index_t* idx, const scalar_t* val, int64_t count, int64_t numel, int64_t num_partitions,
               int64_t seed, int64_t partition, at::Tensor& out_idx, at::Tensor& out_val) {
  using acc_t = at::opmath_type<scalar_t>;
  uint64_t capacity = 16;
  while (capacity < 2 * static_cast<uint64_t>(count)) capacity <<= 1;
  const uint64_t mask = capacity - 1;
  std::vector<int64_t> keys(capacity, kEmptySlot);
  std::vector<int64_t> slot_of_entry;  // entries in first-seen order
  std::vector<acc_t> sums;
  slot_of_entry.reserve(count);
  sums.reserve(count);
  std::vector<int64_t> entry_of_slot(capacity);

  for (int64_t i = 0; i < count; ++i) {
    const int64_t index = static_cast<int64_t>(idx[i]);
    TORCH_CHECK(index >= 0 && index < numel, "received index ", index, " is outside [0, ", numel,
                "): corrupt or mismatched buffer");
    TORCH_CHECK(partition < 0 || partition_of(index, (uint64_t)seed, (uint32_t)num_partitions) == partition,
                "received index ", index, " does not belong to partition ", partition,
                ": corrupt buffer or peers with different seeds");
    uint64_t s = fmix64(static_cast<uint64_t>(index)) & mask;
    while (keys[s] != kEmptySlot && keys[s] != index + 1) s = (s + 1) & mask;
    if (keys[s] == kEmptySlot) {
      keys[s] = index + 1;
      entry_of_slot[s] = static_cast<int64_t>(sums.size());
      slot_of_entry.push_back(static_cast<int64_t>(s));
      sums.push_back(static_cast<acc_t>(val[i]));
    } else {
      sums[entry_of_slot[s]] += static_cast<acc_t>(val[i]);
    }
  }

  const int64_t unique = static_cast<int64_t>(sums.size());
  std::vector<int64_t> order(unique);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return keys[slot_of_entry[a]] < keys[slot_of_entry[b]]; });
  out_idx = at::empty({unique}, at::TensorOptions().dtype(c10::CppTypeToScalarType<index_t>::value));
  out_val = at::empty({unique}, at::TensorOptions().dtype(c10::CppTypeToScalarType<scalar_t>::value));
  auto* oi = out_idx.data_ptr<index_t>();
  auto* ov = out_val.data_ptr<scalar_t>();
  for (int64_t u = 0; u < unique; ++u) {
    oi[u] = static_cast<index_t>(keys[slot_of_entry[order[u]]] - 1);
    ov[u] = static_cast<scalar_t>(sums[order[u]]);
  }
}

std::tuple<at::Tensor, at::Tensor> aggregate_cpu(const at::Tensor& indices, const at::Tensor& values, int64_t numel,
                                                 int64_t num_partitions, int64_t seed, int64_t partition) {
  check_pair(indices, values);
  check_partitions(num_partitions);
  TORCH_CHECK(numel >= 0, "numel must be >= 0, got ", numel);
  TORCH_CHECK(partition < num_partitions, "partition must be < num_partitions, got ", partition);
  at::Tensor out_idx, out_val;
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "zen_aggregate", [&] {
    AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "zen_aggregate", [&] {
      aggregate<index_t, scalar_t>(indices.const_data_ptr<index_t>(), values.const_data_ptr<scalar_t>(),
                                   indices.numel(), numel, num_partitions, seed, partition, out_idx, out_val);
    });
  });
  return {out_idx, out_val};
}

}  // namespace

TORCH_LIBRARY_IMPL(zen, CPU, m) { m.impl("aggregate", &aggregate_cpu); }

}  // namespace zen
