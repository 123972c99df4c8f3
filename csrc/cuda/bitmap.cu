// The hash bitmap on the GPU (format: bitmap_cpu.cpp).
// - index sets: partition id of every position, then a stable radix sort of the positions by it (so each
//   I_j stays ascending); offsets by binary search in the sorted ids. Built once per (numel, seed).
// - encode: each index finds its rank r in the index set by binary search and sets bit r with atomicOr
//   on a 32-bit word (bit r of the little-endian word array is byte r / 8, bit r % 8, as required).
// - decode: the bitmap as words with a count per tile, a scan, then the compaction shared with nonzero
//   writes index_set[r] for every set bit r.
// Invalid inputs are found on the device (smallest offending position by atomicMin, so the error is the
// one the CPU op meets first) and reported after one synchronisation.
#include <cub/device/device_radix_sort.cuh>

#include "kernels.cuh"
#include "zen/hash.h"

namespace zen {
namespace gpu {
namespace {
using namespace detail;

__global__ void partition_of_position_kernel(int64_t numel, uint64_t seed, uint32_t n, uint32_t* part) {
  for (int64_t i = global_thread(); i < numel; i += grid_stride()) part[i] = partition_of(i, seed, n);
}

// offsets[j] = first position of the sorted ids holding j or more (sorted == null: all ids are 0).
__global__ void offsets_kernel(const uint32_t* sorted, int64_t numel, uint32_t n, int64_t* offsets) {
  for (int64_t j = global_thread(); j <= n; j += grid_stride()) {
    int64_t lo = 0, hi = numel;
    if (sorted == nullptr) {
      lo = j == 0 ? 0 : numel;
    } else {
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (sorted[mid] < static_cast<uint32_t>(j)) lo = mid + 1; else hi = mid;
      }
    }
    offsets[j] = lo;
  }
}

// Error code 2 i: indices[i] does not exceed indices[i - 1]; 2 i + 1: indices[i] is not in the set. The
// smallest code is the CPU op's first error (it tests the order before the membership).
template <typename index_t>
__global__ void encode_kernel(const index_t* indices, int64_t count, const index_t* set, int64_t bits,
                              uint32_t* words, unsigned long long* first_bad) {
  for (int64_t i = global_thread(); i < count; i += grid_stride()) {
    const index_t v = indices[i];
    if (i > 0 && !(v > indices[i - 1])) {
      atomicMin(first_bad, 2ull * static_cast<unsigned long long>(i));
      continue;
    }
    int64_t lo = 0, hi = bits;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (set[mid] < v) lo = mid + 1; else hi = mid;
    }
    if (lo == bits || set[lo] != v) {
      atomicMin(first_bad, 2ull * static_cast<unsigned long long>(i) + 1);
      continue;
    }
    atomicOr(&words[lo >> 5], 1u << (lo & 31));
  }
}

// The bitmap's bytes as words (bytes past the end read as 0), bits at positions >= bits cleared and
// flagged, and the set bits per tile.
__global__ void __launch_bounds__(kThreads)
    decode_count_kernel(const uint8_t* bitmap, int64_t bits, int64_t num_words, uint32_t* words, int64_t* tile_counts,
                        unsigned int* past_end) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kTileWords + threadIdx.x;
  const int64_t nbytes = (bits + 7) / 8;
  uint32_t word = 0;
  if (w < num_words) {
    for (int b = 0; b < 4; ++b)
      if (4 * w + b < nbytes) word |= static_cast<uint32_t>(bitmap[4 * w + b]) << (8 * b);
    const int64_t valid = bits - 32 * w;  // >= 1, as w < ceil(bits / 32)
    if (valid < 32) {
      const uint32_t keep = (1u << valid) - 1u;
      if (word & ~keep) *past_end = 1;
      word &= keep;
    }
    words[w] = word;
  }
  const int64_t count = block_sum(__popc(word));
  if (threadIdx.x == 0) tile_counts[blockIdx.x] = count;
}

template <typename index_t>
struct DecodeWriter {
  const index_t* set;
  index_t* out;
  __device__ void operator()(int64_t k, int64_t r) const { out[k] = set[r]; }
};

}  // namespace

template <typename index_t>
cudaError_t bitmap_index_sets(int64_t numel, uint32_t num_partitions, uint64_t seed, index_t* sets, int64_t* offsets,
                              Workspace& ws, cudaStream_t stream) {
  const uint32_t n = num_partitions;
  if (numel == 0) return cudaMemsetAsync(offsets, 0, sizeof(int64_t) * (n + 1), stream);
  int key_bits = 0;
  while ((uint64_t{1} << key_bits) < n) ++key_bits;
  if (key_bits == 0) {  // one partition: I_0 = [0, numel)
    iota_kernel<<<grid_for(numel), kThreads, 0, stream>>>(sets, numel);
    ZEN_CUDA_TRY(cudaGetLastError());
    offsets_kernel<<<1, 32, 0, stream>>>(nullptr, numel, n, offsets);
    return cudaGetLastError();
  }
  auto* part = ws.get_n<uint32_t>(numel);
  auto* part_sorted = ws.get_n<uint32_t>(numel);
  auto* positions = ws.get_n<index_t>(numel);
  partition_of_position_kernel<<<grid_for(numel), kThreads, 0, stream>>>(numel, seed, n, part);
  ZEN_CUDA_TRY(cudaGetLastError());
  iota_kernel<<<grid_for(numel), kThreads, 0, stream>>>(positions, numel);
  ZEN_CUDA_TRY(cudaGetLastError());
  ZEN_CUDA_TRY(run_cub(ws, [&](void* temp, size_t& bytes) {
    return cub::DeviceRadixSort::SortPairs(temp, bytes, part, part_sorted, positions, sets, numel, 0, key_bits, stream);
  }));
  offsets_kernel<<<grid_for(int64_t{n} + 1), kThreads, 0, stream>>>(part_sorted, numel, n, offsets);
  return cudaGetLastError();
}

