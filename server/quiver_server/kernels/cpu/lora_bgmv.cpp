// LoRA delta for decode rows on CPU (BGMV semantics), one parallel region per projection.
//
// For every row t whose slot s = token_slots[t] >= 0, and every part p:
//   y[t, col_p : col_p + out_p] += scaling[s] * (lora_b_p[s] @ (lora_a_p[s] @ x[t]))
// with x [T, in], lora_a_p [S, R, in], lora_b_p [S, out_p, R], y [T, >= col_p + out_p] (rows may
// be strided). The parts are the projections fused into one Linear (q|k|v, gate|up): they share
// x, so one call reads each row of x once and opens one parallel region for all of them.
// `lora_bgmv` is the one-part form (y a column slice, col 0).
//
// lora_b_p may also be a transposed view of [S, R, out] storage, the layout CPU adapter slots
// use: the expand is then a vector sweep per rank instead of a horizontal sum per output, and
// padded ranks are skipped. The torch path needs a matmul pair per distinct adapter (dozens of
// small ops per projection with many adapters); here each row reads its adapter's A and B once
// and everything runs in one pass. Accumulation is float32; y gets one rounding.
// `kernels/lora_reference.py` defines the semantics and the tests hold this to it.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "lora_common.h"

#include <algorithm>
#include <vector>

namespace {

// h[r] = scale * (a[r] . x) for r < rank. Four rank rows per sweep of x: four independent
// accumulator chains, and each x vector is loaded once for four rows.
template <typename scalar_t>
void shrink(const scalar_t* a, const float* x, int64_t in, int64_t rank, float scale, float* h) {
  int64_t r = 0;
  for (; r + 4 <= rank; r += 4) {
    const scalar_t* a0 = a + r * in;
    const scalar_t* a1 = a0 + in;
    const scalar_t* a2 = a1 + in;
    const scalar_t* a3 = a2 + in;
    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
    for (int64_t i = 0; i < in; ++i) {
      const float xi = x[i];
      d0 += static_cast<float>(a0[i]) * xi;
      d1 += static_cast<float>(a1[i]) * xi;
      d2 += static_cast<float>(a2[i]) * xi;
      d3 += static_cast<float>(a3[i]) * xi;
    }
    h[r] = d0 * scale;
    h[r + 1] = d1 * scale;
    h[r + 2] = d2 * scale;
    h[r + 3] = d3 * scale;
  }
  for (; r < rank; ++r) {
    const scalar_t* a_row = a + r * in;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < in; ++i) dot += static_cast<float>(a_row[i]) * x[i];
    h[r] = dot * scale;
  }
}

// y[o] += sum_r h[r] * b[r][o] for rank-major b [R, out]; four ranks per sweep of the
// accumulator, which stays in L1 (out <= a few thousand floats).
template <typename scalar_t>
void expand_rank_major(const scalar_t* b, const float* h, int64_t rank, int64_t out, float* acc,
                       scalar_t* y) {
  std::fill(acc, acc + out, 0.f);
  int64_t r = 0;
  for (; r + 4 <= rank; r += 4) {
    const scalar_t* b0 = b + r * out;
    const scalar_t* b1 = b0 + out;
    const scalar_t* b2 = b1 + out;
    const scalar_t* b3 = b2 + out;
    const float h0 = h[r], h1 = h[r + 1], h2 = h[r + 2], h3 = h[r + 3];
#pragma omp simd
    for (int64_t o = 0; o < out; ++o) {
      acc[o] += h0 * static_cast<float>(b0[o]) + h1 * static_cast<float>(b1[o]) +
                h2 * static_cast<float>(b2[o]) + h3 * static_cast<float>(b3[o]);
    }
  }
  for (; r < rank; ++r) {
    const scalar_t* b_row = b + r * out;
    const float hr = h[r];
#pragma omp simd
    for (int64_t o = 0; o < out; ++o) acc[o] += hr * static_cast<float>(b_row[o]);
  }
#pragma omp simd
  for (int64_t o = 0; o < out; ++o) y[o] = static_cast<scalar_t>(static_cast<float>(y[o]) + acc[o]);
}

