// Bit counting for the CPU kernels. GCC and Clang compile __builtin_popcountll to one POPCNT instruction only
// where the target has it (setup.py adds -mpopcnt when the build machine does); elsewhere it is a call into
// libgcc, so the kernels count with this inline, branch-free fallback instead.
#pragma once
#include <cstdint>

namespace zen {

inline int popcount64(uint64_t x) {
#if defined(__POPCNT__) || !(defined(__x86_64__) || defined(__i386__))
  return __builtin_popcountll(x);
#else
  x = x - ((x >> 1) & 0x5555555555555555ULL);
  x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
  x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
  return static_cast<int>((x * 0x0101010101010101ULL) >> 56);
#endif
}

}  // namespace zen
