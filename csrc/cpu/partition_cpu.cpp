// Hierarchical hash partition (ZEN, section 3 of the design notes), on CPU threads.
//
// Level 1: partition j = h0(index). Level 2: each partition owns a parallel memory of
// ceil(table_factor * count_j) slots; an element tries num_probes hashed slots, claiming one with a
// compare-and-swap (the read-after-write check done atomically: the CAS returns what a racing writer
// left there, and the loser moves to its next probe). When every probe is taken it appends to the
// partition's serial memory (ceil(serial_factor * slots_j) entries) through an atomic counter. If a
// serial memory overflows, the tables are dropped and an exact counting sort runs instead: nothing is
// ever lost. Slots hold input position + 1 (0 = empty), so index 0 and duplicates are kept as well.
//
// num_probes == 0 skips level 2 and runs the stable counting sort directly: on CPU caches the random
// table accesses cost more than the sort they avoid (see the README's kernel table), and the pieces of
// an ascending input stay ascending, which lets the servers merge instead of hash.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <vector>

#include "zen/checks.h"
#include "zen/hash.h"

namespace zen {
namespace {

constexpr int64_t kGrain = 1 << 14;

template <typename index_t>
void count_partitions(const index_t* idx, int64_t nnz, uint32_t n, uint64_t seed, int32_t* part,
                      std::vector<int64_t>& counts) {
  std::vector<std::atomic<int64_t>> shared(n);
  for (auto& c : shared) c.store(0);
  at::parallel_for(0, nnz, kGrain, [&](int64_t b, int64_t e) {
    std::vector<int64_t> local(n, 0);
    for (int64_t i = b; i < e; ++i) {
      const uint32_t j = partition_of(idx[i], seed, n);
      part[i] = static_cast<int32_t>(j);
      ++local[j];
    }
    for (uint32_t j = 0; j < n; ++j)
      if (local[j]) shared[j].fetch_add(local[j], std::memory_order_relaxed);
  });
  counts.resize(n);
  for (uint32_t j = 0; j < n; ++j) counts[j] = shared[j].load();
}

// A stable counting sort by partition: the exact fallback, and the whole method when num_probes == 0.
// Chunks count their partitions, then write at (partition offset + counts of earlier chunks).
void counting_sort(const int32_t* part, int64_t nnz, uint32_t n, const std::vector<int64_t>& offsets, int64_t* order) {
  const int64_t chunk = 1 << 16;
  const int64_t num_chunks = (nnz + chunk - 1) / chunk;
  std::vector<int64_t> cursor(num_chunks * n, 0);
  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t i = c * chunk, e = std::min(nnz, i + chunk); i < e; ++i) ++cursor[c * n + part[i]];
  });
  for (uint32_t j = 0; j < n; ++j) {
    int64_t at = offsets[j];
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int64_t count = cursor[c * n + j];
      cursor[c * n + j] = at;
      at += count;
    }
  }
  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t i = c * chunk, e = std::min(nnz, i + chunk); i < e; ++i) order[cursor[c * n + part[i]]++] = i;
  });
}