template <typename index_t>
cudaError_t bitmap_encode(const index_t* indices, int64_t count, const index_t* index_set, int64_t bits,
                          uint8_t* bitmap, Workspace& ws, BitmapEncodeResult& result, cudaStream_t stream) {
  result = BitmapEncodeResult{};
  const int64_t nbytes = (bits + 7) / 8;
  const int64_t num_words = ceil_div(bits, 32);
  if (nbytes > 0) ZEN_CUDA_TRY(cudaMemsetAsync(bitmap, 0, nbytes, stream));
  if (count == 0) return cudaSuccess;
  // Words in scratch memory: the bitmap itself need not be 4-byte aligned or a whole number of words.
  auto* words = ws.get_n<uint32_t>(num_words);
  auto* first_bad = ws.get_n<unsigned long long>(1);
  ZEN_CUDA_TRY(cudaMemsetAsync(words, 0, sizeof(uint32_t) * num_words, stream));
  ZEN_CUDA_TRY(cudaMemsetAsync(first_bad, 0xff, sizeof(unsigned long long), stream));
  encode_kernel<<<grid_for(count), kThreads, 0, stream>>>(indices, count, index_set, bits, words, first_bad);
  ZEN_CUDA_TRY(cudaGetLastError());
  if (nbytes > 0) ZEN_CUDA_TRY(cudaMemcpyAsync(bitmap, words, nbytes, cudaMemcpyDeviceToDevice, stream));

  unsigned long long code = 0;
  ZEN_CUDA_TRY(read_to_host(&code, first_bad, sizeof(code), stream));
  if (code != ~0ull) {
    result.first_bad = static_cast<int64_t>(code / 2);
    result.not_ascending = code % 2 == 0;
    index_t bad = 0;
    ZEN_CUDA_TRY(read_to_host(&bad, indices + result.first_bad, sizeof(index_t), stream));
    result.bad_index = static_cast<int64_t>(bad);
  }
  return cudaSuccess;
}

cudaError_t bitmap_decode_count(const uint8_t* bitmap, int64_t bits, Workspace& ws, BitmapDecodePlan& plan,
                                cudaStream_t stream) {
  plan = BitmapDecodePlan{};
  plan.bits = bits;
  if (bits == 0) return cudaSuccess;
  plan.num_words = ceil_div(bits, 32);
  plan.num_tiles = ceil_div(plan.num_words, kTileWords);
  plan.words = ws.get_n<uint32_t>(plan.num_words);
  plan.tile_ends = ws.get_n<int64_t>(plan.num_tiles);
  auto* past_end = ws.get_n<unsigned int>(1);
  ZEN_CUDA_TRY(cudaMemsetAsync(past_end, 0, sizeof(unsigned int), stream));
  decode_count_kernel<<<static_cast<unsigned>(plan.num_tiles), kThreads, 0, stream>>>(
      bitmap, bits, plan.num_words, plan.words, plan.tile_ends, past_end);
  ZEN_CUDA_TRY(cudaGetLastError());
  ZEN_CUDA_TRY(scan_tiles(plan.tile_ends, plan.num_tiles, ws, stream));
  unsigned int flag = 0;
  ZEN_CUDA_TRY(cudaMemcpyAsync(&flag, past_end, sizeof(flag), cudaMemcpyDeviceToHost, stream));
  ZEN_CUDA_TRY(read_to_host(&plan.set_bits, plan.tile_ends + plan.num_tiles - 1, sizeof(int64_t), stream));
  plan.bits_past_end = flag != 0;
  return cudaSuccess;
}

template <typename index_t>
cudaError_t bitmap_decode_write(const BitmapDecodePlan& plan, const index_t* index_set, index_t* out,
                                cudaStream_t stream) {
  if (plan.set_bits == 0) return cudaSuccess;
  return expand_bits(plan.words, plan.num_words, plan.tile_ends, DecodeWriter<index_t>{index_set, out}, stream);
}

template cudaError_t bitmap_index_sets<int32_t>(int64_t, uint32_t, uint64_t, int32_t*, int64_t*, Workspace&,
                                                cudaStream_t);
template cudaError_t bitmap_index_sets<int64_t>(int64_t, uint32_t, uint64_t, int64_t*, int64_t*, Workspace&,
                                                cudaStream_t);
template cudaError_t bitmap_encode<int32_t>(const int32_t*, int64_t, const int32_t*, int64_t, uint8_t*, Workspace&,
                                            BitmapEncodeResult&, cudaStream_t);
template cudaError_t bitmap_encode<int64_t>(const int64_t*, int64_t, const int64_t*, int64_t, uint8_t*, Workspace&,
                                            BitmapEncodeResult&, cudaStream_t);
template cudaError_t bitmap_decode_write<int32_t>(const BitmapDecodePlan&, const int32_t*, int32_t*, cudaStream_t);
template cudaError_t bitmap_decode_write<int64_t>(const BitmapDecodePlan&, const int64_t*, int64_t*, cudaStream_t);

}  // namespace gpu
}  // namespace zen