// y[o] += b[o][:rank] . h for out-major b [out, stride] (buffers not in the CPU slots' layout).
template <typename scalar_t>
void expand_out_major(const scalar_t* b, const float* h, int64_t rank, int64_t stride, int64_t out,
                      scalar_t* y) {
  for (int64_t o = 0; o < out; ++o) {
    const scalar_t* b_row = b + o * stride;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t r = 0; r < rank; ++r) dot += static_cast<float>(b_row[r]) * h[r];
    y[o] = static_cast<scalar_t>(static_cast<float>(y[o]) + dot);
  }
}

template <typename scalar_t>
void bgmv_parts(at::Tensor& y, const at::Tensor& x, const quiver_lora::Parts& checked, const at::Tensor& scaling,
                const at::Tensor& token_slots) {
  const int64_t rows = x.size(0), in = x.size(1);
  const int64_t y_stride = y.stride(0);
  const scalar_t* x_data = x.data_ptr<scalar_t>();
  const float* scale_data = scaling.data_ptr<float>();
  const int32_t* slots = token_slots.data_ptr<int32_t>();
  scalar_t* y_data = y.data_ptr<scalar_t>();
  const quiver_lora::PartViews<scalar_t> views(checked);
  const auto& info = views.parts;
  const int64_t max_rank = views.max_rank, max_out = views.max_out;

  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(in), h(max_rank), acc(max_out);
    for (int64_t t = begin; t < end; ++t) {
      const int32_t slot = slots[t];
      if (slot < 0) continue;
      const scalar_t* x_row = x_data + t * in;
      for (int64_t i = 0; i < in; ++i) xf[i] = static_cast<float>(x_row[i]);
      const float scale = scale_data[slot];
      for (const auto& part : info) {
        const int64_t rank = part.ranks ? part.ranks[slot] : part.rank;
        if (rank == 0) continue;  // this slot's adapter does not target the part
        scalar_t* y_row = y_data + t * y_stride + part.column;
        shrink(part.a + slot * part.rank * in, xf.data(), in, rank, scale, h.data());
        const scalar_t* b = part.b + slot * part.rank * part.out;
        if (part.rank_major) {
          // Trailing zero components (padding past the adapter's rank when no ranks are
          // given) add exact zeros; their B rows are not read.
          int64_t used = rank;
          while (used > 0 && h[used - 1] == 0.f) --used;
          expand_rank_major(b, h.data(), used, part.out, acc.data(), y_row);
        } else {
          expand_out_major(b, h.data(), rank, part.rank, part.out, y_row);
        }
      }
    }
  });
}

void lora_bgmv_parts(at::Tensor y, const at::Tensor& x, at::TensorList lora_a, at::TensorList lora_b,
                     at::TensorList slot_ranks, at::IntArrayRef columns, const at::Tensor& scaling,
                     const at::Tensor& token_slots) {
  quiver_lora::check_common(y, x, scaling);
  TORCH_CHECK(token_slots.numel() == x.size(0), "token_slots must have one entry per row of x");
  quiver_lora::check_slots(token_slots, scaling, "token_slots");
  const quiver_lora::Parts parts = quiver_lora::check_parts(y, x, lora_a, lora_b, slot_ranks, columns, scaling);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_bgmv", [&] {
    bgmv_parts<scalar_t>(y, x, parts, scaling, token_slots);
  });
}

void lora_bgmv(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
               const at::Tensor& scaling, const at::Tensor& token_slots) {
  TORCH_CHECK(lora_b.dim() != 3 || lora_b.size(1) == y.size(1),
              "shapes do not fit: y ", y.sizes(), ", x ", x.sizes(), ", A ", lora_a.sizes(), ", B ",
              lora_b.sizes());
  const int64_t column = 0;
  lora_bgmv_parts(y, x, {lora_a}, {lora_b}, {}, {column}, scaling, token_slots);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quiver_cpu, m) {
  m.def("lora_bgmv(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor scaling, "
        "Tensor token_slots) -> ()");
  m.def("lora_bgmv_parts(Tensor(a!) y, Tensor x, Tensor[] lora_a, Tensor[] lora_b, "
        "Tensor[] slot_ranks, int[] columns, Tensor scaling, Tensor token_slots) -> ()");
  m.impl("lora_bgmv", c10::DispatchKey::CPU, &lora_bgmv);
  m.impl("lora_bgmv_parts", c10::DispatchKey::CPU, &lora_bgmv_parts);
}
