// Loads of one vector of float32 from float32, bfloat16, float16 or float8 (e4m3fn, e5m2)
// storage, and its horizontal sum, for kernels that read 16- or 8-bit caches or weights into
// float32 arithmetic (vec_f32.h).
// Intrinsics rather than GCC's vector conversions, which it scalarised.
#pragma once

#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include "vec_f32.h"

namespace quiver_vec {

inline vfloat load_float(const float* p) { return vload(p); }

inline vfloat load_float(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (vfloat)_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#else
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (vfloat)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#endif
}

inline vfloat load_float(const c10::Half* p) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  return (vfloat)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float lanes[VL];
  for (int i = 0; i < VL; ++i) lanes[i] = static_cast<float>(p[i]);
  return vload(lanes);
#endif
}

// float8 goes through float16, whose conversion to float32 is one instruction (F16C). e5m2 is
// float16's upper byte. e4m3fn's byte, sign-extended to 16 bits and shifted left by 7, has its
// sign, exponent and mantissa in float16's fields but for a copy of the sign in the exponent's top
// bit, which one AND clears: a float16 of the same bits under a bias 8 larger, normal and
// subnormal values alike, i.e. the value times 2^-8. `load_scaled` returns that; `load_float`
// multiplies by kLoadScale = 2^8, and kernels that can fold the factor into a scale they apply
// anyway skip the product. (The NaN pattern 0x7F reads as 480; the writers never store NaN:
// `kv_cache_dtype.to_cache` clamps.)
#if defined(__AVX512F__)
inline __m256i e4m3_to_half(const void* p) {  // VL bytes -> VL float16 lanes, times 2^-8
  const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
}
inline __m256i e5m2_to_half(const void* p) {
  return _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
}
inline vfloat half_lanes_to_float(__m256i h) { return (vfloat)_mm512_cvtph_ps(h); }
#elif defined(__F16C__)
inline __m128i e4m3_to_half(const void* p) {
  const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
}
inline __m128i e5m2_to_half(const void* p) {
  return _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8);
}
inline vfloat half_lanes_to_float(__m128i h) { return (vfloat)_mm256_cvtph_ps(h); }
#endif

// The factor between a stored element and what `load_scaled` returns of it.
template <typename T>
inline constexpr float kLoadScale = 1.f;
template <>
inline constexpr float kLoadScale<c10::Float8_e4m3fn> = 256.f;

inline vfloat load_scaled(const c10::Float8_e4m3fn* p) {
#if defined(__AVX512F__) || defined(__F16C__)
  return half_lanes_to_float(e4m3_to_half(p));
#else
  float lanes[VL];
  for (int i = 0; i < VL; ++i) lanes[i] = static_cast<float>(p[i]) * (1.f / 256.f);
  return vload(lanes);
#endif
}

inline vfloat load_float(const c10::Float8_e4m3fn* p) { return load_scaled(p) * kLoadScale<c10::Float8_e4m3fn>; }

inline vfloat load_float(const c10::Float8_e5m2* p) {
#if defined(__AVX512F__) || defined(__F16C__)
  return half_lanes_to_float(e5m2_to_half(p));
#else
  float lanes[VL];
  for (int i = 0; i < VL; ++i) lanes[i] = static_cast<float>(p[i]);
  return vload(lanes);
#endif
}

// Every other storage type: load_float itself (kLoadScale 1).
template <typename T>
inline vfloat load_scaled(const T* p) {
  return load_float(p);
}

// The sum of the lanes, halving the vector each step (a tree: a dependent chain of log2(VL)
// adds, where a lane-by-lane sum is a chain of VL).
inline float hsum(vfloat v) {
#if defined(__AVX512F__)
  const __m512 x = (__m512)v;
  __m256 half = _mm256_add_ps(_mm512_castps512_ps256(x),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
#else
  __m256 half = (__m256)v;
#endif
  __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  quarter = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
  quarter = _mm_add_ss(quarter, _mm_movehdup_ps(quarter));
  return _mm_cvtss_f32(quarter);
}

#if defined(__AVX512F__)
// out[i] = the sum of the lanes of v[i], for 16 vectors at once: a tree of shuffles and adds
// that halves the vectors at each level (46 instructions, where 16 hsum calls take ~110). Level
// by level, each vector holds the partial sums of 2, 4, 8 and 16 of the inputs; the last level
// leaves input q + 4r in lane 4q + r, which one permutation puts in order.
inline vfloat lane_sums(const vfloat (&v)[16]) {
  __m512 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: v[2i]'s 8 partial sums, 8-15: v[2i + 1]'s
    const __m512 a = (__m512)v[2 * i], b = (__m512)v[2 * i + 1];
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit quarter j: v[4i + j]'s 4 partial sums
    const __m512 a = halves[2 * i], b = halves[2 * i + 1];
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // quarter q: 2 partial sums of v[8i + q], then of v[8i + 4 + q]
    const __m512 a = quarters[2 * i], b = quarters[2 * i + 1];
    eighths[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  // Quarter q: the sums of v[q], v[4 + q], v[8 + q], v[12 + q].
  const __m512 mixed = _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], 0x88),
                                     _mm512_shuffle_ps(eighths[0], eighths[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return (vfloat)_mm512_permutexvar_ps(order, mixed);
}
#endif

}  // namespace quiver_vec
