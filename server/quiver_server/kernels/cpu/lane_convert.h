// Conversions between a kernel's storage dtype and float32 that GCC vectorises.
//
// c10::BFloat16's conversion from float checks for NaN with a branch and goes through a
// constructor, and GCC left every loop storing bfloat16 scalar: SiLU and rotary ran 10x slower in
// bfloat16 than in float32. Here the same rounding (to nearest even, NaN to the quiet NaN 0x7FC0,
// as c10 rounds) is plain integer arithmetic on the bits, so the loops vectorise.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace quiver {

template <typename T>
inline float to_float(T value) {
  return static_cast<float>(value);
}

template <>
inline float to_float(c10::BFloat16 value) {
  const std::uint32_t bits = static_cast<std::uint32_t>(value.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

template <typename T>
inline T from_float(float value) {
  return static_cast<T>(value);
}

template <>
inline c10::BFloat16 from_float(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const std::uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const std::uint16_t out = value != value ? std::uint16_t{0x7FC0} : static_cast<std::uint16_t>(rounded);
  return c10::BFloat16(out, c10::BFloat16::from_bits());
}

// Rounds float32 to the storage dtype and back: the value a dtype-T intermediate holds.
template <typename T>
inline float round_to(float value) {
  return to_float(from_float<T>(value));
}

}  // namespace quiver
