// CUDA kernels of zen's ops (schemas in ops.cpp): the checks and error messages of the CPU kernels,
// output allocation, the current stream, and calls of the launchers in kernels.cuh, where the work is.
// Errors the device finds (invalid indices, corrupt bitmaps) come back from the launchers as values and
// become TORCH_CHECK errors here, worded as the CPU kernels word them.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>  // C10_CUDA_CHECK
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>     // getCurrentCUDAStream (what at::cuda:: re-exports), without cuBLAS headers
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "kernels.cuh"
#include "zen/checks.h"
#include "zen/hash.h"
#include "zen/select.h"

namespace zen {
namespace {

// Scratch memory from torch's caching allocator, held until the op returns. Blocks the allocator takes
// back are reused in stream order, and all of an op's work runs on the current stream: no sync needed.
class TensorWorkspace final : public gpu::Workspace {
 public:
  explicit TensorWorkspace(const at::Device& device) : options_(at::TensorOptions().dtype(at::kByte).device(device)) {}
  void* get(size_t bytes) override {
    held_.push_back(at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 16))}, options_));
    return held_.back().data_ptr();
  }

 private:
  at::TensorOptions options_;
  std::vector<at::Tensor> held_;
};

gpu::ValueKind value_kind(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kByte: return gpu::ValueKind::kUInt8;
    case at::kChar: return gpu::ValueKind::kInt8;
    case at::kShort: return gpu::ValueKind::kInt16;
    case at::kInt: return gpu::ValueKind::kInt32;
    case at::kLong: return gpu::ValueKind::kInt64;
    case at::kHalf: return gpu::ValueKind::kHalf;
    case at::kBFloat16: return gpu::ValueKind::kBFloat16;
    case at::kFloat: return gpu::ValueKind::kFloat;
    case at::kDouble: return gpu::ValueKind::kDouble;
    default: break;
  }
  TORCH_CHECK(false, name, " has dtype ", t,
              "; zen's kernels take integers, float16, bfloat16, float32 and float64");
  return gpu::ValueKind::kFloat;  // unreachable
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
}

void check_same_device(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  TORCH_CHECK(a.device() == b.device(), a_name, " and ", b_name, " must be on the same device, got ", a.device(),
              " and ", b.device());
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

std::tuple<at::Tensor, at::Tensor> nonzero_cuda(const at::Tensor& dense) {
  check_1d(dense, "dense");
  check_cuda(dense, "dense");
  const auto kind = value_kind(dense.scalar_type(), "dense");
  const c10::cuda::CUDAGuard guard(dense.device());
  const cudaStream_t stream = current_stream();
  TensorWorkspace ws(dense.device());
  gpu::NonzeroPlan plan;
  C10_CUDA_CHECK(gpu::nonzero_count(dense.const_data_ptr(), dense.numel(), kind, ws, plan, stream));
  auto indices = at::empty({plan.nnz}, dense.options().dtype(index_type_for(dense.numel())));
  auto values = at::empty({plan.nnz}, dense.options());
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "zen_nonzero_cuda", [&] {
    C10_CUDA_CHECK(gpu::nonzero_write<index_t>(plan, indices.data_ptr<index_t>(), values.data_ptr(), stream));
  });
  return {indices, values};
}

std::tuple<at::Tensor, at::Tensor> nonzero_blocks_cuda(const at::Tensor& dense, int64_t block_size) {
  check_1d(dense, "dense");
  check_cuda(dense, "dense");
  const int64_t blocks = num_blocks(dense, block_size);
  const auto kind = value_kind(dense.scalar_type(), "dense");
  const c10::cuda::CUDAGuard guard(dense.device());
  const cudaStream_t stream = current_stream();
  TensorWorkspace ws(dense.device());
  gpu::NonzeroBlocksPlan plan;
  C10_CUDA_CHECK(gpu::nonzero_blocks_count(dense.const_data_ptr(), blocks, block_size, kind, ws, plan, stream));
  auto ids = at::empty({plan.nnz_blocks}, dense.options().dtype(index_type_for(blocks)));
  auto rows = at::empty({plan.nnz_blocks, block_size}, dense.options());
  AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "zen_nonzero_blocks_cuda", [&] {
    C10_CUDA_CHECK(gpu::nonzero_blocks_write<index_t>(plan, ids.data_ptr<index_t>(), rows.data_ptr(), stream));
  });
  return {ids, rows};
}

