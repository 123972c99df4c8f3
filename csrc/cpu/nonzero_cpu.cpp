// Non-zero extraction: one pass over the dense buffer, 64 elements tested at once; and its block
// variants (a block of b consecutive elements is sent whole when any of them is non-zero).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "zen/bits.h"
#include "zen/checks.h"
#include "zen/zero_test.h"

namespace zen {
namespace {

// Bit j of the result: whether element j of the `count` (<= 64) at bits is a non-zero.
template <typename bits_t, bits_t kMask>
inline uint64_t nonzero_mask(const bits_t* bits, int64_t count) {
  uint64_t mask = 0;
  for (int64_t j = 0; j < count; ++j) mask |= uint64_t((bits[j] & kMask) != 0) << j;
  return mask;
}

// The same for 64 elements, 16 bytes compared at a time where SSE2 is (x86-64 always has it).
template <typename bits_t, bits_t kMask>
inline uint64_t nonzero_mask64(const bits_t* bits) {
#if defined(__SSE2__)
  if constexpr (sizeof(bits_t) <= 4) {
    // kMask repeated over 16 bytes: the bits that make an element non-zero
    bits_t lanes[16 / sizeof(bits_t)];
    std::fill(lanes, lanes + 16 / sizeof(bits_t), kMask);
    const __m128i keep = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lanes)), zero = _mm_setzero_si128();
    auto is_zero = [&](int j) {  // the j-th 16 bytes compared with zero, lane by lane
      const __m128i v = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits) + j), keep);
      if constexpr (sizeof(bits_t) == 4) return _mm_cmpeq_epi32(v, zero);
      if constexpr (sizeof(bits_t) == 2) return _mm_cmpeq_epi16(v, zero);
      return _mm_cmpeq_epi8(v, zero);
    };
    uint64_t mask = 0;
    if constexpr (sizeof(bits_t) == 4) {
      for (int j = 0; j < 16; ++j)
        mask |= uint64_t(_mm_movemask_ps(_mm_castsi128_ps(is_zero(j))) ^ 0xF) << (4 * j);
    } else if constexpr (sizeof(bits_t) == 2) {
      for (int j = 0; j < 4; ++j)
        mask |= uint64_t(_mm_movemask_epi8(_mm_packs_epi16(is_zero(2 * j), is_zero(2 * j + 1))) ^ 0xFFFF) << (16 * j);
    } else {
      for (int j = 0; j < 4; ++j) mask |= uint64_t(_mm_movemask_epi8(is_zero(j)) ^ 0xFFFF) << (16 * j);
    }
    return mask;
  }
#endif
  return nonzero_mask<bits_t, kMask>(bits, 64);
}

template <typename scalar_t, typename index_t>
void extract(const scalar_t* data, int64_t numel, at::Tensor& indices, at::Tensor& values) {
  using Bits = ZeroTest<scalar_t>;
  using bits_t = typename Bits::bits_t;
  const auto* bits = reinterpret_cast<const bits_t*>(data);

  // One pass over the data, in chunks that stay in cache: a chunk's non-zero masks (64 elements a word) are
  // computed and counted, then its non-zeros are written from the masks (bit by bit, from the cached
  // chunk) into a stage of that size; at the end the chunks' stages are copied to the outputs at their
  // prefix sums. Stages are tensors (torch's allocator, visible to its memory profiler).
  constexpr int64_t kChunk = 1 << 16;  // elements: a multiple of 64
  const int64_t num_chunks = (numel + kChunk - 1) / kChunk;
  const auto index_type = at::TensorOptions().dtype(c10::CppTypeToScalarType<index_t>::value);
  const auto value_type = at::TensorOptions().dtype(c10::CppTypeToScalarType<scalar_t>::value);
  std::vector<at::Tensor> stage_idx(num_chunks), stage_val(num_chunks);
  std::vector<int64_t> offset(num_chunks + 1, 0);
  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    uint64_t masks[kChunk / 64];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * kChunk, size = std::min(numel - begin, kChunk), words = (size + 63) / 64;
      const bits_t* chunk = bits + begin;
      int64_t count = 0;
      for (int64_t w = 0; w < words; ++w) {
        masks[w] = 64 * (w + 1) <= size ? nonzero_mask64<bits_t, Bits::kMask>(chunk + 64 * w)
                                        : nonzero_mask<bits_t, Bits::kMask>(chunk + 64 * w, size - 64 * w);
        count += popcount64(masks[w]);
      }
      offset[c + 1] = count;
      if (count == 0) continue;
      stage_idx[c] = at::empty({count}, index_type);
      stage_val[c] = at::empty({count}, value_type);
      index_t* out_idx = stage_idx[c].data_ptr<index_t>();
      bits_t* out_val = reinterpret_cast<bits_t*>(stage_val[c].data_ptr());
      for (int64_t w = 0; w < words; ++w) {
        for (uint64_t m = masks[w]; m; m &= m - 1) {
          const int64_t j = 64 * w + __builtin_ctzll(m);
          *out_idx++ = static_cast<index_t>(begin + j);
          *out_val++ = chunk[j];
        }
      }
    }
  });
  for (int64_t c = 0; c < num_chunks; ++c) offset[c + 1] += offset[c];
  indices = at::empty({offset[num_chunks]}, index_type);
  values = at::empty({offset[num_chunks]}, value_type);
  auto* out_idx = indices.data_ptr<index_t>();
  auto* out_val = reinterpret_cast<bits_t*>(values.data_ptr());
  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t count = offset[c + 1] - offset[c];
      if (count == 0) continue;  // no stage (and memcpy must not see a null pointer, even for 0 bytes)
      std::memcpy(out_idx + offset[c], stage_idx[c].data_ptr(), count * sizeof(index_t));
      std::memcpy(out_val + offset[c], stage_val[c].data_ptr(), count * sizeof(bits_t));
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
  // Pass 1 reads every block once and marks those holding a non-zero (a byte per block); pass 2 copies the
  // marked blocks alone to the prefix sums of the chunks' counts, so zero blocks are read once.
  const int64_t chunk = std::max<int64_t>(1, (1 << 16) / width);  // blocks per chunk
  const int64_t num_chunks = (blocks + chunk - 1) / chunk;
  std::vector<uint8_t> marked(blocks);
  std::vector<int64_t> offset(num_chunks + 1, 0);
  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t count = 0;
      for (int64_t b = c * chunk, e = std::min(blocks, b + chunk); b < e; ++b) {
        marked[b] = any_nonzero<bits_t, Bits::kMask>(bits + b * width, width);
        count += marked[b];
      }
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
        if (!marked[b]) continue;
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
