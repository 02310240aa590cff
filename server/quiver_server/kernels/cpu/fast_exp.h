// exp for float that the compiler can vectorise (std::exp is a scalar libm call per element,
// which dominated the softmax of decode attention and the SiLU of the MLP).
//
// Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2, then Cephes' expf polynomial for e^r and
// 2^k assembled in the exponent bits: within 2 ulp of the correctly rounded value over the
// clamped range. Inputs below -87.3 give ~1e-38 instead of a denormal or zero; the callers only
// use it where such a value is negligible (softmax weights relative to the largest, SiLU).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace quiver {

inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  // Round to nearest without a rounding instruction the baseline x86-64 target lacks.
  constexpr float kShifter = 12582912.0f;  // 1.5 * 2^23
  const float k = (x * 1.44269504088896341f + kShifter) - kShifter;
  float r = x - k * 0.693145751953125f;
  r = r - k * 1.428606765330187045e-06f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const std::int32_t bits = (static_cast<std::int32_t>(k) + 127) << 23;
  // memcpy rather than std::bit_cast: torch's cpp_extension may compile as C++17 (torch 2.11
  // does); GCC turns either into a plain register move, inside vectorised loops too.
  float two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  return p * two_k;
}

}  // namespace quiver
