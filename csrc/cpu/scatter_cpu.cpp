// Scatter of (indices, values) into a dense output: out[indices[i]] = values[i], bounds checked first. With
// rows of b values ([k, b] values), index i is block i of the output: out[i b, (i + 1) b) = values[i].
// scatter_pieces_ writes several pieces (disjoint index sets, each ascending, together spread over the
// whole output: zen's n pulled partitions) block by block of the output, so a block is read from memory
// once while every piece writes into it, not once per piece.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "zen/checks.h"

namespace zen {
namespace {

constexpr int64_t kBlockBytes = 64 << 10;  // a block of the output stays in a core's L2 while the pieces write

// Fails naming the range when an index lies outside [0, numel); whether the indices ascend strictly.
template <typename index_t>
bool check_range(const index_t* idx, int64_t count, int64_t numel) {
  if (count == 0) return true;
  index_t lo = idx[0], hi = idx[0];
  bool ascending = true;
  for (int64_t i = 1; i < count; ++i) {
    ascending &= idx[i - 1] < idx[i];
    lo = std::min(lo, idx[i]);
    hi = std::max(hi, idx[i]);
  }
  TORCH_CHECK(lo >= 0 && hi < numel, "scatter index out of range: [", (int64_t)lo, ", ", (int64_t)hi,
              "] for an output of ", numel, " blocks");
  return ascending;
}

template <typename scalar_t>
inline void write_row(scalar_t* out, int64_t at, const scalar_t* val, int64_t i, int64_t width) {
  if (width == 1) {
    out[at] = val[i];
  } else {
    std::memcpy(out + at * width, val + i * width, width * sizeof(scalar_t));
  }
}

void scatter_cpu(at::Tensor& out, const at::Tensor& indices, const at::Tensor& values) {
  check_pair(indices, values);
  const int64_t numel = check_out(out, values), count = indices.numel(), width = row_width(values);
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "zen_scatter", [&] {
    const index_t* idx = indices.const_data_ptr<index_t>();
    check_range(idx, count, numel);
    AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "zen_scatter", [&] {
      const scalar_t* val = values.const_data_ptr<scalar_t>();
      scalar_t* o = out.data_ptr<scalar_t>();
      at::parallel_for(0, count, std::max<int64_t>(1, (1 << 14) / width), [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) write_row(o, idx[i], val, i, width);
      });
    });
  });
}

void scatter_pieces_cpu(at::Tensor& out, at::TensorList indices, at::TensorList values) {
  const int64_t numel = check_pieces(out, indices, values);
  if (indices.empty()) return;
  const int64_t width = row_width(values[0]);
  const int64_t pieces = indices.size();
  AT_DISPATCH_INDEX_TYPES(indices[0].scalar_type(), "zen_scatter_pieces", [&] {
    std::vector<const index_t*> idx(pieces);
    std::vector<int64_t> count(pieces);
    std::vector<char> ascending(pieces);
    std::vector<const void*> vals(pieces);
    for (int64_t p = 0; p < pieces; ++p) {  // every piece checked before anything is written
      idx[p] = indices[p].const_data_ptr<index_t>();
      count[p] = indices[p].numel();
      ascending[p] = check_range(idx[p], count[p], numel);
      vals[p] = values[p].const_data_ptr();
    }
    AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, values[0].scalar_type(), "zen_scatter_pieces", [&] {
      scalar_t* o = out.data_ptr<scalar_t>();
      const int64_t block = std::max<int64_t>(1, kBlockBytes / static_cast<int64_t>(sizeof(scalar_t) * width));
      const int64_t blocks = (numel + block - 1) / block;
      at::parallel_for(0, blocks, 16, [&](int64_t first, int64_t last) {
        std::vector<int64_t> cursor(pieces);
        for (int64_t p = 0; p < pieces; ++p)
          cursor[p] = ascending[p] ? std::lower_bound(idx[p], idx[p] + count[p], first * block) - idx[p] : 0;
        for (int64_t b = first; b < last; ++b) {
          const int64_t end = std::min(numel, (b + 1) * block);
          for (int64_t p = 0; p < pieces; ++p) {
            if (!ascending[p]) continue;
            const index_t* ix = idx[p];
            const scalar_t* val = static_cast<const scalar_t*>(vals[p]);
            int64_t i = cursor[p];
            for (; i < count[p] && ix[i] < end; ++i) write_row(o, ix[i], val, i, width);
            cursor[p] = i;
          }
        }
      });
      for (int64_t p = 0; p < pieces; ++p) {  // a piece out of order is written as it comes
        if (ascending[p]) continue;
        const scalar_t* val = static_cast<const scalar_t*>(vals[p]);
        for (int64_t i = 0; i < count[p]; ++i) write_row(o, idx[p][i], val, i, width);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zen, CPU, m) {
  m.impl("scatter_", &scatter_cpu);
  m.impl("scatter_pieces_", &scatter_pieces_cpu);
}

}  // namespace zen
