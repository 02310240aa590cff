// float32 vectors on the compiler's vector type for the register-blocked micro-kernels
// (lora_sgmv.cpp, linear.cpp): their accumulators stay in registers, where arrays of floats in
// `omp simd` loops went to the stack. One vector is a zmm register with AVX-512, a ymm one
// otherwise (vec_width.h). Including this also turns FMA contraction back on for the including
// file: the build turns it off for the row ops' sake (cpu_ops.CFLAGS), and these sums have no
// bit-exact counterpart to match.
#pragma once

#include <cstring>

#include "vec_width.h"

#if defined(__clang__)
#pragma clang fp contract(fast)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=fast")
#endif

namespace quiver_vec {

typedef float vfloat __attribute__((vector_size(VL * sizeof(float))));

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

}  // namespace quiver_vec
