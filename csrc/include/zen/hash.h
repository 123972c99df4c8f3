// The one definition of zen's hashes and partition rule, shared by the CPU kernels, the CUDA kernels
// and (through the `zen::hash_partition` op) the Python package and the tests.
#pragma once
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define ZEN_HD __host__ __device__ __forceinline__
#else
#define ZEN_HD inline
#endif

namespace zen {

// MurmurHash3's 64-bit finalizer: a bijection on uint64 with full avalanche.
ZEN_HD uint64_t fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb93fe53a87ebULL;
  k ^= k >> 33;
  return k;
}

// Level 1: h0(index, seed) -> partition in [0, n). Lemire's multiply-shift maps the top 32 hash bits
// onto [0, n) without a division and without the bias of a power-of-two mask.
ZEN_HD uint32_t partition_of(int64_t index, uint64_t seed, uint32_t n) {
  const uint64_t h = fmix64(static_cast<uint64_t>(index) ^ seed);
  return static_cast<uint32_t>(((h >> 32) * static_cast<uint64_t>(n)) >> 32);
}

// Level 2: the p-th probe (p = 0..k-1) of an index into a table of `size` slots. Each probe is a
// different hash of the index (seeded by p), not a linear step, so colliding indices scatter.
ZEN_HD uint64_t probe_slot(int64_t index, uint64_t seed, uint32_t p, uint64_t size) {
  const uint64_t salt = seed + 0x9e3779b97f4a7c15ULL * (static_cast<uint64_t>(p) + 1);
  return fmix64(static_cast<uint64_t>(index) ^ salt) % size;
}

// Slots of the hash tables hold index + 1, so that 0 can mean "empty" without losing flat index 0.
constexpr int64_t kEmptySlot = 0;

}  // namespace zen
