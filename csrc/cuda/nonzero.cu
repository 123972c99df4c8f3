// Non-zero extraction. Pass 1 reads the dense buffer once, with 16-byte loads, and writes one bit per
// element (1/32 of an fp32 buffer) and a count per tile of 8192 elements. A scan of the tile counts and
// one host read of the total (to size the outputs) follow; pass 2 then walks the bits and gathers only
// the non-zero values, so the dense buffer is read about once in all.
// The block variants add one pass over those bits (a block holds a non-zero iff one of its bits is set),
// then gather the chosen blocks one thread per element, so the rows are read and written coalesced.
#include <cstring>

#include "kernels.cuh"

namespace zen {
namespace gpu {
namespace {
using namespace detail;

template <typename U>
struct IsNonzero {
  const U* data;
  U mask;
  __device__ bool operator()(int64_t e) const { return (__ldg(data + e) & mask) != 0; }
};

// One block per tile of kTileWords words (32 per warp). Full tiles of a 16-byte aligned buffer take the
// vector path: lane l's load i holds E elements of words [E i, E i + E) of its warp, G = 32 / E lanes
// share a word, and a butterfly OR over those G lanes assembles it. Anything else (the last, partial
// tile; a misaligned view) takes one ballot per word.
template <typename U>
__global__ void __launch_bounds__(kThreads)
    nonzero_mask_kernel(const U* data, int64_t numel, int64_t num_words, U mask, bool vectorized,
                        uint32_t* words, int64_t* tile_counts) {
  constexpr int E = 16 / sizeof(U);  // elements per 16-byte load
  constexpr int G = 32 / E;          // lanes per 32-bit word, and loads per lane for the warp's 32 words
  int64_t count = 0;
  if (vectorized && (static_cast<int64_t>(blockIdx.x) + 1) * kTileBits <= numel) {
    const int lane = threadIdx.x & 31;
    const int64_t warp_word0 = static_cast<int64_t>(blockIdx.x) * kTileWords + (threadIdx.x >> 5) * 32;
    const uint4* src = reinterpret_cast<const uint4*>(data + warp_word0 * 32) + lane;
    uint4 v[G];
#pragma unroll
    for (int i = 0; i < G; ++i) v[i] = __ldg(src + i * 32);  // all loads in flight before any use
#pragma unroll
    for (int i = 0; i < G; ++i) {
      U u[E];
      memcpy(u, &v[i], sizeof(u));
      uint32_t m = 0;
#pragma unroll
      for (int k = 0; k < E; ++k) m |= ((u[k] & mask) != 0 ? 1u : 0u) << k;
      m <<= E * (lane % G);
#pragma unroll
      for (int off = G / 2; off > 0; off >>= 1) m |= __shfl_xor_sync(kFullMask, m, off);
      if (lane % G == 0) {
        words[warp_word0 + E * i + lane / G] = m;
        count += __popc(m);
      }
    }
  } else {
    count = flag_tile_by_ballot(numel, num_words, IsNonzero<U>{data, mask}, words);
  }
  count = block_sum(count);
  if (threadIdx.x == 0) tile_counts[blockIdx.x] = count;
}

template <typename U, typename index_t>
struct NonzeroWriter {
  const U* data;
  index_t* indices;
  U* values;
  __device__ void operator()(int64_t k, int64_t pos) const {
    indices[k] = static_cast<index_t>(pos);
    values[k] = __ldg(data + pos);
  }
};

// Block b (of width elements) holds a non-zero iff one of the element bits [b width, (b + 1) width) is set.
struct BlockHasNonzero {
  const uint32_t* words;  // the element bits
  int64_t width;
  __device__ bool operator()(int64_t b) const {
    const int64_t lo = b * width, last = lo + width - 1;
    const int64_t w0 = lo >> 5, w1 = last >> 5;
    for (int64_t w = w0; w <= w1; ++w) {
      uint32_t m = words[w];
      if (w == w0) m &= ~0u << (lo & 31);
      if (w == w1) m &= ~0u >> (31 - (last & 31));
      if (m) return true;
    }
    return false;
  }
};

template <typename index_t>
struct IdWriter {
  index_t* ids;
  __device__ void operator()(int64_t k, int64_t block) const { ids[k] = static_cast<index_t>(block); }
};

// rows[k, j] = data[ids[k] width + j], one thread per element of the rows.
template <typename U, typename index_t>
__global__ void gather_blocks_kernel(const U* data, const index_t* ids, int64_t count, int64_t width, U* rows) {
  for (int64_t t = global_thread(); t < count * width; t += grid_stride()) {
    const int64_t k = t / width;
    rows[t] = __ldg(data + static_cast<int64_t>(ids[k]) * width + (t - k * width));
  }
}

// Pass 1 of nonzero: the element bits and the inclusive ends of their tile counts, left on the device.
cudaError_t mask_elements(const void* dense, int64_t numel, ValueKind kind, Workspace& ws, NonzeroPlan& plan,
                          cudaStream_t stream) {
  plan = NonzeroPlan{};
  plan.dense = dense;
  plan.numel = numel;
  plan.kind = kind;
  if (numel == 0) return cudaSuccess;
  plan.num_words = ceil_div(numel, 32);
  plan.num_tiles = ceil_div(plan.num_words, kTileWords);
  plan.words = ws.get_n<uint32_t>(plan.num_words);
  plan.tile_ends = ws.get_n<int64_t>(plan.num_tiles);
  const bool vectorized = reinterpret_cast<uintptr_t>(dense) % 16 == 0;
  ZEN_CUDA_TRY(with_bits(kind, [&](auto tag) {
    using U = decltype(tag);
    nonzero_mask_kernel<U><<<static_cast<unsigned>(plan.num_tiles), kThreads, 0, stream>>>(
        static_cast<const U*>(dense), numel, plan.num_words, nonzero_mask<U>(is_float(kind)), vectorized,
        plan.words, plan.tile_ends);
    return cudaGetLastError();
  }));
  return scan_tiles(plan.tile_ends, plan.num_tiles, ws, stream);
}

// Pass 2 of the block variants: the block bits and their tile ends, left on the device. Blocks of one
// element are the elements: their bits are reused as they are.
cudaError_t mask_blocks(const void* dense, int64_t num_blocks, int64_t width, ValueKind kind, Workspace& ws,
                        NonzeroBlocksPlan& plan, cudaStream_t stream) {
  plan = NonzeroBlocksPlan{};
  plan.width = width;
  plan.num_blocks = num_blocks;
  ZEN_CUDA_TRY(mask_elements(dense, num_blocks * width, kind, ws, plan.elements, stream));
  if (num_blocks == 0) return cudaSuccess;
  if (width == 1) {
    plan.words = plan.elements.words;
    plan.tile_ends = plan.elements.tile_ends;
    plan.num_words = plan.elements.num_words;
    plan.num_tiles = plan.elements.num_tiles;
    return cudaSuccess;
  }
  plan.num_words = ceil_div(num_blocks, 32);
  plan.num_tiles = ceil_div(plan.num_words, kTileWords);
  plan.words = ws.get_n<uint32_t>(plan.num_words);
  plan.tile_ends = ws.get_n<int64_t>(plan.num_tiles);
  flag_words_kernel<<<static_cast<unsigned>(plan.num_tiles), kThreads, 0, stream>>>(
      num_blocks, plan.num_words, BlockHasNonzero{plan.elements.words, width}, plan.words, plan.tile_ends);
  ZEN_CUDA_TRY(cudaGetLastError());
  return scan_tiles(plan.tile_ends, plan.num_tiles, ws, stream);
}

}  // namespace

cudaError_t nonzero_count(const void* dense, int64_t numel, ValueKind kind, Workspace& ws, NonzeroPlan& plan,
                          cudaStream_t stream) {
  ZEN_CUDA_TRY(mask_elements(dense, numel, kind, ws, plan, stream));
  if (numel == 0) return cudaSuccess;
  return read_to_host(&plan.nnz, plan.tile_ends + plan.num_tiles - 1, sizeof(int64_t), stream);
}

template <typename index_t>
cudaError_t nonzero_write(const NonzeroPlan& plan, index_t* indices, void* values, cudaStream_t stream) {
  if (plan.nnz == 0) return cudaSuccess;
  return with_bits(plan.kind, [&](auto tag) {
    using U = decltype(tag);
    const NonzeroWriter<U, index_t> writer{static_cast<const U*>(plan.dense), indices, static_cast<U*>(values)};
    return expand_bits(plan.words, plan.num_words, plan.tile_ends, writer, stream);
  });
}

cudaError_t nonzero_blocks_count(const void* dense, int64_t num_blocks, int64_t width, ValueKind kind, Workspace& ws,
                                 NonzeroBlocksPlan& plan, cudaStream_t stream) {
  ZEN_CUDA_TRY(mask_blocks(dense, num_blocks, width, kind, ws, plan, stream));
  if (num_blocks == 0) return cudaSuccess;
  return read_to_host(&plan.nnz_blocks, plan.tile_ends + plan.num_tiles - 1, sizeof(int64_t), stream);
}

template <typename index_t>
cudaError_t nonzero_blocks_write(const NonzeroBlocksPlan& plan, index_t* ids, void* rows, cudaStream_t stream) {
  if (plan.nnz_blocks == 0) return cudaSuccess;
  return with_bits(plan.elements.kind, [&](auto tag) {
    using U = decltype(tag);
    const auto* data = static_cast<const U*>(plan.elements.dense);
    if (plan.width == 1)  // a block is an element: nonzero's own writer
      return expand_bits(plan.words, plan.num_words, plan.tile_ends,
                         NonzeroWriter<U, index_t>{data, ids, static_cast<U*>(rows)}, stream);
    ZEN_CUDA_TRY(expand_bits(plan.words, plan.num_words, plan.tile_ends, IdWriter<index_t>{ids}, stream));
    gather_blocks_kernel<U, index_t><<<grid_for(plan.nnz_blocks * plan.width), kThreads, 0, stream>>>(
        data, ids, plan.nnz_blocks, plan.width, static_cast<U*>(rows));
    return cudaGetLastError();
  });
}

cudaError_t count_nonzero(const void* dense, int64_t num_blocks, int64_t width, ValueKind kind, int64_t* counts,
                          Workspace& ws, cudaStream_t stream) {
  ZEN_CUDA_TRY(cudaMemsetAsync(counts, 0, 2 * sizeof(int64_t), stream));
  NonzeroBlocksPlan plan;
  ZEN_CUDA_TRY(mask_blocks(dense, num_blocks, width, kind, ws, plan, stream));
  if (num_blocks == 0) return cudaSuccess;
  // The totals are the last tile ends: copied on the device, so the caller decides when to wait.
  ZEN_CUDA_TRY(cudaMemcpyAsync(counts, plan.elements.tile_ends + plan.elements.num_tiles - 1, sizeof(int64_t),
                               cudaMemcpyDeviceToDevice, stream));
  return cudaMemcpyAsync(counts + 1, plan.tile_ends + plan.num_tiles - 1, sizeof(int64_t), cudaMemcpyDeviceToDevice,
                         stream);
}

template cudaError_t nonzero_write<int32_t>(const NonzeroPlan&, int32_t*, void*, cudaStream_t);
template cudaError_t nonzero_write<int64_t>(const NonzeroPlan&, int64_t*, void*, cudaStream_t);
template cudaError_t nonzero_blocks_write<int32_t>(const NonzeroBlocksPlan&, int32_t*, void*, cudaStream_t);
template cudaError_t nonzero_blocks_write<int64_t>(const NonzeroBlocksPlan&, int64_t*, void*, cudaStream_t);

}  // namespace gpu
}  // namespace zen
