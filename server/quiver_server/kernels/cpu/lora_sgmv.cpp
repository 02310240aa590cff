// LoRA delta for prefill segments on CPU (SGMV semantics), one parallel region per projection.
//
// Segment g covers rows seg_indptr[g] .. seg_indptr[g + 1] - 1, all on slot s = seg_slots[g]
// (-1: the base model, no delta). For each of its rows t and every part p:
//   y[t, col_p : col_p + out_p] += scaling[s] * (lora_b_p[s] @ (lora_a_p[s] @ x[t]))
// lora_b_p is a transposed view of [S, R, out_p] storage (the CPU slots' layout). Rows past a
// slot's rank (slot_ranks) are zero and not read.
//
// The torch path runs two small GEMMs per segment and part from Python (~3,300 ops for a prefill
// of 32 prompts on 32 adapters of the benchmark model, each a dispatch and an OpenMP region).
// Here the work is cut into tiles of up to TILE_ROWS rows of one segment, spread over the threads
// in one region; a tile computes every part, so its slot's A and B come from cache for all its
// rows. Register-blocked micro-kernels sized to the register file (vec_width.h): the shrink takes
// 4 rows x SHRINK_RANKS ranks per sweep of x (AVX-512: 4 ranks, 16 accumulators and 8 loads of
// 32 zmm; AVX2: 2 ranks, 8 + 6 of 16 ymm), the expand 4 rows x OUT_BLOCK outputs per rank
// (AVX-512: 4 zmm per row, 64 outputs; AVX2: 2 ymm per row, 16 outputs); float32 has
// vector-type versions of both, 16-bit dtypes `omp simd` loops. Accumulation is float32; y gets
// one rounding.
// `kernels/lora_reference.py` defines the semantics and the tests hold this to it.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "lora_common.h"
#include "vec_f32.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using quiver_vec::kVecRegs;
using quiver_vec::VL;
using quiver_vec::vfloat;
using quiver_vec::vload;
using quiver_vec::vstore;

constexpr int64_t TILE_ROWS = 32;
// Ranks per float32 shrink block: 4 rows x SHRINK_RANKS accumulators plus the 4 x and
// SHRINK_RANKS A vectors of a sweep step must fit the register file.
constexpr int SHRINK_RANKS = kVecRegs >= 32 ? 4 : 2;
static_assert(4 * SHRINK_RANKS + 4 + SHRINK_RANKS <= kVecRegs, "shrink block spills");
// Vectors per row of a float32 expand block: 4 rows of them, their B vectors and a broadcast.
constexpr int EXPAND_VECTORS = kVecRegs >= 32 ? 4 : 2;
static_assert(4 * EXPAND_VECTORS + EXPAND_VECTORS + 1 <= kVecRegs, "expand block spills");
constexpr int64_t OUT_BLOCK = EXPAND_VECTORS * VL;

inline float vsum(vfloat v) {
  float s = 0.f;
  for (int k = 0; k < VL; ++k) s += v[k];
  return s;
}

// h[t * h_stride + k] = scale * (x[t] . a[k]) for 4 rows t of x and SHRINK_RANKS rows k of a.
void shrink_block_f32(const float* x, int64_t in, const float* a, float scale, float* h, int64_t h_stride) {
  constexpr int K = SHRINK_RANKS;
  vfloat acc[4][K] = {};
  int64_t i = 0;
  for (; i + VL <= in; i += VL) {
    vfloat xv[4], av[K];
    for (int t = 0; t < 4; ++t) xv[t] = vload(x + t * in + i);
    for (int k = 0; k < K; ++k) av[k] = vload(a + k * in + i);
    for (int t = 0; t < 4; ++t)
      for (int k = 0; k < K; ++k) acc[t][k] += xv[t] * av[k];
  }
  for (int t = 0; t < 4; ++t) {
    for (int k = 0; k < K; ++k) {
      float dot = vsum(acc[t][k]);
      for (int64_t r = i; r < in; ++r) dot += x[t * in + r] * a[k * in + r];
      h[t * h_stride + k] = dot * scale;
    }
  }
}

