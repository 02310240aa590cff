// Loads of one vector of float32 from float32, bfloat16 or float16 storage, and its horizontal
// sum, for kernels that read 16-bit caches or weights into float32 arithmetic (vec_f32.h).
// Intrinsics rather than GCC's vector conversions, which it scalarised.
#pragma once

#include <immintrin.h>

#include <c10/util/BFloat16.h>
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

}  // namespace quiver_vec
