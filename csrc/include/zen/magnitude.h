// Magnitude keys: how the select ops rank floats, on their bits, the same way on the CPU and the GPU. A key
// is the element's bits without the sign, read as an unsigned integer: finite magnitudes order as |x| does
// and +-Inf comes above them. Every NaN, whatever its sign and payload, is folded into one key just above
// Inf, so NaNs rank first and tie with one another (ties go to the lower index). Both zeros are key 0.
#pragma once
#include <cstdint>

#ifndef ZEN_HD
#if defined(__CUDACC__) || defined(__HIPCC__)
#define ZEN_HD __host__ __device__ __forceinline__
#else
#define ZEN_HD inline
#endif
#endif

namespace zen {

// The key of +-Inf of each format; its NaN key is one more.
constexpr uint16_t kHalfInfKey = 0x7c00;
constexpr uint16_t kBFloat16InfKey = 0x7f80;
constexpr uint32_t kFloatInfKey = 0x7f800000u;
constexpr uint64_t kDoubleInfKey = 0x7ff0000000000000ull;

template <typename bits_t>
ZEN_HD bits_t magnitude_key(bits_t bits, bits_t nan_key) {
  const bits_t m = static_cast<bits_t>(bits & static_cast<bits_t>(~(bits_t(1) << (8 * sizeof(bits_t) - 1))));
  return m < nan_key ? m : nan_key;
}

}  // namespace zen
