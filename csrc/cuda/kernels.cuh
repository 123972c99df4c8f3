// zen's CUDA kernels, seen from the host: launchers over raw device pointers, sizes and a stream, with
// no torch in sight. The binding (ops_cuda.cpp) checks tensors, allocates outputs and turns what the
// launchers report (invalid indices, corrupt bitmaps) into errors. Every launcher returns the first CUDA
// error it met (cudaSuccess otherwise) and runs all its work on the given stream.
//
// Ops with outputs of data-dependent size run in two steps: a *_count / *_prepare step that ends with one
// host synchronisation (reading the size and any error found on the device), then a *_write step into
// outputs the caller allocated. The Workspace must outlive both steps.
//
// The second half of this file (compiled by nvcc only) holds the device helpers the .cu files share.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace zen {
namespace gpu {

// Element types the kernels know. Moving values only needs their width; summing and testing for zero
// need the kind.
enum class ValueKind : int { kUInt8, kInt8, kInt16, kInt32, kInt64, kHalf, kBFloat16, kFloat, kDouble };

inline int value_bytes(ValueKind k) {
  switch (k) {
    case ValueKind::kUInt8:
    case ValueKind::kInt8: return 1;
    case ValueKind::kInt16:
    case ValueKind::kHalf:
    case ValueKind::kBFloat16: return 2;
    case ValueKind::kInt32:
    case ValueKind::kFloat: return 4;
    case ValueKind::kInt64:
    case ValueKind::kDouble: return 8;
  }
  return 0;
}

inline bool is_float(ValueKind k) {
  return k == ValueKind::kHalf || k == ValueKind::kBFloat16 || k == ValueKind::kFloat || k == ValueKind::kDouble;
}

// Scratch device memory handed out by the caller (the binding uses the caching allocator). Blocks stay
// valid until the caller drops the workspace; all work is ordered on one stream, so that is safe.
class Workspace {
 public:
  virtual ~Workspace() = default;
  virtual void* get(size_t bytes) = 0;  // at least 16-byte aligned
  template <typename T>
  T* get_n(int64_t n) {
    return static_cast<T*>(get(sizeof(T) * static_cast<size_t>(n > 0 ? n : 1)));
  }
};

// ---- nonzero: (indices, values) of the non-zeros of a dense buffer, ascending -------------------------
// A non-zero has any bit set, the sign bit of a float excepted (NaN counts, -0.0 does not).
struct NonzeroPlan {
  const void* dense = nullptr;
  int64_t numel = 0;
  ValueKind kind = ValueKind::kFloat;
  uint32_t* words = nullptr;      // bit e % 32 of words[e / 32] is set iff element e is a non-zero
  int64_t* tile_ends = nullptr;   // inclusive prefix sum of the non-zeros of each tile of words
  int64_t num_words = 0, num_tiles = 0;
  int64_t nnz = 0;                // known on the host after nonzero_count
};
cudaError_t nonzero_count(const void* dense, int64_t numel, ValueKind kind, Workspace& ws, NonzeroPlan& plan,
                          cudaStream_t stream);
template <typename index_t>
cudaError_t nonzero_write(const NonzeroPlan& plan, index_t* indices, void* values, cudaStream_t stream);

// ---- nonzero over blocks of `width` consecutive elements: ids ascending, the blocks whole as rows ------
// The element bits of nonzero first, then one bit per block (an OR over its element bits), so the dense
// buffer is read once for the test and once more only for the blocks sent.
struct NonzeroBlocksPlan {
  NonzeroPlan elements;           // pass 1 over the elements; elements.nnz is not read back
  int64_t width = 1, num_blocks = 0;
  uint32_t* words = nullptr;      // bit b % 32 of words[b / 32] is set iff block b holds a non-zero
  int64_t* tile_ends = nullptr;
  int64_t num_words = 0, num_tiles = 0;
  int64_t nnz_blocks = 0;         // known on the host after nonzero_blocks_count
};
cudaError_t nonzero_blocks_count(const void* dense, int64_t num_blocks, int64_t width, ValueKind kind, Workspace& ws,
                                 NonzeroBlocksPlan& plan, cudaStream_t stream);
template <typename index_t>
cudaError_t nonzero_blocks_write(const NonzeroBlocksPlan& plan, index_t* ids, void* rows, cudaStream_t stream);
// counts[2] (int64, device) = [non-zero elements, blocks holding a non-zero], with no synchronisation.
cudaError_t count_nonzero(const void* dense, int64_t num_blocks, int64_t width, ValueKind kind, int64_t* counts,
                          Workspace& ws, cudaStream_t stream);

// ---- partition -----------------------------------------------------------------------------------------
// Level-1 hash of every index (zen::partition_of).
template <typename index_t>
cudaError_t hash_partition(const index_t* indices, int64_t count, uint32_t num_partitions, uint64_t seed,
                           int32_t* out, cudaStream_t stream);

struct PartitionArgs {
  uint32_t num_partitions = 1;
  uint64_t seed = 0;
  int num_probes = 3;           // 0: no tables, the stable sort by partition id alone
  double table_factor = 2.0;
  double serial_factor = 0.1;
};
struct PartitionResult {
  bool fallback = false;    // a serial memory overflowed: the exact counting sort produced the output
  int64_t compacted = 0;    // elements found in the tables; must equal nnz when tables ran without overflow
};
// Outputs of nnz elements grouped by partition; counts[num_partitions] and stats[3] (int64) as the op
// defines them. values holds width values per index (a row, moved whole; width 0 moves indices only).
// Synchronises once, at the end, to learn whether the fallback is needed.
template <typename index_t>
cudaError_t partition(const index_t* indices, const void* values, ValueKind kind, int64_t nnz, int64_t width,
                      const PartitionArgs& args, index_t* out_indices, void* out_values, int64_t* counts,
                      int64_t* stats, Workspace& ws, PartitionResult& result, cudaStream_t stream);

// ---- aggregate: sum duplicate indices, union ascending -------------------------------------------------
// Duplicates are summed in input order (a stable sort keeps it), one thread per distinct index, in the
// CPU kernel's accumulator type: the result is deterministic and equals the CPU op's bit for bit. Rows of
// width values (width != 1) are summed the same way, one thread per element of an output row.
struct AggregatePlan {
  ValueKind kind = ValueKind::kFloat;
  int64_t count = 0;
  int64_t width = 1;
  void* keys = nullptr;          // indices, sorted (index_t)
  void* values = nullptr;        // width 1: values in the same order (raw bits)
  const void* rows = nullptr;    // width != 1: the input rows, read in sorted order through perm
  int64_t* perm = nullptr;       // width != 1: input position of each sorted position
  int64_t* starts = nullptr;     // width != 1: sorted position where output row k's run starts (count slots)
  uint32_t* words = nullptr;     // bit i set iff sorted position i starts a run of equal indices
  int64_t* tile_ends = nullptr;
  int64_t num_words = 0, num_tiles = 0;
  int64_t num_unique = 0;        // known on the host after aggregate_prepare
  int64_t first_bad = -1;        // input position of the first invalid index, -1 if all are valid
  int64_t bad_index = 0;         // the index found there
};
template <typename index_t>
cudaError_t aggregate_prepare(const index_t* indices, const void* values, ValueKind kind, int64_t count, int64_t width,
                              int64_t numel, uint32_t num_partitions, uint64_t seed, int64_t partition,
                              Workspace& ws, AggregatePlan& plan, cudaStream_t stream);
template <typename index_t>
cudaError_t aggregate_write(const AggregatePlan& plan, index_t* out_indices, void* out_values, cudaStream_t stream);

// ---- hash bitmap ---------------------------------------------------------------------------------------
// I_j = sorted {i in [0, numel) : partition_of(i) = j}, concatenated, and offsets[num_partitions + 1].
template <typename index_t>
cudaError_t bitmap_index_sets(int64_t numel, uint32_t num_partitions, uint64_t seed, index_t* sets,
                              int64_t* offsets, Workspace& ws, cudaStream_t stream);

// Bit r (byte r / 8, bit r % 8) of bitmap[(bits + 7) / 8] is set iff index_set[r] is among indices.
// Synchronises once to report the first invalid input, as the CPU op would meet it.
struct BitmapEncodeResult {
  int64_t first_bad = -1;       // position in indices, -1 if all are valid
  bool not_ascending = false;   // at first_bad: indices[first_bad] <= indices[first_bad - 1]
  int64_t bad_index = 0;        // indices[first_bad]
};
template <typename index_t>
cudaError_t bitmap_encode(const index_t* indices, int64_t count, const index_t* index_set, int64_t bits,
                          uint8_t* bitmap, Workspace& ws, BitmapEncodeResult& result, cudaStream_t stream);

struct BitmapDecodePlan {
  uint32_t* words = nullptr;    // the bitmap as 32-bit words, bits past `bits` cleared
  int64_t* tile_ends = nullptr;
  int64_t num_words = 0, num_tiles = 0, bits = 0;
  int64_t set_bits = 0;         // known on the host after bitmap_decode_count
  bool bits_past_end = false;   // a bit at position >= bits was set: corrupt buffer
};
cudaError_t bitmap_decode_count(const uint8_t* bitmap, int64_t bits, Workspace& ws, BitmapDecodePlan& plan,
                                cudaStream_t stream);
template <typename index_t>
cudaError_t bitmap_decode_write(const BitmapDecodePlan& plan, const index_t* index_set, index_t* out,
                                cudaStream_t stream);

// ---- scatter: out[indices[i]] = values[i] --------------------------------------------------------------
// Rows of width >= 1 values: index i is block i of out, out[i width, (i + 1) width) = values[i]. The range
// of the indices is checked against the num_blocks blocks (one synchronisation) before anything is written.
struct ScatterResult {
  int64_t lo = 0, hi = 0;   // smallest and largest index
  bool written = false;     // false when [lo, hi] is not inside [0, num_blocks): nothing was written
};
template <typename index_t>
cudaError_t scatter(void* out, int64_t num_blocks, int64_t width, const index_t* indices, const void* values,
                    ValueKind kind, int64_t count, Workspace& ws, ScatterResult& result, cudaStream_t stream);

// ---- select by magnitude: top-k, or every |x| >= a threshold (indices ascending, values) ----------------
// Float kinds only; magnitude keys as zen/magnitude.h defines them (NaN first, then +-Inf, then |x|; zeros
// never chosen). topk_select_count finds the k-th largest key t by a radix select on the device, then flags
// the keys > t and the first (k - keys above t) keys == t by index: the CPU op's result, element for element.
// threshold_select_count flags the keys >= min_key (>= 1). Both synchronise once, to read the count.
struct SelectPlan {
  const void* dense = nullptr;
  ValueKind kind = ValueKind::kFloat;
  uint32_t* words = nullptr;      // bit e % 32 of words[e / 32] is set iff element e is chosen
  int64_t* tile_ends = nullptr;   // inclusive prefix sum of the chosen elements of each tile of words
  int64_t num_words = 0, num_tiles = 0;
  int64_t count = 0;              // known on the host after *_count
};
cudaError_t topk_select_count(const void* dense, int64_t numel, ValueKind kind, int64_t k, Workspace& ws,
                              SelectPlan& plan, cudaStream_t stream);
cudaError_t threshold_select_count(const void* dense, int64_t numel, ValueKind kind, uint64_t min_key, Workspace& ws,
                                   SelectPlan& plan, cudaStream_t stream);
template <typename index_t>
cudaError_t select_write(const SelectPlan& plan, index_t* indices, void* values, cudaStream_t stream);

}  // namespace gpu
}  // namespace zen