// y[t, :OUT_BLOCK] += sum_j h[t, j] * b[j, :OUT_BLOCK] for 4 rows t (b rank-major, row stride out).
void expand_4rows_f32(const float* h, int64_t h_stride, const float* b, int64_t out, int64_t rank, float* y,
                      int64_t y_stride) {
  constexpr int V = EXPAND_VECTORS;
  vfloat acc[4][V] = {};
  for (int64_t j = 0; j < rank; ++j) {
    vfloat bv[V];
    for (int k = 0; k < V; ++k) bv[k] = vload(b + j * out + k * VL);
    for (int t = 0; t < 4; ++t) {
      const float ht = h[t * h_stride + j];
      for (int k = 0; k < V; ++k) acc[t][k] += ht * bv[k];
    }
  }
  for (int t = 0; t < 4; ++t)
    for (int k = 0; k < V; ++k) vstore(y + t * y_stride + k * VL, vload(y + t * y_stride + k * VL) + acc[t][k]);
}

// h[t * h_stride + j0 + k] = scale * (x[t] . a[j0 + k]) for 4 rows t and 4 ranks k: one sweep
// of x and A with 16 accumulators.
template <typename scalar_t>
void shrink_4x4(const float* x, int64_t in, const scalar_t* a, int64_t j0, float scale, float* h,
                int64_t h_stride) {
  const float *x0 = x, *x1 = x + in, *x2 = x + 2 * in, *x3 = x + 3 * in;
  const scalar_t* a0 = a + j0 * in;
  const scalar_t *a1 = a0 + in, *a2 = a1 + in, *a3 = a2 + in;
  float d00 = 0.f, d01 = 0.f, d02 = 0.f, d03 = 0.f, d10 = 0.f, d11 = 0.f, d12 = 0.f, d13 = 0.f;
  float d20 = 0.f, d21 = 0.f, d22 = 0.f, d23 = 0.f, d30 = 0.f, d31 = 0.f, d32 = 0.f, d33 = 0.f;
#pragma omp simd reduction(+ : d00, d01, d02, d03, d10, d11, d12, d13, d20, d21, d22, d23, d30, d31, d32, d33)
  for (int64_t i = 0; i < in; ++i) {
    const float b0 = static_cast<float>(a0[i]), b1 = static_cast<float>(a1[i]);
    const float b2 = static_cast<float>(a2[i]), b3 = static_cast<float>(a3[i]);
    const float v0 = x0[i], v1 = x1[i], v2 = x2[i], v3 = x3[i];
    d00 = std::fma(v0, b0, d00), d01 = std::fma(v0, b1, d01), d02 = std::fma(v0, b2, d02), d03 = std::fma(v0, b3, d03);
    d10 = std::fma(v1, b0, d10), d11 = std::fma(v1, b1, d11), d12 = std::fma(v1, b2, d12), d13 = std::fma(v1, b3, d13);
    d20 = std::fma(v2, b0, d20), d21 = std::fma(v2, b1, d21), d22 = std::fma(v2, b2, d22), d23 = std::fma(v2, b3, d23);
    d30 = std::fma(v3, b0, d30), d31 = std::fma(v3, b1, d31), d32 = std::fma(v3, b2, d32), d33 = std::fma(v3, b3, d33);
  }
  const float d[4][4] = {{d00, d01, d02, d03}, {d10, d11, d12, d13}, {d20, d21, d22, d23}, {d30, d31, d32, d33}};
  for (int t = 0; t < 4; ++t)
    for (int k = 0; k < 4; ++k) h[t * h_stride + j0 + k] = d[t][k] * scale;
}

// The rows and ranks left over from the 4 x 4 blocks, one dot product at a time.
template <typename scalar_t>
void shrink_1x1(const float* x, int64_t rows, int64_t in, const scalar_t* a, int64_t j, float scale,
                float* h, int64_t h_stride) {
  const scalar_t* aj = a + j * in;
  for (int64_t t = 0; t < rows; ++t) {
    const float* xt = x + t * in;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < in; ++i) dot = std::fma(xt[i], static_cast<float>(aj[i]), dot);
    h[t * h_stride + j] = dot * scale;
  }
}

