// Float32 linear layers on CPU: y = x W^T (+ bias) on a weight packed once into column panels.
//
// Packed layout: W [N, K] becomes [P, K, PANEL] (P = ceil(N / PANEL)): panel p holds columns
// p * PANEL ... as K rows of PANEL contiguous floats, zero past N. The micro-kernel keeps an
// MR-row x PANEL-column block of y in MR * NV vector registers; per k it loads NV panel vectors
// and broadcasts MR values of x, so from L2 it runs at the FMA units' rate. The block is sized to
// the register file (vec_width.h): AVX-512 8 rows x 3 zmm (24 accumulators + 3 + 1 of 32), AVX2
// 6 rows x 2 ymm (12 + 2 + 1 of 16; the AVX-512 block would spill there).
//
// Why not oneDNN's packed sgemm, which the shard used before: in a decode step the weights come
// from DRAM (the benchmark model's 168 MB of projections and LM head are more than this VM's
// share of L3), and a product of a few dozen rows waited on them: oneDNN's ran at ~7 GB/s of the
// ~20 the two cores can stream. Here, while a panel computes, its thread prefetches the next
// panel, so loads and arithmetic overlap: a 32-row step's projections take 30% less time, its
// LM head 40% less. Prefill-sized products (x's rows in chunks that stay in L2) run at oneDNN's
// speed. `F.linear` is the reference the tests hold this to.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "f32_panels.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using quiver_panels::NV;
using quiver_panels::PANEL;
using quiver_panels::Prefetcher;
using quiver_panels::vfloat;
using quiver_panels::VL;
// Rows per block. AVX-512: 8 x 3 vectors (24 accumulators of 32 zmm). AVX2: 6 x 2 (12 of 16 ymm).
constexpr int MR = quiver_panels::kVecRegs >= 32 ? 8 : 6;
static_assert(MR * NV + NV + 1 <= quiver_panels::kVecRegs,
              "the micro-kernel's block (and its operands) must fit the register file");

// y[0 : ROWS, :cols] = x[0 : ROWS] @ panel (+ bias); x rows k_len apart, y rows y_stride apart.
template <int ROWS>
void micro(const float* x, int64_t k_len, const float* panel, const float* bias, float* y,
                             int64_t y_stride, int64_t cols, Prefetcher& prefetch) {
  vfloat acc[ROWS][NV];
  for (int i = 0; i < ROWS; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vfloat{};
  for (int64_t k = 0; k < k_len; ++k) {
    const float* w = panel + k * PANEL;
    vfloat wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = quiver_panels::vload(w + v * VL);
    prefetch.step();
    quiver_panels::fma_rows<ROWS>(acc, x, k_len, k, wv);
  }
  quiver_panels::store_rows<ROWS>(acc, bias, y, y_stride, cols);
}

void run(const float* x, int64_t m, int64_t k_len, const float* packed, int64_t n, const float* bias_padded,
         float* y) {
  const int64_t panels = (n + PANEL - 1) / PANEL;
  const int64_t panel_lines = k_len * PANEL * static_cast<int64_t>(sizeof(float)) / 64;
  quiver_panels::for_panel_items(m, panels, [&](int64_t p, int64_t m_begin, int64_t m_end, bool next,
                                                Prefetcher& prefetch) {
    const float* panel = packed + p * k_len * PANEL;
    const float* bias = bias_padded ? bias_padded + p * PANEL : nullptr;
    const int64_t cols = std::min<int64_t>(PANEL, n - p * PANEL);
    prefetch.reset(next ? reinterpret_cast<const char*>(panel + k_len * PANEL) : nullptr, panel_lines,
                   quiver_panels::row_blocks<MR>(m_end - m_begin) * k_len);
    quiver_panels::for_row_blocks<MR>(m_begin, m_end, [&](auto rows, int64_t r) {
      micro<decltype(rows)::value>(x + r * k_len, k_len, panel, bias, y + p * PANEL + r * n, n, cols, prefetch);
    });
  });
}

void check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear_packed runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "linear_packed is float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, in]");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == PANEL &&
                  packed.size(1) == x.size(1) && n > 0 && (n + PANEL - 1) / PANEL == packed.size(0),
              "packed weight ", packed.sizes(), " does not fit x ", x.sizes(), " and ", n, " outputs");
}

// Bias padded to whole panels (the micro-kernel adds full vectors).
std::vector<float> padded_bias(const c10::optional<at::Tensor>& bias, int64_t n, int64_t panels) {
  std::vector<float> out;
  if (!bias.has_value()) return out;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->numel() == n && bias->is_contiguous(),
              "bias must be a contiguous float32 [", n, "]");
  out.assign(panels * PANEL, 0.f);
  std::memcpy(out.data(), bias->data_ptr<float>(), n * sizeof(float));
  return out;
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "pack_linear_weight takes a float32 CPU [out, in] weight");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k_len = w.size(1), panels = (n + PANEL - 1) / PANEL;
  at::Tensor packed = at::zeros({panels, k_len, PANEL}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min<int64_t>(PANEL, n - p * PANEL);
      for (int64_t j = 0; j < cols; ++j) {
        const float* row = src + (p * PANEL + j) * k_len;
        for (int64_t k = 0; k < k_len; ++k) dst[(p * k_len + k) * PANEL + j] = row[k];
      }
    }
  });
  return packed;
}

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
  check_packed(x, packed, n);
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const std::vector<float> b = padded_bias(bias, n, packed.size(0));
  run(x.data_ptr<float>(), m, x.size(1), packed.data_ptr<float>(), n, b.empty() ? nullptr : b.data(),
      y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quiver_cpu, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("linear_packed(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.impl("pack_linear_weight", c10::DispatchKey::CPU, &pack_linear_weight);
  m.impl("linear_packed", c10::DispatchKey::CPU, &linear_packed);
}
