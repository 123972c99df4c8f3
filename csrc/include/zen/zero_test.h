// What counts as a non-zero, on the element's bits: any set bit but the sign of a float. So NaN and Inf
// are non-zeros (they must reach the sum, as in dense allreduce) and -0.0 is a zero.
#pragma once
#include <cstdint>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace zen {

template <int Bytes> struct UnsignedOfSize;
template <> struct UnsignedOfSize<1> { using type = uint8_t; };
template <> struct UnsignedOfSize<2> { using type = uint16_t; };
template <> struct UnsignedOfSize<4> { using type = uint32_t; };
template <> struct UnsignedOfSize<8> { using type = uint64_t; };

template <typename T>
struct ZeroTest {
  using bits_t = typename UnsignedOfSize<sizeof(T)>::type;
  static constexpr bool kFloat = std::is_floating_point<T>::value || std::is_same<T, c10::Half>::value ||
                                 std::is_same<T, c10::BFloat16>::value;
  static constexpr bits_t kSignBit = bits_t(bits_t(1) << (8 * sizeof(T) - 1));
  static constexpr bits_t kMask = kFloat ? bits_t(~kSignBit) : bits_t(~bits_t(0));
};

}  // namespace zen
