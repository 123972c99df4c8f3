// Scatter of (indices, values) into a dense output: out[indices[i]] = values[i], bounds checked first.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "zen/checks.h"

namespace zen {
namespace {

void scatter_cpu(at::Tensor& out, const at::Tensor& indices, const at::Tensor& values) {
  check_pair(indices, values);
  check_1d(out, "out");
  TORCH_CHECK(out.scalar_type() == values.scalar_type(), "out and values must have the same dtype, got ",
              out.scalar_type(), " and ", values.scalar_type());
  const int64_t numel = out.numel(), count = indices.numel();
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "zen_scatter", [&] {
    const index_t* idx = indices.const_data_ptr<index_t>();
    if (count > 0) {
      const auto [lo, hi] = std::minmax_element(idx, idx + count);
      TORCH_CHECK(*lo >= 0 && *hi < numel, "scatter index out of range: [", (int64_t)*lo, ", ", (int64_t)*hi,
                  "] for an output of ", numel, " elements");
    }
    AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "zen_scatter", [&] {
      const scalar_t* val = values.const_data_ptr<scalar_t>();
      scalar_t* o = out.data_ptr<scalar_t>();
      at::parallel_for(0, count, 1 << 14, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) o[idx[i]] = val[i];
      });
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zen, CPU, m) { m.impl("scatter_", &scatter_cpu); }

}  // namespace zen
