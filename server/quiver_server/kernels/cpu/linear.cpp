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

#include "vec_f32.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using quiver_vec::kVecRegs;
using quiver_vec::VL;
using quiver_vec::vfloat;
using quiver_vec::vload;
using quiver_vec::vstore;
// Vectors per panel row and rows per block. AVX-512: 3 x 8 (24 accumulators of 32 zmm). AVX2:
// 2 x 6 (12 of 16 ymm), measured faster than 3 x 4 at 32-128 rows, and its panel row is one
// 64-byte line.
constexpr int NV = kVecRegs >= 32 ? 3 : 2;
constexpr int MR = kVecRegs >= 32 ? 8 : 6;
constexpr int64_t PANEL = NV * VL;
static_assert(MR * NV + NV + 1 <= kVecRegs, "the micro-kernel's block (and its operands) must fit the register file");
// Rows per work item of a prefill-sized product: x's chunk stays in L2 while the panels stream.
constexpr int64_t ROW_CHUNK = 128;

// The next panel's cache lines, spread over the current panel's k iterations (`step` per k).
struct Prefetcher {
  const char* next = nullptr;
  int64_t lines = 0, issued = 0, per_step = 1;

  void reset(const char* next_panel, int64_t panel_lines, int64_t steps) {
    next = next_panel;
    lines = next_panel ? panel_lines : 0;
    issued = 0;
    per_step = steps > 0 ? std::max<int64_t>(1, (lines + steps - 1) / steps) : 1;
  }

  inline void step() {
    for (int64_t q = 0; q < per_step && issued < lines; ++q, ++issued) {
      __builtin_prefetch(next + issued * 64, 0, 2);
    }
  }
};

// y[0 : ROWS, :cols] = x[0 : ROWS] @ panel (+ bias); x rows k_len apart, y rows y_stride apart.
template <int ROWS>
void micro(const float* x, int64_t k_len, const float* panel, const float* bias, float* y, int64_t y_stride,
           int64_t cols, Prefetcher& prefetch) {
  vfloat acc[ROWS][NV];
  for (int i = 0; i < ROWS; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vfloat{};
  for (int64_t k = 0; k < k_len; ++k) {
    const float* w = panel + k * PANEL;
    vfloat wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = vload(w + v * VL);
    prefetch.step();
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i) {
      const float xi = x[i * k_len + k];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] += xi * wv[v];
    }
  }
  for (int i = 0; i < ROWS; ++i) {
    if (bias)
      for (int v = 0; v < NV; ++v) acc[i][v] += vload(bias + v * VL);
    float* yi = y + i * y_stride;
    if (cols == PANEL) {
      for (int v = 0; v < NV; ++v) vstore(yi + v * VL, acc[i][v]);
    } else {
      float tmp[PANEL];
      for (int v = 0; v < NV; ++v) vstore(tmp + v * VL, acc[i][v]);
      std::memcpy(yi, tmp, cols * sizeof(float));
    }
  }
}

// Rows [m_begin, m_end) of one panel, in blocks of MR, then 4 (when MR is larger), 2 and 1 rows.
void panel_rows(const float* x, int64_t k_len, const float* panel, const float* bias, float* y, int64_t y_stride,
                int64_t cols, int64_t m_begin, int64_t m_end, Prefetcher& prefetch) {
  int64_t m = m_begin;
  for (; m + MR <= m_end; m += MR) micro<MR>(x + m * k_len, k_len, panel, bias, y + m * y_stride, y_stride, cols, prefetch);
  if (MR > 4 && m + 4 <= m_end) {
    micro<4>(x + m * k_len, k_len, panel, bias, y + m * y_stride, y_stride, cols, prefetch);
    m += 4;
  }
  if (m + 2 <= m_end) {
    micro<2>(x + m * k_len, k_len, panel, bias, y + m * y_stride, y_stride, cols, prefetch);
    m += 2;
  }
  if (m < m_end) micro<1>(x + m * k_len, k_len, panel, bias, y + m * y_stride, y_stride, cols, prefetch);
}

// How many micro-kernel calls panel_rows makes for `rows` rows.
int64_t row_blocks(int64_t rows) {
  const int64_t rest = rows % MR;
  return rows / MR + (MR > 4 && rest >= 4) + (rest % 4 >= 2) + (rest % 2);
}

// Work items are (row chunk, panel) pairs, chunk-major, split into one contiguous range per
// thread; a decode-sized product is one chunk, so the threads split the panels.
void run(const float* x, int64_t m, int64_t k_len, const float* packed, int64_t n, const float* bias_padded,
         float* y) {
  const int64_t panels = (n + PANEL - 1) / PANEL;
  const int64_t chunk = m <= 2 * ROW_CHUNK ? m : ROW_CHUNK;
  const int64_t chunks = (m + chunk - 1) / chunk;
  const int64_t panel_lines = k_len * PANEL * static_cast<int64_t>(sizeof(float)) / 64;
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    Prefetcher prefetch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item / panels, p = item % panels;
      const int64_t m_begin = c * chunk, m_end = std::min(m, m_begin + chunk);
      const float* panel = packed + p * k_len * PANEL;
      const bool next = item + 1 < end && p + 1 < panels;  // this thread's next item, same rows
      prefetch.reset(next ? reinterpret_cast<const char*>(panel + k_len * PANEL) : nullptr, panel_lines,
                     row_blocks(m_end - m_begin) * k_len);
      panel_rows(x, k_len, panel, bias_padded ? bias_padded + p * PANEL : nullptr, y + p * PANEL, n,
                 std::min<int64_t>(PANEL, n - p * PANEL), m_begin, m_end, prefetch);
    }
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
