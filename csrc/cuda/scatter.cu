// Scatter on the GPU: the smallest and largest index first (one synchronisation, so an out-of-range index
// fails the op before anything is written, as on the CPU), then out[indices[i]] = values[i], values moved
// as raw bits of their width. Rows (width != 1) are written one thread per value: index i fills block i of
// out, out[i width + j] = values[i, j], so a row's writes are contiguous.
#include <climits>

#include "kernels.cuh"

namespace zen {
namespace gpu {
namespace {
using namespace detail;

constexpr unsigned kMinMaxBlocks = 1024;  // one pair of global atomics per block: few blocks, strided loops

__global__ void init_range_kernel(long long* range) {
  range[0] = LLONG_MAX;
  range[1] = LLONG_MIN;
}

template <typename index_t>
__global__ void __launch_bounds__(kThreads) minmax_kernel(const index_t* indices, int64_t count, long long* range) {
  __shared__ long long lo_w[kWarps], hi_w[kWarps];
  long long lo = LLONG_MAX, hi = LLONG_MIN;
  for (int64_t i = global_thread(); i < count; i += grid_stride()) {
    const long long v = static_cast<long long>(indices[i]);
    lo = min(lo, v);
    hi = max(hi, v);
  }
  for (int off = 16; off > 0; off >>= 1) {
    lo = min(lo, __shfl_down_sync(kFullMask, lo, off));
    hi = max(hi, __shfl_down_sync(kFullMask, hi, off));
  }
  if ((threadIdx.x & 31) == 0) {
    lo_w[threadIdx.x >> 5] = lo;
    hi_w[threadIdx.x >> 5] = hi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) {
      lo = min(lo, lo_w[w]);
      hi = max(hi, hi_w[w]);
    }
    atomicMin(&range[0], lo);
    atomicMax(&range[1], hi);
  }
}

template <typename index_t, typename U>
__global__ void scatter_kernel(U* out, const index_t* indices, const U* values, int64_t count) {
  for (int64_t i = global_thread(); i < count; i += grid_stride()) out[indices[i]] = values[i];
}

template <typename index_t, typename U>
__global__ void scatter_rows_kernel(U* out, const index_t* indices, const U* values, int64_t count, int64_t width) {
  for (int64_t t = global_thread(); t < count * width; t += grid_stride()) {
    const int64_t i = t / width;
    out[static_cast<int64_t>(indices[i]) * width + (t - i * width)] = values[t];
  }
}

}  // namespace

template <typename index_t>
cudaError_t scatter(void* out, int64_t num_blocks, int64_t width, const index_t* indices, const void* values,
                    ValueKind kind, int64_t count, Workspace& ws, ScatterResult& result, cudaStream_t stream) {
  result = ScatterResult{};
  if (count == 0) {
    result.written = true;
    return cudaSuccess;
  }
  auto* range = ws.get_n<long long>(2);
  init_range_kernel<<<1, 1, 0, stream>>>(range);
  ZEN_CUDA_TRY(cudaGetLastError());
  minmax_kernel<<<std::min(grid_for(count), kMinMaxBlocks), kThreads, 0, stream>>>(indices, count, range);
  ZEN_CUDA_TRY(cudaGetLastError());
  long long host[2];
  ZEN_CUDA_TRY(read_to_host(host, range, sizeof(host), stream));
  result.lo = host[0];
  result.hi = host[1];
  if (result.lo < 0 || result.hi >= num_blocks) return cudaSuccess;
  ZEN_CUDA_TRY(with_bits(kind, [&](auto tag) {
    using U = decltype(tag);
    if (width == 1)
      scatter_kernel<<<grid_for(count), kThreads, 0, stream>>>(static_cast<U*>(out), indices,
                                                               static_cast<const U*>(values), count);
    else
      scatter_rows_kernel<<<grid_for(count * width), kThreads, 0, stream>>>(static_cast<U*>(out), indices,
                                                                             static_cast<const U*>(values), count, width);
    return cudaGetLastError();
  }));
  result.written = true;
  return cudaSuccess;
}

template cudaError_t scatter<int32_t>(void*, int64_t, int64_t, const int32_t*, const void*, ValueKind, int64_t,
                                      Workspace&, ScatterResult&, cudaStream_t);
template cudaError_t scatter<int64_t>(void*, int64_t, int64_t, const int64_t*, const void*, ValueKind, int64_t,
                                      Workspace&, ScatterResult&, cudaStream_t);

}  // namespace gpu
}  // namespace zen
