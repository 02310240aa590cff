// The vector width the kernels are built for, from the compiler's target flags (cpu_ops builds
// one library per ISA: QUIVER_CPU_ISA). Register blocking is derived from these two numbers, so
// the AVX2 build keeps its accumulators in 16 ymm registers and the AVX-512 build uses its 32 zmm
// ones instead of spilling or leaving half of them idle.
#pragma once

namespace quiver_vec {

#if defined(__AVX512F__)
constexpr int VL = 16;        // floats per vector: zmm
constexpr int kVecRegs = 32;  // zmm0-31
#else
constexpr int VL = 8;         // ymm (also what the loops fall back to on narrower targets)
constexpr int kVecRegs = 16;  // ymm0-15
#endif

}  // namespace quiver_vec
