// Aggregation of one partition: the (index, value) pairs every peer pushed, summed per index, into the
// union ascending (the order the hash bitmap and the scatter expect). Sums run in arrival order (peer 0
// first), in float for half types, so the result is deterministic. A value may be a row of b values (a
// block of the tensor): rows are summed element by element, the same way.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <queue>
#include <vector>

#include "zen/checks.h"
#include "zen/hash.h"

namespace zen {
namespace {

template <typename index_t>
void validate(const index_t* idx, int64_t count, int64_t numel, int64_t num_partitions, int64_t seed,
              int64_t partition) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t index = static_cast<int64_t>(idx[i]);
    TORCH_CHECK(index >= 0 && index < numel, "received index ", index, " is outside [0, ", numel,
                "): corrupt or mismatched buffer");
    TORCH_CHECK(partition < 0 || partition_of(index, (uint64_t)seed, (uint32_t)num_partitions) == partition,
                "received index ", index, " does not belong to partition ", partition,
                ": corrupt buffer or peers with different seeds");
  }
}

// Start of every maximal ascending run (and count at the end).
template <typename index_t>
std::vector<int64_t> ascending_runs(const index_t* idx, int64_t count) {
  std::vector<int64_t> starts{0};
  for (int64_t i = 1; i < count; ++i)
    if (idx[i] <= idx[i - 1]) starts.push_back(i);
  starts.push_back(count);
  return starts;
}

template <typename index_t, typename scalar_t>
void aggregate(const index_t* idx, const scalar_t* val, int64_t count, int64_t width, int64_t numel,
               at::Tensor& out_idx, at::Tensor& out_val) {
  using acc_t = at::opmath_type<scalar_t>;
  // Scratch as tensors (torch's allocator, visible to its memory profiler): count indices and sums.
  at::Tensor idx_buf = at::empty({count}, at::TensorOptions().dtype(c10::CppTypeToScalarType<index_t>::value));
  at::Tensor sum_buf = at::empty({count, width}, at::TensorOptions().dtype(c10::CppTypeToScalarType<acc_t>::value));
  index_t* union_idx = idx_buf.data_ptr<index_t>();
  acc_t* sums = sum_buf.data_ptr<acc_t>();
  int64_t unique = 0;
  auto add = [&](int64_t i) {
    const scalar_t* row = val + i * width;
    if (unique > 0 && union_idx[unique - 1] == idx[i]) {
      acc_t* sum = sums + (unique - 1) * width;
      for (int64_t j = 0; j < width; ++j) sum[j] += static_cast<acc_t>(row[j]);
    } else {
      union_idx[unique] = idx[i];
      acc_t* sum = sums + unique++ * width;
      for (int64_t j = 0; j < width; ++j) sum[j] = static_cast<acc_t>(row[j]);
    }
  };
  const std::vector<int64_t> runs = ascending_runs(idx, count);
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1;
  // Every index is < numel (validated): where numel <= the index type's largest value, that value marks an
  // exhausted run.
  constexpr index_t kPast = std::numeric_limits<index_t>::max();
  if (num_runs <= 16 && numel <= kPast) {
    // The pieces from the peers arrive ascending: a k-way merge, for few runs by a scan of their heads (k - 1
    // compares the compiler makes branch-free, where a heap's pops mispredict). An exhausted run's head is
    // past every index. Ties take the earlier run first, so the sum runs in peer order, as a sequential
    // sum would.
    index_t heads[16];
    int64_t cursor[16];
    for (int64_t r = 0; r < num_runs; ++r) {
      cursor[r] = runs[r];
      heads[r] = cursor[r] < runs[r + 1] ? idx[cursor[r]] : kPast;
    }
    for (;;) {
      int64_t best = 0;
      for (int64_t r = 1; r < num_runs; ++r) best = heads[r] < heads[best] ? r : best;
      if (heads[best] == kPast) break;
      add(cursor[best]++);
      heads[best] = cursor[best] < runs[best + 1] ? idx[cursor[best]] : kPast;
    }
  } else if (num_runs <= 256) {
    // More runs: the same merge with a heap of their heads.
    using Head = std::pair<index_t, int64_t>;  // (index, run)
    std::priority_queue<Head, std::vector<Head>, std::greater<Head>> heads;
    std::vector<int64_t> cursor(runs.begin(), runs.end() - 1);
    for (int64_t r = 0; r < num_runs; ++r)
      if (cursor[r] < runs[r + 1]) heads.push({idx[cursor[r]], r});
    while (!heads.empty()) {
      const int64_t r = heads.top().second;
      heads.pop();
      add(cursor[r]++);
      if (cursor[r] < runs[r + 1]) heads.push({idx[cursor[r]], r});
    }
  } else {
    // Unordered input (e.g. pieces from the hash-table partition): a stable sort by index.
    at::Tensor order_buf = at::arange(count, at::TensorOptions().dtype(at::kLong));
    int64_t* order = order_buf.data_ptr<int64_t>();
    std::stable_sort(order, order + count, [&](int64_t a, int64_t b) { return idx[a] < idx[b]; });
    for (int64_t k = 0; k < count; ++k) add(order[k]);
  }
  out_idx = idx_buf.narrow(0, 0, unique).clone();
  out_val = sum_buf.narrow(0, 0, unique).to(c10::CppTypeToScalarType<scalar_t>::value, /*non_blocking=*/false,
                                            /*copy=*/true);
}

std::tuple<at::Tensor, at::Tensor> aggregate_cpu(const at::Tensor& indices, const at::Tensor& values, int64_t numel,
                                                 int64_t num_partitions, int64_t seed, int64_t partition) {
  check_pair(indices, values);
  check_partitions(num_partitions);
  TORCH_CHECK(numel >= 0, "numel must be >= 0, got ", numel);
  TORCH_CHECK(partition < num_partitions, "partition must be < num_partitions, got ", partition);
  at::Tensor out_idx, out_val;
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "zen_aggregate", [&] {
    validate(indices.const_data_ptr<index_t>(), indices.numel(), numel, num_partitions, seed, partition);
    AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "zen_aggregate", [&] {
      aggregate<index_t, scalar_t>(indices.const_data_ptr<index_t>(), values.const_data_ptr<scalar_t>(),
                                   indices.numel(), row_width(values), numel, out_idx, out_val);
    });
  });
  return {out_idx, values.dim() == 1 ? out_val.view({-1}) : out_val};
}

}  // namespace

TORCH_LIBRARY_IMPL(zen, CPU, m) { m.impl("aggregate", &aggregate_cpu); }

}  // namespace zen