// ======================= device helpers shared by the .cu files (nvcc only) ============================
#if defined(__CUDACC__)
#include <cub/device/device_scan.cuh>

#include <algorithm>

#define ZEN_CUDA_TRY(expr)                     \
  do {                                         \
    const cudaError_t zen_err_ = (expr);       \
    if (zen_err_ != cudaSuccess) return zen_err_; \
  } while (0)

namespace zen {
namespace gpu {
namespace detail {

constexpr int kThreads = 256;               // threads per block, everywhere
constexpr int kWarps = kThreads / 32;
constexpr int kTileWords = kThreads;        // bit-mask tiles: one 32-bit word per thread
constexpr int64_t kTileBits = int64_t{kTileWords} * 32;
constexpr unsigned kFullMask = 0xffffffffu;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks for a grid-stride loop over n items: enough to fill any GPU, never more than the items need.
inline unsigned grid_for(int64_t n, int threads = kThreads) {
  return static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(ceil_div(n, threads), 1), int64_t{1} << 16));
}

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// Unsigned type of a width, to move values of any kind as raw bits.
template <int Bytes> struct BitsOf;
template <> struct BitsOf<1> { using type = uint8_t; };
template <> struct BitsOf<2> { using type = uint16_t; };
template <> struct BitsOf<4> { using type = uint32_t; };
template <> struct BitsOf<8> { using type = uint64_t; };

// Calls f(U{}) with U the unsigned type of the kind's width.
template <typename F>
cudaError_t with_bits(ValueKind kind, F&& f) {
  switch (value_bytes(kind)) {
    case 1: return f(uint8_t{});
    case 2: return f(uint16_t{});
    case 4: return f(uint32_t{});
    case 8: return f(uint64_t{});
  }
  return cudaErrorInvalidValue;
}

// Bits that make an element a non-zero: all of them for integers, all but the sign for floats.
template <typename U>
inline U nonzero_mask(bool is_float) {
  const U sign = static_cast<U>(U(1) << (8 * sizeof(U) - 1));
  return is_float ? static_cast<U>(~sign) : static_cast<U>(~U(0));
}

// Runs a cub device algorithm: once to size its temporary storage, once for real.
template <typename F>
cudaError_t run_cub(Workspace& ws, F&& f) {
  size_t bytes = 0;
  ZEN_CUDA_TRY(f(nullptr, bytes));
  return f(ws.get(bytes), bytes);
}

// Blocking read of a few device bytes: the one host synchronisation of an op.
inline cudaError_t read_to_host(void* host, const void* device, size_t bytes, cudaStream_t stream) {
  ZEN_CUDA_TRY(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream));
  return cudaStreamSynchronize(stream);
}

