// Hierarchical hash partition on the GPU; the scheme is partition_cpu.cpp's.
//
// 1. histogram: counts[j] = |{i : partition_of(indices[i]) = j}|.
// 2. layout (one block): partition j owns a region of ceil(table_factor * count_j) table slots followed by
//    ceil(serial_factor * table slots) serial slots; regions are laid out in partition order.
// 3. insert: one thread per element tries num_probes hashed slots of its partition's table with atomicCAS
//    (a lost race returns the winner's value and the thread moves on to its next probe, so nothing is
//    overwritten), else appends to the serial memory through an atomic counter, bounds checked; a full
//    serial memory raises the overflow flag. Slots hold input position + 1, 0 meaning empty.
// 4. compaction: one stream compaction of the non-empty slots of all regions yields the positions
//    grouped by partition (table slots in slot order, then serial entries), then a gather.
// 5. one host read of the flags; on overflow, the exact fallback: a stable radix sort of the positions
//    by partition id, and the gather again.
// num_probes == 0 runs that stable sort alone, as the CPU op does (stats [0, 0, 0]; an ascending input's
// pieces stay ascending).
// Rows of values (width != 1) change only the gather: a row moves whole with its index.
// The region sizes need the counts, which stay on the device: the regions are allocated for an upper
// bound of their total, so the only synchronisation is step 5.
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>

#include <cmath>

#include "kernels.cuh"
#include "zen/hash.h"

