// Non-zero extraction: one pass over the dense buffer, blocks of 16 elements tested at once; and its block
// variants (a block of b consecutive elements is sent whole when any of them is non-zero).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
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

  // Pass 1 counts the non-zeros of each chunk (a branch-free loop the compiler vectorises); pass 2 writes
  // them at the chunk's prefix sum. Each block of 16 is OR-tested first, so zero runs cost one load each.
  const int64_t chunk = 1 << 16;
  const int64_t num_chunks = (numel + chunk - 1) / chunk;
  std::vector<int64_t> offset(num_chunks + 1, 0);
  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t count = 0;
      for (int64_t i = c * chunk, e = std::min(numel, i + chunk); i < e; ++i) count += (bits[i] & Bits::kMask) != 0;
      offset[c + 1] = count;
    }
  });
  for (int64_t c = 0; c < num_chunks; ++c) offset[c + 1] += offset[c];
  indices = at::empty({offset[num_chunks]}, at::TensorOptions().dtype(c10::CppTypeToScalarType<index_t>::value));
  values = at::empty({offset[num_chunks]}, at::TensorOptions().dtype(c10::CppTypeToScalarType<scalar_t>::value));
  auto* out_idx = indices.data_ptr<index_t>();
  auto* out_val = reinterpret_cast<bits_t*>(values.data_ptr());
  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    index_t stage_idx[kBlock];
    bits_t stage_val[kBlock];
    for (int64_t c = c0; c < c1; ++c) {
      int64_t out = offset[c];
      const int64_t end = std::min(numel, (c + 1) * chunk);
      int64_t i = c * chunk;
      for (; i + kBlock <= end; i += kBlock) {
        bits_t any = 0;
        for (int64_t j = 0; j < kBlock; ++j) any |= bits[i + j] & Bits::kMask;
        if (any == 0) continue;
        // Branch-free into a stage (every slot written, the cursor advances on non-zeros), then one copy.
        int k = 0;
        for (int64_t j = 0; j < kBlock; ++j) {
          stage_idx[k] = static_cast<index_t>(i + j);
          stage_val[k] = bits[i + j];
          k += (bits[i + j] & Bits::kMask) != 0;
        }
        std::memcpy(out_idx + out, stage_idx, k * sizeof(index_t));
        std::memcpy(out_val + out, stage_val, k * sizeof(bits_t));
        out += k;
      }
      for (; i < end; ++i) {
        if (bits[i] & Bits::kMask) {
          out_idx[out] = static_cast<index_t>(i);
          out_val[out++] = bits[i];
        }
      }
      TORCH_INTERNAL_ASSERT(out == offset[c + 1]);
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

// Whether the width elements at bits hold a non-zero (a branch-free OR the compiler vectorises).
template <typename bits_t, bits_t kMask>
inline bool any_nonzero(const bits_t* bits, int64_t width) {
  bits_t any = 0;
  for (int64_t j = 0; j < width; ++j) any |= bits[j] & kMask;
  return any != 0;
}

// Blocks of `width` consecutive elements holding a non-zero: their ids ascending, and the blocks whole.
template <typename scalar_t, typename index_t>
void extract_blocks(const scalar_t* data, int64_t blocks, int64_t width, at::Tensor& ids, at::Tensor& rows) {
  using Bits = ZeroTest<scalar_t>;
  using bits_t = typename Bits::bits_t;
  const auto* bits = reinterpret_cast<const bits_t*>(data);
  const int64_t chunk = std::max<int64_t>(1, (1 << 16) / width);  // blocks per chunk
  const int64_t num_chunks = (blocks + chunk - 1) / chunk;
  std::vector<int64_t> offset(num_chunks + 1, 0);
  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t count = 0;
      for (int64_t b = c * chunk, e = std::min(blocks, b + chunk); b < e; ++b)
        count += any_nonzero<bits_t, Bits::kMask>(bits + b * width, width);
      offset[c + 1] = count;
    }
  });
  for (int64_t c = 0; c < num_chunks; ++c) offset[c + 1] += offset[c];
  ids = at::empty({offset[num_chunks]}, at::TensorOptions().dtype(c10::CppTypeToScalarType<index_t>::value));
  rows = at::empty({offset[num_chunks], width}, at::TensorOptions().dtype(c10::CppTypeToScalarType<scalar_t>::value));
  auto* out_ids = ids.data_ptr<index_t>();
  auto* out_rows = reinterpret_cast<bits_t*>(rows.data_ptr());
  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t out = offset[c];
      for (int64_t b = c * chunk, e = std::min(blocks, b + chunk); b < e; ++b) {
        if (!any_nonzero<bits_t, Bits::kMask>(bits + b * width, width)) continue;
        out_ids[out] = static_cast<index_t>(b);
        std::memcpy(out_rows + out * width, bits + b * width, width * sizeof(bits_t));
        ++out;
      }
      TORCH_INTERNAL_ASSERT(out == offset[c + 1]);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> nonzero_blocks_cpu(const at::Tensor& dense, int64_t block_size) {
  check_1d(dense, "dense");
  const int64_t blocks = num_blocks(dense, block_size);
  at::Tensor ids, rows;
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, dense.scalar_type(), "zen_nonzero_blocks", [&] {
    if (index_type_for(blocks) == at::kInt) {
      extract_blocks<scalar_t, int32_t>(dense.const_data_ptr<scalar_t>(), blocks, block_size, ids, rows);
    } else {
      extract_blocks<scalar_t, int64_t>(dense.const_data_ptr<scalar_t>(), blocks, block_size, ids, rows);
    }
  });
  return {ids, rows};
}

// [non-zero elements, blocks of block_size holding a non-zero], in one pass.
template <typename scalar_t>
void count_blocks(const scalar_t* data, int64_t blocks, int64_t width, int64_t* out) {
  using Bits = ZeroTest<scalar_t>;
  using bits_t = typename Bits::bits_t;
  const auto* bits = reinterpret_cast<const bits_t*>(data);
  const int64_t chunk = std::max<int64_t>(1, (1 << 16) / width);
  const int64_t num_chunks = (blocks + chunk - 1) / chunk;
  std::vector<int64_t> elements(num_chunks, 0), nonzero_blocks(num_chunks, 0);
  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t count = 0, in_blocks = 0;
      for (int64_t b = c * chunk, e = std::min(blocks, b + chunk); b < e; ++b) {
        int64_t here = 0;
        for (int64_t j = 0; j < width; ++j) here += (bits[b * width + j] & Bits::kMask) != 0;
        count += here;
        in_blocks += here != 0;
      }
      elements[c] = count;
      nonzero_blocks[c] = in_blocks;
    }
  });
  out[0] = out[1] = 0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    out[0] += elements[c];
    out[1] += nonzero_blocks[c];
  }
}

at::Tensor count_nonzero_cpu(const at::Tensor& dense, int64_t block_size) {
  check_1d(dense, "dense");
  const int64_t blocks = num_blocks(dense, block_size);
  auto out = at::zeros({2}, at::TensorOptions().dtype(at::kLong));
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, dense.scalar_type(), "zen_count_nonzero", [&] {
    count_blocks<scalar_t>(dense.const_data_ptr<scalar_t>(), blocks, block_size, out.data_ptr<int64_t>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(zen, CPU, m) {
  m.impl("nonzero", &nonzero_cpu);
  m.impl("nonzero_blocks", &nonzero_blocks_cpu);
  m.impl("count_nonzero", &count_nonzero_cpu);
}

}  // namespace zen
