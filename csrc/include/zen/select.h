// The select ops' argument checks and host-side keys, shared by the CPU kernels and the CUDA binding.
#pragma once
#include <torch/extension.h>

#include <cstring>

#include "zen/checks.h"
#include "zen/magnitude.h"
#include "zen/zero_test.h"

namespace zen {

inline void check_select(const at::Tensor& dense, const char* op) {
  check_1d(dense, "dense");
  const auto t = dense.scalar_type();
  TORCH_CHECK(t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble, op,
              ": dense must be float16, bfloat16, float32 or float64, got ", t);
}

inline void check_topk_k(int64_t k) { TORCH_CHECK(k >= 0, "topk_select: k must be >= 0, got ", k); }

inline void check_threshold(double threshold) {  // NaN fails too
  TORCH_CHECK(threshold >= 0, "threshold_select: threshold must be >= 0 (a magnitude), got ", threshold);
}

// Magnitude keys of a float type: its bits' type and the key every NaN gets.
template <typename scalar_t> struct Magnitude;
template <> struct Magnitude<c10::Half> { static constexpr uint16_t kNanKey = kHalfInfKey + 1; };
template <> struct Magnitude<c10::BFloat16> { static constexpr uint16_t kNanKey = kBFloat16InfKey + 1; };
template <> struct Magnitude<float> { static constexpr uint32_t kNanKey = kFloatInfKey + 1; };
template <> struct Magnitude<double> { static constexpr uint64_t kNanKey = kDoubleInfKey + 1; };

// The smallest key threshold_select takes: threshold converted to the dtype the way torch converts a Python
// float it compares a tensor with (so the op equals `(x.abs() >= threshold) & (x != 0) | x.isnan()`), as
// a key, and at least 1 so that no zero is ever taken.
template <typename scalar_t>
uint64_t threshold_key(double threshold) {
  using bits_t = typename UnsignedOfSize<sizeof(scalar_t)>::type;
  const scalar_t converted = static_cast<scalar_t>(threshold);
  bits_t bits;
  std::memcpy(&bits, &converted, sizeof(bits));
  const bits_t key = magnitude_key<bits_t>(bits, Magnitude<scalar_t>::kNanKey);
  return key > 0 ? key : 1;
}

}  // namespace zen