// h [rows, rank] = scale * x [rows, in] @ a[:rank]^T.
template <typename scalar_t>
void shrink(const float* x, int64_t rows, int64_t in, const scalar_t* a, int64_t rank, float scale,
            float* h, int64_t h_stride) {
  // float32 blocks are 4 x SHRINK_RANKS, 16-bit ones 4 x 4.
  constexpr int64_t K = std::is_same_v<scalar_t, float> ? SHRINK_RANKS : 4;
  const int64_t rows4 = rows / 4 * 4, rank4 = rank / K * K;
  for (int64_t t = 0; t < rows4; t += 4) {
    for (int64_t j = 0; j < rank4; j += K) {
      if constexpr (std::is_same_v<scalar_t, float>) {
        shrink_block_f32(x + t * in, in, a + j * in, scale, h + t * h_stride + j, h_stride);
      } else {
        shrink_4x4(x + t * in, in, a, j, scale, h + t * h_stride, h_stride);
      }
    }
  }
  for (int64_t j = 0; j < rank4; ++j)  // rows past the last block of 4
    shrink_1x1(x + rows4 * in, rows - rows4, in, a, j, scale, h + rows4 * h_stride, h_stride);
  for (int64_t j = rank4; j < rank; ++j) shrink_1x1(x, rows, in, a, j, scale, h, h_stride);
}

// y[t, o0 : o0 + width] += sum_j h[t, j] * b[j, o0 : o0 + width] for NT rows; width <= OUT_BLOCK.
template <typename scalar_t, int NT, bool FULL>
void expand_block(const float* h, int64_t h_stride, const scalar_t* b, int64_t out, int64_t rank,
                  int64_t o0, int64_t width, scalar_t* y, int64_t y_stride) {
  float acc[NT][OUT_BLOCK] = {};
  for (int64_t j = 0; j < rank; ++j) {
    const scalar_t* bj = b + j * out + o0;
    float bv[OUT_BLOCK];
    if (FULL) {
#pragma omp simd
      for (int64_t o = 0; o < OUT_BLOCK; ++o) bv[o] = static_cast<float>(bj[o]);
    } else {
      for (int64_t o = 0; o < OUT_BLOCK; ++o) bv[o] = o < width ? static_cast<float>(bj[o]) : 0.f;
    }
    for (int t = 0; t < NT; ++t) {
      const float ht = h[t * h_stride + j];
#pragma omp simd
      for (int64_t o = 0; o < OUT_BLOCK; ++o) acc[t][o] = std::fma(ht, bv[o], acc[t][o]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    scalar_t* yt = y + t * y_stride + o0;
    for (int64_t o = 0; o < width; ++o) yt[o] = static_cast<scalar_t>(static_cast<float>(yt[o]) + acc[t][o]);
  }
}

// y [rows, out] += h [rows, rank] @ b [rank, out] (b rank-major).
template <typename scalar_t>
void expand(const float* h, int64_t rows, int64_t h_stride, const scalar_t* b, int64_t rank, int64_t out,
            scalar_t* y, int64_t y_stride) {
  for (int64_t o0 = 0; o0 < out; o0 += OUT_BLOCK) {
    const int64_t width = std::min(OUT_BLOCK, out - o0);
    int64_t t = 0;
    if (width == OUT_BLOCK) {
      for (; t + 4 <= rows; t += 4) {
        if constexpr (std::is_same_v<scalar_t, float>) {
          expand_4rows_f32(h + t * h_stride, h_stride, b + o0, out, rank, y + t * y_stride + o0, y_stride);
          continue;
        }
        expand_block<scalar_t, 4, true>(h + t * h_stride, h_stride, b, out, rank, o0, width, y + t * y_stride, y_stride);
      }
      for (; t < rows; ++t)
        expand_block<scalar_t, 1, true>(h + t * h_stride, h_stride, b, out, rank, o0, width, y + t * y_stride, y_stride);
    } else {
      for (; t < rows; ++t)
        expand_block<scalar_t, 1, false>(h + t * h_stride, h_stride, b, out, rank, o0, width, y + t * y_stride, y_stride);
    }
  }
}

struct Tile {
  int64_t begin, end;
  int32_t slot;
};

template <typename scalar_t>
void sgmv_parts(at::Tensor& y, const at::Tensor& x, const quiver_lora::Parts& checked, const at::Tensor& scaling,
                const std::vector<Tile>& tiles) {
  const int64_t in = x.size(1), y_stride = y.stride(0);
  const scalar_t* x_data = x.data_ptr<scalar_t>();
  const float* scale_data = scaling.data_ptr<float>();
  scalar_t* y_data = y.data_ptr<scalar_t>();
  const quiver_lora::PartViews<scalar_t> views(checked);
  const auto& parts = views.parts;
  const int64_t max_rank = views.max_rank;

  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t first, int64_t last) {
    std::vector<float> xf(TILE_ROWS * in), h(TILE_ROWS * std::max<int64_t>(max_rank, 1));
    for (int64_t i = first; i < last; ++i) {
      const Tile& tile = tiles[i];
      const int64_t rows = tile.end - tile.begin;
      for (int64_t k = 0; k < rows * in; ++k) xf[k] = static_cast<float>(x_data[tile.begin * in + k]);
      const float scale = scale_data[tile.slot];
      for (const auto& part : parts) {
        const int64_t rank = part.ranks ? part.ranks[tile.slot] : part.rank;
        if (rank == 0) continue;  // this slot's adapter does not target the part
        const scalar_t* a = part.a + tile.slot * part.rank * in;
        const scalar_t* b = part.b + tile.slot * part.rank * part.out;
        shrink(xf.data(), rows, in, a, rank, scale, h.data(), max_rank);
        expand(h.data(), rows, max_rank, b, rank, part.out, y_data + tile.begin * y_stride + part.column, y_stride);
      }
    }
  });
}

