// Selection by magnitude on the GPU, on the keys of zen/magnitude.h (the CPU op's rule, element for element).
// top-k: a radix select finds the k-th largest key t with no host round trip. One pass per byte of the key,
// from the top: a histogram of that byte over the keys that share the bytes chosen so far (per-block shared
// bins, added into 256 global ones), then one thread picks the byte the k-th key has and how far down the
// keys holding it the k-th lies. Of the keys == t, the first (k - keys above t) by index are taken: a pass
// flags the keys == t, and the compaction step of nonzero finds the index of the last one taken. Then, as
// for threshold_select (keys >= the threshold's key), one pass flags the chosen elements as bits with a
// count per tile, a scan gives the output size (the one host read), and the compaction writes them ascending.
#include "kernels.cuh"
#include "zen/magnitude.h"

namespace zen {
namespace gpu {
namespace {
using namespace detail;

constexpr int kDigitBits = 8;
constexpr int kDigits = 1 << kDigitBits;
static_assert(kDigits == kThreads, "one histogram bin per thread");
constexpr unsigned kHistogramBlocks = 1024;  // enough to fill a GPU; each block adds its bins once

// The selection's bound, on the device: the keys > t, and of the keys == t those at index <= last.
struct SelectState {
  unsigned long long t;  // during the radix select: the bytes chosen so far
  long long rank;        // during it: the k-th key's rank among the keys sharing them; then the ties taken
  long long last;        // the index of the last key == t taken, -1 if none
};

uint64_t inf_key(ValueKind kind) {
  switch (kind) {
    case ValueKind::kHalf: return kHalfInfKey;
    case ValueKind::kBFloat16: return kBFloat16InfKey;
    case ValueKind::kFloat: return kFloatInfKey;
    case ValueKind::kDouble: return kDoubleInfKey;
    default: return 0;
  }
}

__global__ void init_state_kernel(SelectState* state, unsigned long long t, long long rank) {
  state->t = t;
  state->rank = rank;
  state->last = -1;
}

// hist[d] += the keys whose bytes above `shift + 8` are those chosen so far and whose byte at shift is d.
template <typename U>
__global__ void __launch_bounds__(kThreads)
    radix_histogram_kernel(const U* data, int64_t n, U nan_key, int shift, const SelectState* state,
                           unsigned long long* hist) {
  __shared__ unsigned int bins[kDigits];
  bins[threadIdx.x] = 0;
  __syncthreads();
  const int high = shift + kDigitBits;  // 64 only for the top byte of 8-byte keys: no bytes chosen yet
  const unsigned long long chosen = high < 64 ? state->t >> high : 0;
  const int lane = threadIdx.x & 31;
  // The whole warp goes round together (lanes past n hold no key), so that the lanes of one bin add their
  // count in one atomic: magnitudes crowd into a few bins, whose atomics would otherwise serialise.
  for (int64_t base = global_thread() - lane; base < n; base += grid_stride()) {
    const int64_t i = base + lane;
    int bin = kDigits;  // none
    if (i < n) {
      const unsigned long long key = magnitude_key<U>(__ldg(data + i), nan_key);
      if (high >= 64 || (key >> high) == chosen) bin = static_cast<int>((key >> shift) & (kDigits - 1));
    }
    const unsigned same = __match_any_sync(kFullMask, bin);
    if (bin < kDigits && lane == __ffs(same) - 1) atomicAdd(&bins[bin], static_cast<unsigned>(__popc(same)));
  }
  __syncthreads();
  if (bins[threadIdx.x] != 0) atomicAdd(hist + threadIdx.x, static_cast<unsigned long long>(bins[threadIdx.x]));
}

// Picks the byte at shift of the k-th largest key: the highest d with (keys of bytes > d) < rank <= (keys of
// bytes >= d); the rank then counts from the first key holding d. After the last byte, t is the k-th key and
// rank the ties it takes, none when t is 0 (fewer non-zeros than k: zeros are never chosen).
__global__ void radix_choose_kernel(const unsigned long long* hist, int shift, SelectState* state) {
  long long above = 0;
  const long long rank = state->rank;
  for (int d = kDigits - 1; d >= 0; --d) {
    const long long here = static_cast<long long>(hist[d]);
    if (above + here >= rank) {
      state->t |= static_cast<unsigned long long>(d) << shift;
      state->rank = rank - above;
      break;
    }
    above += here;
  }
  if (shift == 0 && state->t == 0) state->rank = 0;
}

template <typename U>
struct KeyEquals {  // key == t
  const U* data;
  U nan_key;
  const SelectState* state;
  __device__ bool operator()(int64_t e) const { return magnitude_key<U>(__ldg(data + e), nan_key) == state->t; }
};

// Called for every key == t with its rank k among them: the rank-th one (1-based) is the last taken.
struct LastTie {
  SelectState* state;
  __device__ void operator()(int64_t k, int64_t pos) const {
    if (k == state->rank - 1) state->last = pos;
  }
};

template <typename U>
struct Chosen {  // key > t, or key == t at an index <= last
  const U* data;
  U nan_key;
  const SelectState* state;
  __device__ bool operator()(int64_t e) const {
    const unsigned long long key = magnitude_key<U>(__ldg(data + e), nan_key);
    return key > state->t || (key == state->t && e <= state->last);
  }
};

template <typename U, typename index_t>
struct ChosenWriter {
  const U* data;
  index_t* indices;
  U* values;
  __device__ void operator()(int64_t k, int64_t pos) const {
    indices[k] = static_cast<index_t>(pos);
    values[k] = __ldg(data + pos);
  }
};

// Bits of the elements pred holds for, and the inclusive ends of their tile counts.
template <typename Pred>
cudaError_t flag(int64_t numel, const Pred& pred, Workspace& ws, uint32_t*& words, int64_t*& tile_ends,
                 int64_t& num_words, int64_t& num_tiles, cudaStream_t stream) {
  num_words = ceil_div(numel, 32);
  num_tiles = ceil_div(num_words, kTileWords);
  words = ws.get_n<uint32_t>(num_words);
  tile_ends = ws.get_n<int64_t>(num_tiles);
  flag_words_kernel<<<static_cast<unsigned>(num_tiles), kThreads, 0, stream>>>(numel, num_words, pred, words,
                                                                               tile_ends);
  ZEN_CUDA_TRY(cudaGetLastError());
  return scan_tiles(tile_ends, num_tiles, ws, stream);
}

// The chosen elements under the state's bound, and their number on the host.
template <typename U>
cudaError_t flag_chosen(const U* data, int64_t numel, U nan_key, const SelectState* state, Workspace& ws,
                        SelectPlan& plan, cudaStream_t stream) {
  ZEN_CUDA_TRY(flag(numel, Chosen<U>{data, nan_key, state}, ws, plan.words, plan.tile_ends, plan.num_words,
                    plan.num_tiles, stream));
  return read_to_host(&plan.count, plan.tile_ends + plan.num_tiles - 1, sizeof(int64_t), stream);
}

}  // namespace

cudaError_t topk_select_count(const void* dense, int64_t numel, ValueKind kind, int64_t k, Workspace& ws,
                              SelectPlan& plan, cudaStream_t stream) {
  plan = SelectPlan{};
  plan.dense = dense;
  plan.kind = kind;
  if (!is_float(kind) || k < 0) return cudaErrorInvalidValue;
  const int64_t rank = std::min(k, numel);  // past numel: every element, so every non-zero
  if (rank == 0) return cudaSuccess;
  return with_bits(kind, [&](auto tag) {
    using U = decltype(tag);
    const auto* data = static_cast<const U*>(dense);
    const U nan_key = static_cast<U>(inf_key(kind) + 1);
    constexpr int kPasses = sizeof(U) * 8 / kDigitBits;
    auto* state = ws.get_n<SelectState>(1);
    auto* hist = ws.get_n<unsigned long long>(kPasses * kDigits);
    ZEN_CUDA_TRY(cudaMemsetAsync(hist, 0, kPasses * kDigits * sizeof(unsigned long long), stream));
    init_state_kernel<<<1, 1, 0, stream>>>(state, 0, rank);
    const unsigned blocks = std::min(grid_for(numel), kHistogramBlocks);
    for (int p = 0; p < kPasses; ++p) {
      const int shift = (kPasses - 1 - p) * kDigitBits;
      radix_histogram_kernel<U><<<blocks, kThreads, 0, stream>>>(data, numel, nan_key, shift, state,
                                                                 hist + p * kDigits);
      radix_choose_kernel<<<1, 1, 0, stream>>>(hist + p * kDigits, shift, state);
    }
    ZEN_CUDA_TRY(cudaGetLastError());
    // The ties taken: the index of the last of them, by the compaction over the flags of the keys == t.
    uint32_t* tie_words = nullptr;
    int64_t* tie_ends = nullptr;
    int64_t tie_num_words = 0, tie_num_tiles = 0;
    ZEN_CUDA_TRY(flag(numel, KeyEquals<U>{data, nan_key, state}, ws, tie_words, tie_ends, tie_num_words,
                      tie_num_tiles, stream));
    ZEN_CUDA_TRY(expand_bits(tie_words, tie_num_words, tie_ends, LastTie{state}, stream));
    return flag_chosen<U>(data, numel, nan_key, state, ws, plan, stream);
  });
}

cudaError_t threshold_select_count(const void* dense, int64_t numel, ValueKind kind, uint64_t min_key, Workspace& ws,
                                   SelectPlan& plan, cudaStream_t stream) {
  plan = SelectPlan{};
  plan.dense = dense;
  plan.kind = kind;
  if (!is_float(kind) || min_key == 0) return cudaErrorInvalidValue;
  if (numel == 0) return cudaSuccess;
  return with_bits(kind, [&](auto tag) {
    using U = decltype(tag);
    const U nan_key = static_cast<U>(inf_key(kind) + 1);
    auto* state = ws.get_n<SelectState>(1);
    init_state_kernel<<<1, 1, 0, stream>>>(state, min_key - 1, 0);  // keys > min_key - 1, no ties
    ZEN_CUDA_TRY(cudaGetLastError());
    return flag_chosen<U>(static_cast<const U*>(dense), numel, nan_key, state, ws, plan, stream);
  });
}

template <typename index_t>
cudaError_t select_write(const SelectPlan& plan, index_t* indices, void* values, cudaStream_t stream) {
  if (plan.count == 0) return cudaSuccess;
  return with_bits(plan.kind, [&](auto tag) {
    using U = decltype(tag);
    const ChosenWriter<U, index_t> writer{static_cast<const U*>(plan.dense), indices, static_cast<U*>(values)};
    return expand_bits(plan.words, plan.num_words, plan.tile_ends, writer, stream);
  });
}

template cudaError_t select_write<int32_t>(const SelectPlan&, int32_t*, void*, cudaStream_t);
template cudaError_t select_write<int64_t>(const SelectPlan&, int64_t*, void*, cudaStream_t);

}  // namespace gpu
}  // namespace zen