// Returns false when a serial memory overflowed (the caller then falls back).
template <typename index_t>
bool hash_tables(const index_t* idx, const int32_t* part, int64_t nnz, uint64_t seed, int num_probes,
                 const std::vector<int64_t>& counts, double table_factor, double serial_factor,
                 const std::vector<int64_t>& offsets, int64_t* order, int64_t* stats) {
  const size_t n = counts.size();
  std::vector<int64_t> table_begin(n + 1, 0), serial_begin(n + 1, 0), table_size(n), serial_size(n);
  for (size_t j = 0; j < n; ++j) {
    table_size[j] = counts[j] ? std::max<int64_t>(1, (int64_t)std::ceil(table_factor * counts[j])) : 0;
    serial_size[j] = counts[j] ? (int64_t)std::ceil(serial_factor * table_size[j]) : 0;
    table_begin[j + 1] = table_begin[j] + table_size[j];
    serial_begin[j + 1] = serial_begin[j] + serial_size[j];
  }
  std::vector<int64_t> table(table_begin[n], kEmptySlot), serial(serial_begin[n], kEmptySlot);
  std::vector<std::atomic<int64_t>> serial_used(n);
  for (auto& s : serial_used) s.store(0);
  std::atomic<bool> overflow{false};
  std::atomic<int64_t> placed_serial{0};

  at::parallel_for(0, nnz, kGrain, [&](int64_t b, int64_t e) {
    int64_t local_serial = 0;
    for (int64_t i = b; i < e && !overflow.load(std::memory_order_relaxed); ++i) {
      const int32_t j = part[i];
      int64_t* slots = table.data() + table_begin[j];
      bool placed = false;
      for (int p = 0; p < num_probes && !placed; ++p) {
        int64_t* slot = slots + probe_slot(idx[i], seed, p, table_size[j]);
        int64_t expected = kEmptySlot;
        placed = __atomic_load_n(slot, __ATOMIC_RELAXED) == kEmptySlot &&
                 __atomic_compare_exchange_n(slot, &expected, i + 1, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
      }
      if (placed) continue;
      const int64_t at = serial_used[j].fetch_add(1, std::memory_order_relaxed);
      if (at >= serial_size[j]) {
        overflow.store(true, std::memory_order_relaxed);
        break;
      }
      serial[serial_begin[j] + at] = i + 1;
      ++local_serial;
    }
    placed_serial.fetch_add(local_serial, std::memory_order_relaxed);
  });
  if (overflow.load()) return false;

  // Compaction: partition j's occupied slots, then its serial entries, into its output range.
  at::parallel_for(0, (int64_t)n, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      int64_t out = offsets[j];
      for (int64_t s = table_begin[j]; s < table_begin[j + 1]; ++s)
        if (table[s] != kEmptySlot) order[out++] = table[s] - 1;
      const int64_t used = serial_used[j].load();
      for (int64_t s = 0; s < used; ++s) order[out++] = serial[serial_begin[j] + s] - 1;
      TORCH_INTERNAL_ASSERT(out == offsets[j + 1], "zen partition lost an element of partition ", j);
    }
  });
  stats[0] = nnz - placed_serial.load();
  stats[1] = placed_serial.load();
  return true;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> partition_cpu(
    const at::Tensor& indices, const at::Tensor& values, int64_t num_partitions, int64_t seed,
    int64_t num_probes, double table_factor, double serial_factor) {
  check_pair(indices, values);
  check_partitions(num_partitions);
  check_partition_settings(num_probes, table_factor, serial_factor);
  const int64_t nnz = indices.numel();
  const uint32_t n = static_cast<uint32_t>(num_partitions);
  auto part = at::empty({nnz}, indices.options().dtype(at::kInt));
  auto order = at::empty({nnz}, indices.options().dtype(at::kLong));
  auto stats = at::zeros({3}, indices.options().dtype(at::kLong));
  std::vector<int64_t> counts;

  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "zen_partition", [&] {
    const index_t* idx = indices.const_data_ptr<index_t>();
    count_partitions(idx, nnz, n, (uint64_t)seed, part.data_ptr<int32_t>(), counts);
    std::vector<int64_t> offsets(n + 1, 0);
    for (uint32_t j = 0; j < n; ++j) offsets[j + 1] = offsets[j] + counts[j];
    if (num_probes == 0) {
      counting_sort(part.data_ptr<int32_t>(), nnz, n, offsets, order.data_ptr<int64_t>());
    } else if (!hash_tables(idx, part.data_ptr<int32_t>(), nnz, (uint64_t)seed, (int)num_probes, counts,
                            table_factor, serial_factor, offsets, order.data_ptr<int64_t>(), stats.data_ptr<int64_t>())) {
      counting_sort(part.data_ptr<int32_t>(), nnz, n, offsets, order.data_ptr<int64_t>());
      stats.data_ptr<int64_t>()[2] = 1;
    }
  });
  auto counts_t = at::tensor(counts, indices.options().dtype(at::kLong));
  return {indices.index_select(0, order), values.index_select(0, order), counts_t, stats};
}

at::Tensor hash_partition_cpu(const at::Tensor& indices, int64_t num_partitions, int64_t seed) {
  check_index(indices, "indices");
  check_partitions(num_partitions);
  auto out = at::empty({indices.numel()}, indices.options().dtype(at::kInt));
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "zen_hash_partition", [&] {
    const index_t* idx = indices.const_data_ptr<index_t>();
    int32_t* o = out.data_ptr<int32_t>();
    at::parallel_for(0, indices.numel(), kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) o[i] = (int32_t)partition_of(idx[i], (uint64_t)seed, (uint32_t)num_partitions);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(zen, CPU, m) {
  m.impl("partition", &partition_cpu);
  m.impl("hash_partition", &hash_partition_cpu);
}

}  // namespace zen
