// Argument checks shared by the CPU and CUDA bindings.
#pragma once
#include <torch/extension.h>

namespace zen {

inline void check_1d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D, got ", t.dim(), " dimensions");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline void check_index(const at::Tensor& t, const char* name) {
  check_1d(t, name);
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name,
              " must be int32 or int64, got ", t.scalar_type());
}

// values holds one value per index ([k]) or one row of b values per index ([k, b]: a block of the tensor).
inline void check_pair(const at::Tensor& indices, const at::Tensor& values) {
  check_index(indices, "indices");
  TORCH_CHECK(values.dim() == 1 || values.dim() == 2, "values must be 1-D, or 2-D rows, got ", values.dim(),
              " dimensions");
  TORCH_CHECK(values.is_contiguous(), "values must be contiguous");
  TORCH_CHECK(indices.numel() == values.size(0), "indices and values must have the same length, got ",
              indices.numel(), " and ", values.size(0));
  TORCH_CHECK(indices.device() == values.device(), "indices and values must be on the same device");
}

// Values per index: 1 for [k] values, b for [k, b] rows.
inline int64_t row_width(const at::Tensor& values) { return values.dim() == 2 ? values.size(1) : 1; }

// A dense tensor seen as rows of block_size elements: the block size must divide it.
inline int64_t num_blocks(const at::Tensor& dense, int64_t block_size) {
  TORCH_CHECK(block_size >= 1, "block_size must be >= 1, got ", block_size);
  TORCH_CHECK(dense.numel() % block_size == 0, "block_size ", block_size, " does not divide the tensor's ",
              dense.numel(), " elements");
  return dense.numel() / block_size;
}

// The output of a scatter of `values`: 1-D, of the values' dtype, tiled by rows of their width. Returns its
// number of rows.
inline int64_t check_out(const at::Tensor& out, const at::Tensor& values) {
  check_1d(out, "out");
  TORCH_CHECK(out.scalar_type() == values.scalar_type(), "out and values must have the same dtype, got ",
              out.scalar_type(), " and ", values.scalar_type());
  return num_blocks(out, row_width(values));
}

// scatter_pieces_'s arguments, every piece checked before anything is written: as many index pieces as value
// pieces, each a pair (check_pair) for out (check_out), all of one row width and one index dtype. Returns
// out's number of rows (0 where there are no pieces).
inline int64_t check_pieces(const at::Tensor& out, at::TensorList indices, at::TensorList values) {
  TORCH_CHECK(indices.size() == values.size(), "scatter_pieces_: ", indices.size(), " index pieces but ",
              values.size(), " value pieces");
  if (indices.empty()) return 0;
  const int64_t rows = check_out(out, values[0]), width = row_width(values[0]);
  for (size_t p = 0; p < indices.size(); ++p) {
    check_pair(indices[p], values[p]);
    check_out(out, values[p]);
    TORCH_CHECK(row_width(values[p]) == width && values[p].dim() == values[0].dim(),
                "scatter_pieces_: every piece's values must have the same row width");
    TORCH_CHECK(indices[p].scalar_type() == indices[0].scalar_type(),
                "scatter_pieces_: every piece's indices must have the same dtype, got ", indices[0].scalar_type(),
                " and ", indices[p].scalar_type());
  }
  return rows;
}

inline void check_partitions(int64_t n) {
  TORCH_CHECK(n >= 1 && n <= (1 << 20), "num_partitions must be in [1, 2^20], got ", n);
}

// The hierarchical hash's settings. Bounded above: the table sizes are ceil(factor * count) cast to
// int64, which must not overflow.
inline void check_partition_settings(int64_t num_probes, double table_factor, double serial_factor) {
  TORCH_CHECK(num_probes >= 0 && num_probes <= 16, "num_probes must be in [0, 16], got ", num_probes);
  TORCH_CHECK(table_factor >= 1.0 && table_factor <= 64.0, "table_factor must be in [1, 64] (slots per element), got ",
              table_factor);
  TORCH_CHECK(serial_factor >= 0.0 && serial_factor <= 64.0, "serial_factor must be in [0, 64], got ", serial_factor);
}

// Indices of a tensor with numel elements: int32 while every index fits, int64 from 2^31 elements on.
inline at::ScalarType index_type_for(int64_t numel) {
  return numel > (int64_t{1} << 31) - 1 ? at::kLong : at::kInt;
}

}  // namespace zen