// On the device, like every output here: nothing waits until the caller reads it.
at::Tensor count_nonzero_cuda(const at::Tensor& dense, int64_t block_size) {
  check_1d(dense, "dense");
  check_cuda(dense, "dense");
  const int64_t blocks = num_blocks(dense, block_size);
  const auto kind = value_kind(dense.scalar_type(), "dense");
  const c10::cuda::CUDAGuard guard(dense.device());
  TensorWorkspace ws(dense.device());
  auto out = at::empty({2}, dense.options().dtype(at::kLong));
  C10_CUDA_CHECK(gpu::count_nonzero(dense.const_data_ptr(), blocks, block_size, kind, out.data_ptr<int64_t>(), ws,
                                    current_stream()));
  return out;
}

// The chosen elements of a select plan as (indices, values), after its one host read of their number.
std::tuple<at::Tensor, at::Tensor> select_outputs(const at::Tensor& dense, const gpu::SelectPlan& plan,
                                                  cudaStream_t stream) {
  auto indices = at::empty({plan.count}, dense.options().dtype(index_type_for(dense.numel())));
  auto values = at::empty({plan.count}, dense.options());
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "zen_select_cuda", [&] {
    C10_CUDA_CHECK(gpu::select_write<index_t>(plan, indices.data_ptr<index_t>(), values.data_ptr(), stream));
  });
  return {indices, values};
}

std::tuple<at::Tensor, at::Tensor> topk_select_cuda(const at::Tensor& dense, int64_t k) {
  check_select(dense, "topk_select");
  check_topk_k(k);
  check_cuda(dense, "dense");
  const auto kind = value_kind(dense.scalar_type(), "dense");
  const c10::cuda::CUDAGuard guard(dense.device());
  const cudaStream_t stream = current_stream();
  TensorWorkspace ws(dense.device());
  gpu::SelectPlan plan;
  C10_CUDA_CHECK(gpu::topk_select_count(dense.const_data_ptr(), dense.numel(), kind, k, ws, plan, stream));
  return select_outputs(dense, plan, stream);
}

std::tuple<at::Tensor, at::Tensor> threshold_select_cuda(const at::Tensor& dense, double threshold) {
  check_select(dense, "threshold_select");
  check_threshold(threshold);
  check_cuda(dense, "dense");
  const auto kind = value_kind(dense.scalar_type(), "dense");
  uint64_t min_key = 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dense.scalar_type(), "zen_threshold_select_cuda",
                                  [&] { min_key = threshold_key<scalar_t>(threshold); });
  const c10::cuda::CUDAGuard guard(dense.device());
  const cudaStream_t stream = current_stream();
  TensorWorkspace ws(dense.device());
  gpu::SelectPlan plan;
  C10_CUDA_CHECK(gpu::threshold_select_count(dense.const_data_ptr(), dense.numel(), kind, min_key, ws, plan, stream));
  return select_outputs(dense, plan, stream);
}