// Sum over the block; the result is valid in thread 0.
__device__ __forceinline__ int64_t block_sum(int64_t v) {
  __shared__ int64_t partial[kWarps];
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(kFullMask, static_cast<long long>(v), off);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  int64_t total = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kWarps; ++w) total += partial[w];
  return total;
}

// One tile of flag words, by ballots: warp w of the block owns words [32 w, 32 w + 32) of the tile and
// lane l tests element 32 word + l, so every read is coalesced. Returns the set bits this thread saw
// (only lane 0 sees any), for the tile's count.
template <typename Pred>
__device__ __forceinline__ int64_t flag_tile_by_ballot(int64_t n, int64_t num_words, const Pred& pred,
                                                       uint32_t* words) {
  const int lane = threadIdx.x & 31;
  const int64_t warp_word0 = static_cast<int64_t>(blockIdx.x) * kTileWords + (threadIdx.x >> 5) * 32;
  int64_t count = 0;
  for (int i = 0; i < 32; ++i) {
    const int64_t w = warp_word0 + i;
    if (w >= num_words) break;  // uniform over the warp
    const int64_t e = w * 32 + lane;
    const uint32_t m = __ballot_sync(kFullMask, e < n && pred(e));
    if (lane == 0) {
      words[w] = m;
      count += __popc(m);
    }
  }
  return count;
}

