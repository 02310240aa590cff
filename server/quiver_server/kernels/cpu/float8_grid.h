// Rounding to a float8 format's grid in float32 arithmetic that vectorises, and encoding a value
// on the grid as its byte: what torch's saturating float8 cast computes (kv_cache_dtype.to_cache),
// for the CPU kernels that store or round K/V for a float8 cache (kv_float8.cpp, kv_write.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace quiver_float8 {

// A float8 format's grid: `mantissa` bits for normal values, steps of `quantum` below
// `min_normal` (its subnormals), saturating at `limit`.
struct Grid {
  int mantissa;
  float min_normal, quantum, limit;
};

constexpr Grid kE4m3{3, 0x1p-6f, 0x1p-9f, 448.f};
constexpr Grid kE5m2{2, 0x1p-14f, 0x1p-16f, 57344.f};

// f on the grid, to nearest with ties to even, in float32 (exact in any of the three dtypes).
inline float on_grid(float f, const Grid& grid) {
  f = std::min(std::max(f, -grid.limit), grid.limit);
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const int drop = 23 - grid.mantissa;
  bits = ((bits + ((1u << (drop - 1)) - 1) + ((bits >> drop) & 1u)) >> drop) << drop;
  float normal;
  std::memcpy(&normal, &bits, sizeof normal);
  // 1.5 * 2^23 added and taken away rounds a float below 2^22 to an integer, ties to even (no
  // reassociation: the build has no -ffast-math); on the magnitude, the sign put back after, so
  // that what rounds to zero keeps its sign (-0 is a byte of its own).
  const float magnitude = std::fabs(f);
  const float subnormal = std::copysign(((magnitude / grid.quantum + 12582912.f) - 12582912.f) * grid.quantum, f);
  return magnitude < grid.min_normal ? subnormal : normal;
}

// The byte of g, a value on the grid (on_grid's result): sign, biased exponent and mantissa
// bits, or for |g| below the smallest normal value the subnormal's multiple of the quantum.
inline std::uint8_t encode(float g, const Grid& grid) {
  std::uint32_t bits;
  std::memcpy(&bits, &g, sizeof bits);
  const std::uint32_t sign = (bits >> 24) & 0x80u;
  const float magnitude = std::fabs(g);
  const int exponent_bits = 7 - grid.mantissa;  // e4m3: 4, e5m2: 5
  const int bias = (1 << (exponent_bits - 1)) - 1;  // 7, 15
  const std::uint32_t normal = ((((bits >> 23) & 0xFFu) - 127u + bias) << grid.mantissa) |
                               ((bits >> (23 - grid.mantissa)) & ((1u << grid.mantissa) - 1u));
  const std::uint32_t subnormal = static_cast<std::uint32_t>(magnitude / grid.quantum);
  return static_cast<std::uint8_t>(sign | (magnitude < grid.min_normal ? subnormal : normal));
}

}  // namespace quiver_float8
