// Non-zero extraction: one pass over the dense buffer, blocks of 16 elements tested at once.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "zen/checks.h"
#include "zen/zero_test.h"

namespace zen {
namespace {

template <typename scalar_t, typename index_t>
void extract(const scalar_t* data, int64_t numel, at::Tensor& indices, at::Tensor& values) {
  using Bits = ZeroTest<scalar_t>;
  using bits_t = typename Bits::bits_t;
  constexpr int64_t kBlock = 16;
  const auto* bits = reinterpret_cast<const bits_t*>(data);

  // Contiguous chunks, each collecting its own non-zeros; then one copy into the outputs.
  const int64_t chunk = std::max<int64_t>(1 << 16, (numel + 4 * at::get_num_threads() - 1) / (4 * at::get_num_threads()));
  const int64_t num_chunks = (numel + chunk - 1) / chunk;
  std::vector<std::vector<index_t>> chunk_indices(num_chunks);
  std::vector<std::vector<bits_t>> chunk_values(num_chunks);

  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * chunk, end = std::min(numel, begin + chunk);
      auto& idx = chunk_indices[c];
      auto& val = chunk_values[c];
      int64_t i = begin;
      for (; i + kBlock <= end; i += kBlock) {
        bits_t any = 0;
        for (int64_t j = 0; j < kBlock; ++j) any |= bits[i + j] & Bits::kMask;
        if (any == 0) continue;
        for (int64_t j = 0; j < kBlock; ++j) {
          if (bits[i + j] & Bits::kMask) {
            idx.push_back(static_cast<index_t>(i + j));
            val.push_back(bits[i + j]);
          }
        }
      }
      for (; i < end; ++i) {
        if (bits[i] & Bits::kMask) {
          idx.push_back(static_cast<index_t>(i));
          val.push_back(bits[i]);
        }
      }
    }
  });

  std::vector<int64_t> offset(num_chunks + 1, 0);
  for (int64_t c = 0; c < num_chunks; ++c) offset[c + 1] = offset[c] + static_cast<int64_t>(chunk_indices[c].size());
  indices = at::empty({offset[num_chunks]}, at::TensorOptions().dtype(c10::CppTypeToScalarType<index_t>::value));
  values = at::empty({offset[num_chunks]}, at::TensorOptions().dtype(c10::CppTypeToScalarType<scalar_t>::value));
  auto* out_idx = indices.data_ptr<index_t>();
  auto* out_val = reinterpret_cast<bits_t*>(values.data_ptr());
  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const size_t n = chunk_indices[c].size();
      if (n == 0) continue;
      std::memcpy(out_idx + offset[c], chunk_indices[c].data(), n * sizeof(index_t));
      std::memcpy(out_val + offset[c], chunk_values[c].data(), n * sizeof(bits_t));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> nonzero_cpu(const at::Tensor& dense) {
  check_1d(dense, "dense");
  at::Tensor indices, values;
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, dense.scalar_type(), "zen_nonzero", [&] {
    if (index_type_for(dense.numel()) == at::kInt) {
      extract<scalar_t, int32_t>(dense.const_data_ptr<scalar_t>(), dense.numel(), indices, values);
    } else {
      extract<scalar_t, int64_t>(dense.const_data_ptr<scalar_t>(), dense.numel(), indices, values);
    }
  });
  return {indices, values};
}

}  // namespace

TORCH_LIBRARY_IMPL(zen, CPU, m) { m.impl("nonzero", &nonzero_cpu); }

}  // namespace zen