// words[w] (bit b: element 32 w + b) and the number of set bits of each tile, for any predicate.
template <typename Pred>
__global__ void __launch_bounds__(kThreads)
    flag_words_kernel(int64_t n, int64_t num_words, Pred pred, uint32_t* words, int64_t* tile_counts) {
  const int64_t count = block_sum(flag_tile_by_ballot(n, num_words, pred, words));
  if (threadIdx.x == 0) tile_counts[blockIdx.x] = count;
}

// Turns per-tile counts into inclusive ends, in place.
inline cudaError_t scan_tiles(int64_t* tile_counts, int64_t num_tiles, Workspace& ws, cudaStream_t stream) {
  return run_cub(ws, [&](void* temp, size_t& bytes) {
    return cub::DeviceScan::InclusiveSum(temp, bytes, tile_counts, tile_counts, num_tiles, stream);
  });
}

// Calls writer(k, pos) for every set bit pos of the words, k being its rank among all set bits: the
// compaction step shared by nonzero, aggregate and bitmap_decode. One word per thread; the warp then
// visits its non-empty words one by one, lane l taking bit l, so outputs and reads are contiguous.
template <typename Writer>
__global__ void __launch_bounds__(kThreads)
    expand_bits_kernel(const uint32_t* words, int64_t num_words, const int64_t* tile_ends, Writer writer) {
  __shared__ int warp_total[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kTileWords + threadIdx.x;
  const uint32_t word = w < num_words ? words[w] : 0u;
  const int cnt = __popc(word);
  int incl = cnt;  // inclusive prefix over the warp
  for (int off = 1; off < 32; off <<= 1) {
    const int t = __shfl_up_sync(kFullMask, incl, off);
    if (lane >= off) incl += t;
  }
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  int before = 0;
  for (int i = 0; i < warp; ++i) before += warp_total[i];
  const int64_t tile_start = blockIdx.x > 0 ? tile_ends[blockIdx.x - 1] : 0;
  const long long base = tile_start + before + incl - cnt;
  const int64_t warp_word0 = w - lane;
  uint32_t pending = __ballot_sync(kFullMask, word != 0);
  while (pending) {
    const int j = __ffs(pending) - 1;
    pending &= pending - 1;
    const uint32_t wj = __shfl_sync(kFullMask, word, j);
    const long long bj = __shfl_sync(kFullMask, base, j);
    if ((wj >> lane) & 1u) writer(bj + __popc(wj & ((1u << lane) - 1u)), (warp_word0 + j) * 32 + lane);
  }
}

template <typename Writer>
cudaError_t expand_bits(const uint32_t* words, int64_t num_words, const int64_t* tile_ends, const Writer& writer,
                        cudaStream_t stream) {
  const int64_t tiles = ceil_div(num_words, kTileWords);
  if (tiles == 0) return cudaSuccess;
  expand_bits_kernel<<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(words, num_words, tile_ends, writer);
  return cudaGetLastError();
}

template <typename T>
__global__ void iota_kernel(T* out, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += grid_stride()) out[i] = static_cast<T>(i);
}

}  // namespace detail
}  // namespace gpu
}  // namespace zen
#endif  // __CUDACC__