at::Tensor hash_partition_cuda(const at::Tensor& indices, int64_t num_partitions, int64_t seed) {
  check_index(indices, "indices");
  check_cuda(indices, "indices");
  check_partitions(num_partitions);
  const c10::cuda::CUDAGuard guard(indices.device());
  const cudaStream_t stream = current_stream();
  auto out = at::empty({indices.numel()}, indices.options().dtype(at::kInt));
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "zen_hash_partition_cuda", [&] {
    C10_CUDA_CHECK(gpu::hash_partition<index_t>(indices.const_data_ptr<index_t>(), indices.numel(),
                                                static_cast<uint32_t>(num_partitions), static_cast<uint64_t>(seed),
                                                out.data_ptr<int32_t>(), stream));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> partition_cuda(
    const at::Tensor& indices, const at::Tensor& values, int64_t num_partitions, int64_t seed,
    int64_t num_probes, double table_factor, double serial_factor) {
  check_pair(indices, values);
  check_cuda(indices, "indices");
  check_partitions(num_partitions);
  check_partition_settings(num_probes, table_factor, serial_factor);
  const auto kind = value_kind(values.scalar_type(), "values");
  const c10::cuda::CUDAGuard guard(indices.device());
  const cudaStream_t stream = current_stream();
  TensorWorkspace ws(indices.device());
  const int64_t nnz = indices.numel();
  auto out_indices = at::empty({nnz}, indices.options());
  auto out_values = at::empty(values.sizes(), values.options());  // [nnz] or rows [nnz, b]
  auto counts = at::empty({num_partitions}, indices.options().dtype(at::kLong));
  auto stats = at::empty({3}, indices.options().dtype(at::kLong));
  gpu::PartitionArgs args;
  args.num_partitions = static_cast<uint32_t>(num_partitions);
  args.seed = static_cast<uint64_t>(seed);
  args.num_probes = static_cast<int>(num_probes);
  args.table_factor = table_factor;
  args.serial_factor = serial_factor;
  gpu::PartitionResult result;
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "zen_partition_cuda", [&] {
    C10_CUDA_CHECK(gpu::partition<index_t>(indices.const_data_ptr<index_t>(), values.const_data_ptr(), kind, nnz,
                                           row_width(values), args, out_indices.data_ptr<index_t>(),
                                           out_values.data_ptr(), counts.data_ptr<int64_t>(),
                                           stats.data_ptr<int64_t>(), ws, result, stream));
  });
  TORCH_INTERNAL_ASSERT(num_probes == 0 || result.fallback || result.compacted == nnz, "zen partition (CUDA) found ", result.compacted,
                        " of ", nnz, " elements in its tables");
  return {out_indices, out_values, counts, stats};
}

std::tuple<at::Tensor, at::Tensor> aggregate_cuda(const at::Tensor& indices, const at::Tensor& values, int64_t numel,
                                                  int64_t num_partitions, int64_t seed, int64_t partition) {
  check_pair(indices, values);
  check_cuda(indices, "indices");
  check_partitions(num_partitions);
  TORCH_CHECK(numel >= 0, "numel must be >= 0, got ", numel);
  TORCH_CHECK(partition < num_partitions, "partition must be < num_partitions, got ", partition);
  const auto kind = value_kind(values.scalar_type(), "values");
  const c10::cuda::CUDAGuard guard(indices.device());
  const cudaStream_t stream = current_stream();
  TensorWorkspace ws(indices.device());
  at::Tensor out_indices, out_values;
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "zen_aggregate_cuda", [&] {
    gpu::AggregatePlan plan;
    C10_CUDA_CHECK(gpu::aggregate_prepare<index_t>(indices.const_data_ptr<index_t>(), values.const_data_ptr(), kind,
                                                   indices.numel(), row_width(values), numel,
                                                   static_cast<uint32_t>(num_partitions), static_cast<uint64_t>(seed),
                                                   partition, ws, plan, stream));
    if (plan.first_bad >= 0) {  // the CPU op's first failing check on the first invalid element
      const int64_t index = plan.bad_index;
      TORCH_CHECK(index >= 0 && index < numel, "received index ", index, " is outside [0, ", numel,
                  "): corrupt or mismatched buffer");
      TORCH_CHECK(false, "received index ", index, " does not belong to partition ", partition,
                  ": corrupt buffer or peers with different seeds");
    }
    out_indices = at::empty({plan.num_unique}, indices.options());
    out_values = values.dim() == 1 ? at::empty({plan.num_unique}, values.options())
                                   : at::empty({plan.num_unique, values.size(1)}, values.options());
    C10_CUDA_CHECK(gpu::aggregate_write<index_t>(plan, out_indices.data_ptr<index_t>(), out_values.data_ptr(), stream));
  });
  return {out_indices, out_values};
}

std::tuple<at::Tensor, at::Tensor> bitmap_index_sets_cuda(const at::Tensor& device_like, int64_t numel,
                                                          int64_t num_partitions, int64_t seed) {
  check_cuda(device_like, "device_like");
  check_partitions(num_partitions);
  TORCH_CHECK(numel >= 0, "numel must be >= 0, got ", numel);
  const c10::cuda::CUDAGuard guard(device_like.device());
  const cudaStream_t stream = current_stream();
  TensorWorkspace ws(device_like.device());
  auto opts = device_like.options();
  auto sets = at::empty({numel}, opts.dtype(index_type_for(numel)));
  auto offsets = at::empty({num_partitions + 1}, opts.dtype(at::kLong));
  AT_DISPATCH_INDEX_TYPES(sets.scalar_type(), "zen_bitmap_index_sets_cuda", [&] {
    C10_CUDA_CHECK(gpu::bitmap_index_sets<index_t>(numel, static_cast<uint32_t>(num_partitions),
                                                   static_cast<uint64_t>(seed), sets.data_ptr<index_t>(),
                                                   offsets.data_ptr<int64_t>(), ws, stream));
  });
  return {sets, offsets};
}

