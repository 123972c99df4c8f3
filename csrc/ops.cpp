// Operator schemas of zen's extension. Kernels register per device (cpu/, cuda/); the dispatcher picks
// the device from the tensor arguments, so call sites never branch on it.
#include <torch/library.h>
#include <torch/extension.h>

#include "zen/checks.h"

TORCH_LIBRARY(zen, m) {
  // Dense 1-D tensor -> (indices, values) of its non-zeros, ascending. A NaN is a non-zero; -0.0 is zero.
  // Indices are int32 below 2^31 elements, int64 from there.
  m.def("nonzero(Tensor dense) -> (Tensor indices, Tensor values)");
  // The same over blocks of block_size consecutive elements (which must divide the tensor): the ids of the
  // blocks holding a non-zero, ascending, and those blocks whole, as rows [k, block_size].
  m.def("nonzero_blocks(Tensor dense, int block_size) -> (Tensor ids, Tensor blocks)");
  // [non-zero elements, blocks of block_size holding a non-zero] (int64), in one pass.
  m.def("count_nonzero(Tensor dense, int block_size) -> Tensor");
  // Top-k by magnitude of a dense 1-D float tensor: (indices ascending, values) of its min(k, non-zeros)
  // entries of largest |x|. NaN ranks first, then +-Inf, then |x|; a zero is never chosen; ties at the k-th
  // magnitude go to the lower index, so the result is the same on every device. Index dtype as nonzero's.
  m.def("topk_select(Tensor dense, int k) -> (Tensor indices, Tensor values)");
  // Every non-zero of a dense 1-D float tensor with |x| >= threshold (>= 0, converted to the tensor's dtype
  // as torch converts a scalar it compares with), and every NaN: (indices ascending, values).
  m.def("threshold_select(Tensor dense, float threshold) -> (Tensor indices, Tensor values)");
  // Level-1 hash h0: the partition (int32, in [0, n)) of every index.
  m.def("hash_partition(Tensor indices, int num_partitions, int seed) -> Tensor");
  // Every op below that takes (indices, values) also takes values as rows [k, b]: one block of b values per
  // index, moved, summed and written whole.
  // Hierarchical hash partition: (indices, values) grouped by partition, counts per partition, and
  // stats = [placed in parallel memory, placed in serial memory, 1 if the serial memory overflowed and
  // the exact fallback ran].
  m.def(
      "partition(Tensor indices, Tensor values, int num_partitions, int seed, int num_probes, "
      "float table_factor, float serial_factor) -> (Tensor indices, Tensor values, Tensor counts, Tensor stats)");
  // Sum duplicate indices: the union, ascending. Validates every index against [0, numel) and, when
  // partition >= 0, that h0 sends it to that partition.
  m.def(
      "aggregate(Tensor indices, Tensor values, int numel, int num_partitions, int seed, int partition) "
      "-> (Tensor indices, Tensor values)");
  // I_j = sorted {i in [0, numel) : h0(i) = j} for all j, concatenated, with offsets[n + 1].
  // device_like only selects the device.
  m.def("bitmap_index_sets(Tensor device_like, int numel, int num_partitions, int seed) -> (Tensor, Tensor)");
  // Bitmap (uint8, bit r = byte r/8, bit r%8) over index_set of an ascending subset of it, and back.
  m.def("bitmap_encode(Tensor indices, Tensor index_set) -> Tensor");
  m.def("bitmap_decode(Tensor bitmap, Tensor index_set, int count) -> Tensor");
  // out[indices[i]] = values[i], bounds checked (rows: block indices[i] of out, b elements).
  m.def("scatter_(Tensor(a!) out, Tensor indices, Tensor values) -> ()");
  // scatter_ of several pieces with disjoint indices (each ascending, for the CPU's blocked writes).
  m.def("scatter_pieces_(Tensor(a!) out, Tensor[] indices, Tensor[] values) -> ()");
}

// Any device without its own scatter_pieces_ (the GPU, whose random writes gain nothing from blocking):
// one scatter_ per piece, after every piece is checked as the CPU kernel checks it (zen::check_pieces, then
// the bounds), so a bad piece leaves out untouched. The bounds are read back once, for all pieces.
static void scatter_pieces_each(at::Tensor& out, at::TensorList indices, at::TensorList values) {
  const int64_t blocks = zen::check_pieces(out, indices, values);
  std::vector<at::Tensor> bounds;
  for (size_t p = 0; p < indices.size(); ++p) {
    if (indices[p].numel() == 0) continue;
    const auto [lo, hi] = at::aminmax(indices[p]);
    bounds.push_back(at::stack({lo.to(at::kLong), hi.to(at::kLong)}));
  }
  if (!bounds.empty()) {
    const auto read = at::stack(bounds).cpu();
    const auto rows = read.accessor<int64_t, 2>();
    for (int64_t p = 0; p < read.size(0); ++p) {
      TORCH_CHECK(rows[p][0] >= 0 && rows[p][1] < blocks, "scatter index out of range: [", rows[p][0], ", ",
                  rows[p][1], "] for an output of ", blocks, " blocks");
    }
  }
  static const auto scatter = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("zen::scatter_", "")
                                  .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  for (size_t p = 0; p < indices.size(); ++p) scatter.call(out, indices[p], values[p]);
}

TORCH_LIBRARY_IMPL(zen, CompositeExplicitAutograd, m) { m.impl("scatter_pieces_", &scatter_pieces_each); }

static bool has_cuda_kernels() {
#ifdef ZEN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

static bool has_openmp() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_cuda_kernels", &has_cuda_kernels, "whether the CUDA kernels were compiled in");
  m.def("has_openmp", &has_openmp, "whether the CPU kernels were compiled with OpenMP");
#ifdef ZEN_CUDA_VERSION
  m.attr("cuda_version") = ZEN_CUDA_VERSION;
#else
  m.attr("cuda_version") = pybind11::none();
#endif
}