void lora_sgmv_parts(at::Tensor y, const at::Tensor& x, at::TensorList lora_a, at::TensorList lora_b,
                     at::TensorList slot_ranks, at::IntArrayRef columns, const at::Tensor& scaling,
                     const at::Tensor& seg_indptr, const at::Tensor& seg_slots) {
  quiver_lora::check_common(y, x, scaling);
  const quiver_lora::Parts parts =
      quiver_lora::check_parts(y, x, lora_a, lora_b, slot_ranks, columns, scaling, "lora_sgmv");
  quiver_lora::check_slots(seg_slots, scaling, "seg_slots");
  TORCH_CHECK(seg_indptr.scalar_type() == at::kInt && seg_indptr.is_contiguous() &&
                  seg_indptr.numel() == seg_slots.numel() + 1,
              "seg_indptr must be a contiguous int32 [segments + 1]");
  const int32_t* indptr = seg_indptr.data_ptr<int32_t>();
  const int32_t* slots = seg_slots.data_ptr<int32_t>();
  TORCH_CHECK(indptr[0] == 0 && indptr[seg_slots.numel()] == x.size(0),
              "seg_indptr must run from 0 to the row count of x");
  std::vector<Tile> tiles;
  for (int64_t g = 0; g < seg_slots.numel(); ++g) {
    TORCH_CHECK(indptr[g] <= indptr[g + 1], "seg_indptr must not decrease");
    if (slots[g] < 0) continue;
    for (int64_t begin = indptr[g]; begin < indptr[g + 1]; begin += TILE_ROWS)
      tiles.push_back({begin, std::min<int64_t>(begin + TILE_ROWS, indptr[g + 1]), slots[g]});
  }
  if (tiles.empty()) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_sgmv", [&] {
    sgmv_parts<scalar_t>(y, x, parts, scaling, tiles);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quiver_cpu, m) {
  m.def("lora_sgmv_parts(Tensor(a!) y, Tensor x, Tensor[] lora_a, Tensor[] lora_b, Tensor[] slot_ranks, "
        "int[] columns, Tensor scaling, Tensor seg_indptr, Tensor seg_slots) -> ()");
  m.impl("lora_sgmv_parts", c10::DispatchKey::CPU, &lora_sgmv_parts);
}