at::Tensor bitmap_encode_cuda(const at::Tensor& indices, const at::Tensor& index_set) {
  check_index(indices, "indices");
  check_index(index_set, "index_set");
  TORCH_CHECK(indices.scalar_type() == index_set.scalar_type(), "indices and index_set must have the same dtype");
  check_cuda(indices, "indices");
  check_same_device(indices, "indices", index_set, "index_set");
  const c10::cuda::CUDAGuard guard(indices.device());
  const cudaStream_t stream = current_stream();
  TensorWorkspace ws(indices.device());
  const int64_t bits = index_set.numel();
  auto bitmap = at::empty({(bits + 7) / 8}, indices.options().dtype(at::kByte));
  gpu::BitmapEncodeResult result;
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "zen_bitmap_encode_cuda", [&] {
    C10_CUDA_CHECK(gpu::bitmap_encode<index_t>(indices.const_data_ptr<index_t>(), indices.numel(),
                                               index_set.const_data_ptr<index_t>(), bits, bitmap.data_ptr<uint8_t>(),
                                               ws, result, stream));
  });
  if (result.first_bad >= 0) {
    TORCH_CHECK(!result.not_ascending, "bitmap_encode: indices must be strictly ascending");
    TORCH_CHECK(false, "bitmap_encode: index ", result.bad_index, " is not in the partition's index set");
  }
  return bitmap;
}

at::Tensor bitmap_decode_cuda(const at::Tensor& bitmap, const at::Tensor& index_set, int64_t count) {
  check_1d(bitmap, "bitmap");
  check_index(index_set, "index_set");
  TORCH_CHECK(bitmap.scalar_type() == at::kByte, "bitmap must be uint8, got ", bitmap.scalar_type());
  check_cuda(bitmap, "bitmap");
  check_same_device(bitmap, "bitmap", index_set, "index_set");
  const int64_t bits = index_set.numel();
  TORCH_CHECK(bitmap.numel() == (bits + 7) / 8, "bitmap has ", bitmap.numel(), " bytes, expected ", (bits + 7) / 8,
              " for an index set of ", bits, ": truncated or corrupt buffer");
  const c10::cuda::CUDAGuard guard(bitmap.device());
  const cudaStream_t stream = current_stream();
  TensorWorkspace ws(bitmap.device());
  gpu::BitmapDecodePlan plan;
  C10_CUDA_CHECK(gpu::bitmap_decode_count(bitmap.const_data_ptr<uint8_t>(), bits, ws, plan, stream));
  TORCH_CHECK(!plan.bits_past_end, "bitmap has bits set past its index set: corrupt buffer");
  TORCH_CHECK(count < 0 || plan.set_bits == count, "bitmap has ", plan.set_bits, " bits set, expected ", count,
              ": corrupt buffer");
  auto out = at::empty({plan.set_bits}, index_set.options());
  AT_DISPATCH_INDEX_TYPES(index_set.scalar_type(), "zen_bitmap_decode_cuda", [&] {
    C10_CUDA_CHECK(gpu::bitmap_decode_write<index_t>(plan, index_set.const_data_ptr<index_t>(), out.data_ptr<index_t>(),
                                                     stream));
  });
  return out;
}

void scatter_cuda(at::Tensor& out, const at::Tensor& indices, const at::Tensor& values) {
  check_pair(indices, values);
  const int64_t width = row_width(values), blocks = check_out(out, values);
  check_cuda(out, "out");
  check_same_device(out, "out", indices, "indices");
  const auto kind = value_kind(values.scalar_type(), "values");
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = current_stream();
  TensorWorkspace ws(out.device());
  gpu::ScatterResult result;
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "zen_scatter_cuda", [&] {
    C10_CUDA_CHECK(gpu::scatter<index_t>(out.data_ptr(), blocks, width, indices.const_data_ptr<index_t>(),
                                         values.const_data_ptr(), kind, indices.numel(), ws, result, stream));
  });
  TORCH_CHECK(result.written, "scatter index out of range: [", result.lo, ", ", result.hi, "] for an output of ",
              blocks, " blocks");
}

}  // namespace

TORCH_LIBRARY_IMPL(zen, CUDA, m) {
  m.impl("nonzero", &nonzero_cuda);
  m.impl("nonzero_blocks", &nonzero_blocks_cuda);
  m.impl("count_nonzero", &count_nonzero_cuda);
  m.impl("topk_select", &topk_select_cuda);
  m.impl("threshold_select", &threshold_select_cuda);
  m.impl("hash_partition", &hash_partition_cuda);
  m.impl("partition", &partition_cuda);
  m.impl("aggregate", &aggregate_cuda);
  m.impl("bitmap_index_sets", &bitmap_index_sets_cuda);
  m.impl("bitmap_encode", &bitmap_encode_cuda);
  m.impl("bitmap_decode", &bitmap_decode_cuda);
  m.impl("scatter_", &scatter_cuda);
}

}  // namespace zen