namespace zen {
namespace gpu {
namespace {
using namespace detail;

constexpr uint32_t kSharedHistogramMax = 4096;  // partitions counted in shared memory (16 KiB)
constexpr int kLayoutThreads = 1024;

// Device flags and counters of one call, read back together.
enum : int { kSerialPlaced, kOverflow, kCompacted, kLayoutFailed, kStatusWords };

struct Region {
  int64_t begin;        // first table slot; the serial memory follows the table
  int64_t table_size;
  int64_t serial_size;
};

template <typename index_t>
__global__ void hash_partition_kernel(const index_t* indices, int64_t count, uint64_t seed, uint32_t n, int32_t* out) {
  for (int64_t i = global_thread(); i < count; i += grid_stride())
    out[i] = static_cast<int32_t>(partition_of(static_cast<int64_t>(indices[i]), seed, n));
}

// Few partitions: per-block counts in shared memory, flushed once; many: straight to global atomics.
template <typename index_t>
__global__ void __launch_bounds__(kThreads)
    histogram_kernel(const index_t* indices, int64_t nnz, uint64_t seed, uint32_t n, unsigned long long* counts) {
  extern __shared__ unsigned int local[];
  const bool in_shared = n <= kSharedHistogramMax;
  if (in_shared) {
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) local[j] = 0;
    __syncthreads();
  }
  for (int64_t i = global_thread(); i < nnz; i += grid_stride()) {
    const uint32_t j = partition_of(static_cast<int64_t>(indices[i]), seed, n);
    if (in_shared)
      atomicAdd(&local[j], 1u);
    else
      atomicAdd(&counts[j], 1ull);
  }
  if (in_shared) {
    __syncthreads();
    for (uint32_t j = threadIdx.x; j < n; j += blockDim.x)
      if (local[j]) atomicAdd(&counts[j], static_cast<unsigned long long>(local[j]));
  }
}

// Region sizes with the CPU kernel's formulas, and their exclusive prefix sum, in one block.
__global__ void __launch_bounds__(kLayoutThreads)
    layout_kernel(const int64_t* counts, uint32_t n, double table_factor, double serial_factor, int64_t capacity,
                  Region* regions, unsigned long long* status) {
  using Scan = cub::BlockScan<long long, kLayoutThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ long long carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (uint32_t base = 0; base < n; base += kLayoutThreads) {
    const uint32_t j = base + threadIdx.x;
    const long long c = j < n ? counts[j] : 0;
    const long long t = c ? max(1LL, static_cast<long long>(ceil(table_factor * static_cast<double>(c)))) : 0;
    const long long s = c ? static_cast<long long>(ceil(serial_factor * static_cast<double>(t))) : 0;
    long long before, total;
    Scan(temp).ExclusiveSum(t + s, before, total);
    if (j < n) regions[j] = Region{carry + before, t, s};
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  // Cannot happen (the host's bound covers every rounding); if it did, fall back rather than overrun.
  if (threadIdx.x == 0 && carry > capacity) status[kLayoutFailed] = 1;
}

__device__ __forceinline__ bool claim(uint32_t* slot, uint32_t mine) { return atomicCAS(slot, 0u, mine) == 0u; }
__device__ __forceinline__ bool claim(uint64_t* slot, uint64_t mine) {
  return atomicCAS(reinterpret_cast<unsigned long long*>(slot), 0ull, static_cast<unsigned long long>(mine)) == 0ull;
}

template <typename index_t, typename slot_t>
__global__ void __launch_bounds__(kThreads)
    insert_kernel(const index_t* indices, int64_t nnz, uint64_t seed, uint32_t n, int num_probes,
                  const Region* regions, slot_t* slots, unsigned long long* serial_used, unsigned long long* status) {
  if (status[kLayoutFailed]) return;  // the same for every thread
  int64_t serial = 0;
  for (int64_t i = global_thread(); i < nnz; i += grid_stride()) {
    const int64_t index = static_cast<int64_t>(indices[i]);
    const uint32_t j = partition_of(index, seed, n);
    const Region r = regions[j];
    slot_t* table = slots + r.begin;
    const slot_t mine = static_cast<slot_t>(i + 1);
    bool placed = false;
    for (int p = 0; p < num_probes && !placed; ++p)
      placed = claim(table + probe_slot(index, seed, static_cast<uint32_t>(p), static_cast<uint64_t>(r.table_size)), mine);
    if (placed) continue;
    const unsigned long long at = atomicAdd(&serial_used[j], 1ull);
    if (at < static_cast<unsigned long long>(r.serial_size)) {
      table[r.table_size + static_cast<int64_t>(at)] = mine;
      ++serial;
    } else {
      status[kOverflow] = 1;  // racing stores of the same value; the fallback redoes everything
    }
  }
  serial = block_sum(serial);
  if (threadIdx.x == 0 && serial) atomicAdd(&status[kSerialPlaced], static_cast<unsigned long long>(serial));
}

template <typename slot_t>
struct Occupied {
  __host__ __device__ bool operator()(const slot_t& s) const { return s != 0; }
};

// out[k] = in[order[k] - offset] for k < min(nnz, *limit) (limit: the compaction's count, or null).
template <typename index_t, typename U, typename pos_t>
__global__ void gather_kernel(const pos_t* order, pos_t offset, const long long* limit, int64_t nnz,
                              const index_t* indices, const U* values, index_t* out_indices, U* out_values) {
  const int64_t valid = limit ? min(static_cast<long long>(nnz), *limit) : nnz;
  for (int64_t k = global_thread(); k < valid; k += grid_stride()) {
    const int64_t pos = static_cast<int64_t>(order[k] - offset);
    out_indices[k] = indices[pos];
    out_values[k] = values[pos];
  }
}

// The same for rows of width values: one thread per value, so a row is read and written coalesced; the
// thread of a row's first value moves its index (width 0: one thread per row, indices only).
template <typename index_t, typename U, typename pos_t>
__global__ void gather_rows_kernel(const pos_t* order, pos_t offset, const long long* limit, int64_t nnz,
                                   int64_t width, const index_t* indices, const U* values, index_t* out_indices,
                                   U* out_values) {
  const int64_t valid = limit ? min(static_cast<long long>(nnz), *limit) : nnz;
  const int64_t per_row = width > 0 ? width : 1;
  for (int64_t t = global_thread(); t < valid * per_row; t += grid_stride()) {
    const int64_t k = t / per_row, j = t - k * per_row;
    const int64_t pos = static_cast<int64_t>(order[k] - offset);
    if (j == 0) out_indices[k] = indices[pos];
    if (j < width) out_values[t] = values[pos * width + j];
  }
}

// Moves (index, value or row) from input position order[k] - offset to output position k.
template <typename index_t, typename U, typename pos_t>
cudaError_t gather(const pos_t* order, pos_t offset, const long long* limit, int64_t nnz, int64_t width,
                   const index_t* indices, const U* values, index_t* out_indices, U* out_values, cudaStream_t stream) {
  if (width == 1)
    gather_kernel<index_t, U, pos_t><<<grid_for(nnz), kThreads, 0, stream>>>(order, offset, limit, nnz, indices, values,
                                                                            out_indices, out_values);
  else
    gather_rows_kernel<index_t, U, pos_t><<<grid_for(nnz * std::max<int64_t>(width, 1)), kThreads, 0, stream>>>(
        order, offset, limit, nnz, width, indices, values, out_indices, out_values);
  return cudaGetLastError();
}

__global__ void stats_kernel(const unsigned long long* status, int64_t nnz, bool fallback, int64_t* stats) {
  const int64_t serial = fallback ? 0 : static_cast<int64_t>(status[kSerialPlaced]);
  stats[0] = fallback ? 0 : nnz - serial;  // the CPU op reports [0, 0, 1] after a fallback
  stats[1] = serial;
  stats[2] = fallback ? 1 : 0;
}

// Upper bound of the total region size for any split of nnz elements over n partitions: each ceil adds
// less than one slot per non-empty partition, and the margins cover the rounding of the products.
int64_t region_capacity(int64_t nnz, uint32_t n, double table_factor, double serial_factor) {
  const double used = static_cast<double>(std::min<int64_t>(n, nnz));
  const double tables = std::ceil(table_factor * static_cast<double>(nnz)) + 2 * used + 8;
  const double serial = std::ceil(serial_factor * tables) + 2 * used + 8;
  return static_cast<int64_t>(tables + serial);
}

template <typename index_t, typename U, typename slot_t>
cudaError_t hash_path(const index_t* indices, const U* values, int64_t nnz, int64_t width, const PartitionArgs& args,
                      const Region* regions, index_t* out_indices, U* out_values, unsigned long long* status,
                      Workspace& ws, cudaStream_t stream) {
  const uint32_t n = args.num_partitions;
  const int64_t capacity = region_capacity(nnz, n, args.table_factor, args.serial_factor);
  slot_t* slots = ws.get_n<slot_t>(capacity);
  auto* serial_used = ws.get_n<unsigned long long>(n);
  ZEN_CUDA_TRY(cudaMemsetAsync(slots, 0, sizeof(slot_t) * capacity, stream));
  ZEN_CUDA_TRY(cudaMemsetAsync(serial_used, 0, sizeof(unsigned long long) * n, stream));
  insert_kernel<index_t, slot_t><<<grid_for(nnz), kThreads, 0, stream>>>(
      indices, nnz, args.seed, n, args.num_probes, regions, slots, serial_used, status);
  ZEN_CUDA_TRY(cudaGetLastError());

  slot_t* order = ws.get_n<slot_t>(nnz);
  auto* compacted = reinterpret_cast<long long*>(status + kCompacted);
  ZEN_CUDA_TRY(run_cub(ws, [&](void* temp, size_t& bytes) {
    return cub::DeviceSelect::If(temp, bytes, slots, order, compacted, capacity, Occupied<slot_t>{}, stream);
  }));
  return gather<index_t, U, slot_t>(order, slot_t(1), compacted, nnz, width, indices, values, out_indices, out_values,
                                    stream);
}

// The exact fallback: positions stably sorted by partition id (LSD radix sort is stable).
template <typename index_t, typename U>
cudaError_t fallback_path(const index_t* indices, const U* values, int64_t nnz, int64_t width,
                          const PartitionArgs& args, index_t* out_indices, U* out_values, Workspace& ws,
                          cudaStream_t stream) {
  const uint32_t n = args.num_partitions;
  auto* positions = ws.get_n<int64_t>(nnz);
  iota_kernel<<<grid_for(nnz), kThreads, 0, stream>>>(positions, nnz);
  ZEN_CUDA_TRY(cudaGetLastError());
  const int64_t* order = positions;
  int key_bits = 0;
  while ((uint64_t{1} << key_bits) < n) ++key_bits;
  if (key_bits > 0) {
    auto* part = ws.get_n<int32_t>(nnz);
    auto* part_sorted = ws.get_n<int32_t>(nnz);
    auto* sorted = ws.get_n<int64_t>(nnz);
    hash_partition_kernel<<<grid_for(nnz), kThreads, 0, stream>>>(indices, nnz, args.seed, n, part);
    ZEN_CUDA_TRY(cudaGetLastError());
    ZEN_CUDA_TRY(run_cub(ws, [&](void* temp, size_t& bytes) {
      return cub::DeviceRadixSort::SortPairs(temp, bytes, part, part_sorted, positions, sorted, nnz, 0, key_bits, stream);
    }));
    order = sorted;
  }
  return gather<index_t, U, int64_t>(order, int64_t{0}, nullptr, nnz, width, indices, values, out_indices, out_values,
                                     stream);
}

}  // namespace

template <typename index_t>
cudaError_t hash_partition(const index_t* indices, int64_t count, uint32_t num_partitions, uint64_t seed,
                           int32_t* out, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  hash_partition_kernel<<<grid_for(count), kThreads, 0, stream>>>(indices, count, seed, num_partitions, out);
  return cudaGetLastError();
}

template <typename index_t>
cudaError_t partition(const index_t* indices, const void* values, ValueKind kind, int64_t nnz, int64_t width,
                      const PartitionArgs& args, index_t* out_indices, void* out_values, int64_t* counts,
                      int64_t* stats, Workspace& ws, PartitionResult& result, cudaStream_t stream) {
  result = PartitionResult{};
  const uint32_t n = args.num_partitions;
  ZEN_CUDA_TRY(cudaMemsetAsync(counts, 0, sizeof(int64_t) * n, stream));
  ZEN_CUDA_TRY(cudaMemsetAsync(stats, 0, sizeof(int64_t) * 3, stream));
  if (nnz == 0) return cudaSuccess;

  const bool in_shared = n <= kSharedHistogramMax;
  histogram_kernel<<<in_shared ? std::min(grid_for(nnz), 2048u) : grid_for(nnz), kThreads,
                     in_shared ? n * sizeof(unsigned int) : 0, stream>>>(
      indices, nnz, args.seed, n, reinterpret_cast<unsigned long long*>(counts));
  ZEN_CUDA_TRY(cudaGetLastError());
  if (args.num_probes == 0) {  // no tables: the stable sort is the method; stats stay [0, 0, 0]
    return with_bits(kind, [&](auto tag) {
      using U = decltype(tag);
      return fallback_path<index_t, U>(indices, static_cast<const U*>(values), nnz, width, args, out_indices,
                                       static_cast<U*>(out_values), ws, stream);
    });
  }

  auto* status = ws.get_n<unsigned long long>(kStatusWords);
  ZEN_CUDA_TRY(cudaMemsetAsync(status, 0, sizeof(unsigned long long) * kStatusWords, stream));
  auto* regions = ws.get_n<Region>(n);
  layout_kernel<<<1, kLayoutThreads, 0, stream>>>(counts, n, args.table_factor, args.serial_factor,
                                                  region_capacity(nnz, n, args.table_factor, args.serial_factor),
                                                  regions, status);
  ZEN_CUDA_TRY(cudaGetLastError());

  ZEN_CUDA_TRY(with_bits(kind, [&](auto tag) {
    using U = decltype(tag);
    // 32-bit slots while positions + 1 fit: half the table traffic of 64-bit ones.
    if (nnz < static_cast<int64_t>(UINT32_MAX))
      return hash_path<index_t, U, uint32_t>(indices, static_cast<const U*>(values), nnz, width, args, regions,
                                             out_indices, static_cast<U*>(out_values), status, ws, stream);
    return hash_path<index_t, U, uint64_t>(indices, static_cast<const U*>(values), nnz, width, args, regions,
                                           out_indices, static_cast<U*>(out_values), status, ws, stream);
  }));
  stats_kernel<<<1, 1, 0, stream>>>(status, nnz, false, stats);
  ZEN_CUDA_TRY(cudaGetLastError());

  unsigned long long host[kStatusWords];
  ZEN_CUDA_TRY(read_to_host(host, status, sizeof(host), stream));
  result.compacted = static_cast<int64_t>(host[kCompacted]);
  if (!host[kOverflow] && !host[kLayoutFailed]) return cudaSuccess;

  result.fallback = true;
  ZEN_CUDA_TRY(with_bits(kind, [&](auto tag) {
    using U = decltype(tag);
    return fallback_path<index_t, U>(indices, static_cast<const U*>(values), nnz, width, args, out_indices,
                                     static_cast<U*>(out_values), ws, stream);
  }));
  stats_kernel<<<1, 1, 0, stream>>>(status, nnz, true, stats);
  return cudaGetLastError();
}

template cudaError_t hash_partition<int32_t>(const int32_t*, int64_t, uint32_t, uint64_t, int32_t*, cudaStream_t);
template cudaError_t hash_partition<int64_t>(const int64_t*, int64_t, uint32_t, uint64_t, int32_t*, cudaStream_t);
template cudaError_t partition<int32_t>(const int32_t*, const void*, ValueKind, int64_t, int64_t, const PartitionArgs&,
                                        int32_t*, void*, int64_t*, int64_t*, Workspace&, PartitionResult&,
                                        cudaStream_t);
template cudaError_t partition<int64_t>(const int64_t*, const void*, ValueKind, int64_t, int64_t, const PartitionArgs&,
                                        int64_t*, void*, int64_t*, int64_t*, Workspace&, PartitionResult&,
                                        cudaStream_t);

}  // namespace gpu
}  // namespace zen
