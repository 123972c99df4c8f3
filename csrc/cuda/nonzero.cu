// Non-zero extraction. Pass 1 reads the dense buffer once, with 16-byte loads, and writes one bit per
// element (1/32 of an fp32 buffer) and a count per tile of 8192 elements. A scan of the tile counts and
// one host read of the total (to size the outputs) follow; pass 2 then walks the bits and gathers only
// the non-zero values, so the dense buffer is read about once in all.
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

}  // namespace

cudaError_t nonzero_count(const void* dense, int64_t numel, ValueKind kind, Workspace& ws, NonzeroPlan& plan,
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
  ZEN_CUDA_TRY(scan_tiles(plan.tile_ends, plan.num_tiles, ws, stream));
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

template cudaError_t nonzero_write<int32_t>(const NonzeroPlan&, int32_t*, void*, cudaStream_t);
template cudaError_t nonzero_write<int64_t>(const NonzeroPlan&, int64_t*, void*, cudaStream_t);

}  // namespace gpu
}  // namespace zen
