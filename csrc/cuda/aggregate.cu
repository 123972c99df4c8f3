// Aggregation of one partition on the GPU, sort-based: validate every index (the first invalid position
// found with atomicMin, so the error names the element the CPU op would name), stable radix sort of
// (index, value) by index, one bit per sorted position marking the start of each run of equal indices,
// and a compaction over those bits in which the thread of each run sums it sequentially.
//
// Summation order: a run holds its values in input order (the sort is stable), and one thread adds them
// left to right in the CPU kernel's accumulator type (float for half/bfloat16/float, double for double,
// the integer type itself, wrapping, for integers). The result is deterministic and equals the CPU op's
// bit for bit, but for NaN: a NaN sum is NaN on both, its sign and payload may differ. A run as long as the
// input (one index repeated everywhere) is summed by one thread: correct, slow; in zen a run is at most one
// element per peer.
//
// Rows of width values (width != 1): the sort carries input positions instead of values (a row is too wide
// to move through the sort), the compaction records where each run starts, and one thread per element of
// the output rows sums its column down the run, in the same order: the CPU op's result, element by element.
#include <cub/device/device_radix_sort.cuh>
#include <cuda_fp16.h>

#include <type_traits>

#include "kernels.cuh"
#include "zen/hash.h"

namespace zen {
namespace gpu {
namespace {
using namespace detail;

enum : int { kFirstBad, kStatusWords };

template <typename index_t>
__global__ void validate_kernel(const index_t* indices, int64_t count, int64_t numel, uint64_t seed, uint32_t n,
                                int64_t partition, unsigned long long* status) {
  for (int64_t i = global_thread(); i < count; i += grid_stride()) {
    const int64_t index = static_cast<int64_t>(indices[i]);
    const bool bad = index < 0 || index >= numel ||
                     (partition >= 0 && partition_of(index, seed, n) != static_cast<uint32_t>(partition));
    if (bad) atomicMin(&status[kFirstBad], static_cast<unsigned long long>(i));
  }
}

template <typename index_t>
struct RunStart {
  const index_t* keys;
  __device__ bool operator()(int64_t e) const { return e == 0 || keys[e] != keys[e - 1]; }
};

// Accumulation per kind: bits -> accumulator, and back with the CPU's rounding.
template <ValueKind K> struct Acc;
template <typename U>
struct IntAcc {  // unsigned arithmetic: the two's complement wrap of the CPU's integer sum, without UB
  using bits_t = U;
  using acc_t = U;
  __device__ static acc_t load(bits_t b) { return b; }
  __device__ static bits_t store(acc_t a) { return a; }
};
template <> struct Acc<ValueKind::kUInt8> : IntAcc<uint8_t> {};
template <> struct Acc<ValueKind::kInt8> : IntAcc<uint8_t> {};
template <> struct Acc<ValueKind::kInt16> : IntAcc<uint16_t> {};
template <> struct Acc<ValueKind::kInt32> : IntAcc<uint32_t> {};
template <> struct Acc<ValueKind::kInt64> : IntAcc<uint64_t> {};
template <> struct Acc<ValueKind::kFloat> {
  using bits_t = uint32_t;
  using acc_t = float;
  __device__ static acc_t load(bits_t b) { return __uint_as_float(b); }
  __device__ static bits_t store(acc_t a) { return __float_as_uint(a); }
};
template <> struct Acc<ValueKind::kDouble> {
  using bits_t = uint64_t;
  using acc_t = double;
  __device__ static acc_t load(bits_t b) { return __longlong_as_double(static_cast<long long>(b)); }
  __device__ static bits_t store(acc_t a) { return static_cast<bits_t>(__double_as_longlong(a)); }
};
template <> struct Acc<ValueKind::kHalf> {
  using bits_t = uint16_t;
  using acc_t = float;
  __device__ static acc_t load(bits_t b) { return __half2float(__ushort_as_half(b)); }
  __device__ static bits_t store(acc_t a) {  // round to nearest even; NaN as c10::Half makes it
    if (isnan(a)) return static_cast<bits_t>(0x7E00u | ((__float_as_uint(a) >> 16) & 0x8000u));
    return __half_as_ushort(__float2half_rn(a));
  }
};
template <> struct Acc<ValueKind::kBFloat16> {
  using bits_t = uint16_t;
  using acc_t = float;
  __device__ static acc_t load(bits_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
  __device__ static bits_t store(acc_t a) {  // c10::BFloat16's round to nearest even
    if (isnan(a)) return 0x7FC0u;
    const uint32_t u = __float_as_uint(a);
    return static_cast<bits_t>((u + ((u >> 16) & 1u) + 0x7FFFu) >> 16);
  }
};

template <typename index_t, ValueKind K>
struct RunSumWriter {
  using A = Acc<K>;
  const index_t* keys;
  const typename A::bits_t* values;
  int64_t count;
  index_t* out_indices;
  typename A::bits_t* out_values;
  __device__ void operator()(int64_t k, int64_t start) const {
    const index_t key = keys[start];
    typename A::acc_t sum = A::load(values[start]);
    for (int64_t j = start + 1; j < count && keys[j] == key; ++j) sum += A::load(values[j]);
    out_indices[k] = key;
    out_values[k] = A::store(sum);
  }
};

// Rows: out_indices[k] = the run's index, starts[k] = the sorted position where it starts.
template <typename index_t>
struct RunStartWriter {
  const index_t* keys;
  index_t* out_indices;
  int64_t* starts;
  __device__ void operator()(int64_t k, int64_t start) const {
    out_indices[k] = keys[start];
    starts[k] = start;
  }
};

// out[k, j] = sum of rows[perm[s], j] over the sorted positions s of run k, in order; one thread per
// element of the output, so a run's rows are read coalesced along j.
template <ValueKind K>
__global__ void row_sum_kernel(const int64_t* perm, const int64_t* starts, int64_t num_unique, int64_t count,
                               int64_t width, const typename Acc<K>::bits_t* rows, typename Acc<K>::bits_t* out) {
  using A = Acc<K>;
  for (int64_t t = global_thread(); t < num_unique * width; t += grid_stride()) {
    const int64_t k = t / width, j = t - k * width;
    const int64_t begin = starts[k], end = k + 1 < num_unique ? starts[k + 1] : count;
    typename A::acc_t sum = A::load(rows[perm[begin] * width + j]);
    for (int64_t s = begin + 1; s < end; ++s) sum += A::load(rows[perm[s] * width + j]);
    out[t] = A::store(sum);
  }
}

template <typename F>
cudaError_t with_kind(ValueKind kind, F&& f) {
  switch (kind) {
    case ValueKind::kUInt8: return f(std::integral_constant<ValueKind, ValueKind::kUInt8>{});
    case ValueKind::kInt8: return f(std::integral_constant<ValueKind, ValueKind::kInt8>{});
    case ValueKind::kInt16: return f(std::integral_constant<ValueKind, ValueKind::kInt16>{});
    case ValueKind::kInt32: return f(std::integral_constant<ValueKind, ValueKind::kInt32>{});
    case ValueKind::kInt64: return f(std::integral_constant<ValueKind, ValueKind::kInt64>{});
    case ValueKind::kHalf: return f(std::integral_constant<ValueKind, ValueKind::kHalf>{});
    case ValueKind::kBFloat16: return f(std::integral_constant<ValueKind, ValueKind::kBFloat16>{});
    case ValueKind::kFloat: return f(std::integral_constant<ValueKind, ValueKind::kFloat>{});
    case ValueKind::kDouble: return f(std::integral_constant<ValueKind, ValueKind::kDouble>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

template <typename index_t>
cudaError_t aggregate_prepare(const index_t* indices, const void* values, ValueKind kind, int64_t count, int64_t width,
                              int64_t numel, uint32_t num_partitions, uint64_t seed, int64_t partition,
                              Workspace& ws, AggregatePlan& plan, cudaStream_t stream) {
  plan = AggregatePlan{};
  plan.kind = kind;
  plan.count = count;
  plan.width = width;
  if (count == 0) return cudaSuccess;

  auto* status = ws.get_n<unsigned long long>(kStatusWords);
  ZEN_CUDA_TRY(cudaMemsetAsync(status, 0xff, sizeof(unsigned long long) * kStatusWords, stream));  // "none"
  validate_kernel<<<grid_for(count), kThreads, 0, stream>>>(indices, count, numel, seed, num_partitions, partition,
                                                            status);
  ZEN_CUDA_TRY(cudaGetLastError());

  // Sort on the bits valid indices use; invalid ones end up anywhere, and the op fails anyway.
  int key_bits = 1;
  while (key_bits < 8 * static_cast<int>(sizeof(index_t)) - 1 && (int64_t{1} << key_bits) < numel) ++key_bits;
  auto* keys = ws.get_n<index_t>(count);
  plan.keys = keys;
  if (width == 1) {
    ZEN_CUDA_TRY(with_bits(kind, [&](auto tag) {
      using U = decltype(tag);
      auto* sorted = ws.get_n<U>(count);
      plan.values = sorted;
      return run_cub(ws, [&](void* temp, size_t& bytes) {
        return cub::DeviceRadixSort::SortPairs(temp, bytes, indices, keys, static_cast<const U*>(values), sorted,
                                               count, 0, key_bits, stream);
      });
    }));
  } else {
    auto* positions = ws.get_n<int64_t>(count);
    plan.rows = values;
    plan.perm = ws.get_n<int64_t>(count);
    plan.starts = ws.get_n<int64_t>(count);
    iota_kernel<<<grid_for(count), kThreads, 0, stream>>>(positions, count);
    ZEN_CUDA_TRY(cudaGetLastError());
    ZEN_CUDA_TRY(run_cub(ws, [&](void* temp, size_t& bytes) {
      return cub::DeviceRadixSort::SortPairs(temp, bytes, indices, keys, positions, plan.perm, count, 0, key_bits,
                                             stream);
    }));
  }

  plan.num_words = ceil_div(count, 32);
  plan.num_tiles = ceil_div(plan.num_words, kTileWords);
  plan.words = ws.get_n<uint32_t>(plan.num_words);
  plan.tile_ends = ws.get_n<int64_t>(plan.num_tiles);
  flag_words_kernel<<<static_cast<unsigned>(plan.num_tiles), kThreads, 0, stream>>>(
      count, plan.num_words, RunStart<index_t>{keys}, plan.words, plan.tile_ends);
  ZEN_CUDA_TRY(cudaGetLastError());
  ZEN_CUDA_TRY(scan_tiles(plan.tile_ends, plan.num_tiles, ws, stream));

  unsigned long long first_bad = 0;
  ZEN_CUDA_TRY(cudaMemcpyAsync(&first_bad, status + kFirstBad, sizeof(first_bad), cudaMemcpyDeviceToHost, stream));
  ZEN_CUDA_TRY(read_to_host(&plan.num_unique, plan.tile_ends + plan.num_tiles - 1, sizeof(int64_t), stream));
  if (first_bad != ~0ull) {
    plan.first_bad = static_cast<int64_t>(first_bad);
    index_t bad = 0;
    ZEN_CUDA_TRY(read_to_host(&bad, indices + plan.first_bad, sizeof(index_t), stream));
    plan.bad_index = static_cast<int64_t>(bad);
  }
  return cudaSuccess;
}

template <typename index_t>
cudaError_t aggregate_write(const AggregatePlan& plan, index_t* out_indices, void* out_values, cudaStream_t stream) {
  if (plan.num_unique == 0) return cudaSuccess;
  return with_kind(plan.kind, [&](auto kind_tag) {
    constexpr ValueKind K = decltype(kind_tag)::value;
    using bits_t = typename Acc<K>::bits_t;
    if (plan.width != 1) {
      ZEN_CUDA_TRY(expand_bits(plan.words, plan.num_words, plan.tile_ends,
                               RunStartWriter<index_t>{static_cast<const index_t*>(plan.keys), out_indices, plan.starts},
                               stream));
      if (plan.width == 0) return cudaSuccess;  // rows of nothing: the indices are the whole result
      row_sum_kernel<K><<<grid_for(plan.num_unique * plan.width), kThreads, 0, stream>>>(
          plan.perm, plan.starts, plan.num_unique, plan.count, plan.width, static_cast<const bits_t*>(plan.rows),
          static_cast<bits_t*>(out_values));
      return cudaGetLastError();
    }
    const RunSumWriter<index_t, K> writer{static_cast<const index_t*>(plan.keys),
                                          static_cast<const bits_t*>(plan.values), plan.count, out_indices,
                                          static_cast<bits_t*>(out_values)};
    return expand_bits(plan.words, plan.num_words, plan.tile_ends, writer, stream);
  });
}

template cudaError_t aggregate_prepare<int32_t>(const int32_t*, const void*, ValueKind, int64_t, int64_t, int64_t,
                                                uint32_t, uint64_t, int64_t, Workspace&, AggregatePlan&, cudaStream_t);
template cudaError_t aggregate_prepare<int64_t>(const int64_t*, const void*, ValueKind, int64_t, int64_t, int64_t,
                                                uint32_t, uint64_t, int64_t, Workspace&, AggregatePlan&, cudaStream_t);
template cudaError_t aggregate_write<int32_t>(const AggregatePlan&, int32_t*, void*, cudaStream_t);
template cudaError_t aggregate_write<int64_t>(const AggregatePlan&, int64_t*, void*, cudaStream_t);

}  // namespace gpu
}  // namespace zen
