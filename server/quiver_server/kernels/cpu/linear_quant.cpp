// Weight-only quantized linear layers on CPU: y = x dequant(W)^T (+ bias), x and y float32.
//
// The weight is packed once at load (kernels/quant_gemm.py) into column panels like linear.cpp's
// float32 ones, so a block of y stays in registers while the panel streams past:
//   8-bit: q [P, K, PANEL] int8, one value per column per k;
//   4-bit: q [P, K / 2, PANEL] uint8, byte (k2, j) = value(2 k2, j) | value(2 k2 + 1, j) << 4;
//   scales, offsets [P, G, PANEL] float32 (G = K / group_size): w = q * scale + offset.
// Per k the micro-kernel widens NV vectors of values to float32, scales them (and adds the
// offset) into the weight itself, then does the same MR x NV multiply-adds as the float32
// kernel. Dequantizing in registers costs ~4 instructions per weight vector against MR
// multiply-adds that use it, and a decode step, which reads every weight from DRAM once, moves a
// quarter (8-bit) or an eighth (4-bit) of the float32 bytes: that is the point of the format.
// Products are rounded as w = fma(q, scale, offset) in float32, exactly the dequantized weight
// the Python reference computes, so the only difference from x @ dequant(W)^T in float32 is the
// order of the sums.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "f32_panels.h"
#include "quant_packed.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using quiver_panels::fma_rows;
using quiver_panels::NV;
using quiver_panels::PANEL;
using quiver_panels::Prefetcher;
using quiver_panels::vfloat;
using quiver_panels::vload;
using quiver_panels::VL;

// Same panels as linear.cpp. Rows per block: the float32 kernel's 8 (AVX-512) / 6 (AVX2) plus
// the NV scale and NV offset vectors would spill, so one row fewer on AVX-512 keeps the block,
// the dequantized panel row and its scales in the 32 zmm registers, and AVX2 takes 4 rows.
constexpr int MR = quiver_panels::kVecRegs >= 32 ? 6 : 4;

// Widening bytes to float32 lanes with the ISA's own instructions (vpmovsxbd/vpmovzxbd, then
// vcvtdq2ps): GCC's __builtin_convertvector on byte vectors extracts them lane by lane.
#if defined(__AVX512F__)
typedef __m512i vint;
inline vfloat load_bytes(const int8_t* p) {
  return (vfloat)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vint load_ubytes(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vfloat low_nibbles(vint v) { return (vfloat)_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))); }
inline vfloat high_nibbles(vint v) { return (vfloat)_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)); }
#else
typedef __m256i vint;
inline vfloat load_bytes(const int8_t* p) {
  return (vfloat)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vint load_ubytes(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline vfloat low_nibbles(vint v) { return (vfloat)_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))); }
inline vfloat high_nibbles(vint v) { return (vfloat)_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)); }
#endif

struct Panel {
  const void* q;         // this panel's values
  const float* scales;   // [G, PANEL]
  const float* offsets;  // [G, PANEL] or null
};

// y[0 : ROWS, :cols] = x[0 : ROWS] dequant(panel) (+ bias).
template <int BITS, bool OFFSETS, int ROWS>
void micro(const float* x, int64_t k_len, int64_t group, const Panel& panel, const float* bias,
           float* y, int64_t y_stride, int64_t cols, Prefetcher& prefetch) {
  vfloat acc[ROWS][NV];
  for (int i = 0; i < ROWS; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vfloat{};
  const int64_t groups = k_len / group;
  for (int64_t g = 0; g < groups; ++g) {
    vfloat s[NV], m[NV];
    for (int v = 0; v < NV; ++v) {
      s[v] = vload(panel.scales + g * PANEL + v * VL);
      m[v] = OFFSETS ? vload(panel.offsets + g * PANEL + v * VL) : vfloat{};
    }
    const int64_t k_end = (g + 1) * group;
    if constexpr (BITS == 8) {
      const int8_t* q = static_cast<const int8_t*>(panel.q);
      for (int64_t k = g * group; k < k_end; ++k) {
        vfloat w[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) w[v] = OFFSETS ? load_bytes(q + k * PANEL + v * VL) * s[v] + m[v]
                                                    : load_bytes(q + k * PANEL + v * VL) * s[v];
        prefetch.step();
        fma_rows<ROWS>(acc, x, k_len, k, w);
      }
    } else {
      const uint8_t* q = static_cast<const uint8_t*>(panel.q);
      for (int64_t k = g * group; k < k_end; k += 2) {  // group sizes are even: pairs stay inside
        vint packed[NV];
        vfloat w[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
          packed[v] = load_ubytes(q + (k / 2) * PANEL + v * VL);
          const vfloat low = low_nibbles(packed[v]);
          w[v] = OFFSETS ? low * s[v] + m[v] : low * s[v];
        }
        prefetch.step();
        fma_rows<ROWS>(acc, x, k_len, k, w);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
          const vfloat high = high_nibbles(packed[v]);
          w[v] = OFFSETS ? high * s[v] + m[v] : high * s[v];
        }
        fma_rows<ROWS>(acc, x, k_len, k + 1, w);
      }
    }
  }
  quiver_panels::store_rows<ROWS>(acc, bias, y, y_stride, cols);
}

template <int BITS, bool OFFSETS>
void run(const float* x, int64_t m, int64_t k_len, int64_t group, const uint8_t* q, const float* scales,
         const float* offsets, int64_t n, const float* bias_padded, float* y) {
  const int64_t panels = (n + PANEL - 1) / PANEL;
  const int64_t panel_bytes = k_len * PANEL * BITS / 8;
  const int64_t panel_params = (k_len / group) * PANEL;
  quiver_panels::for_panel_items(m, panels, [&](int64_t p, int64_t m_begin, int64_t m_end, bool next,
                                                Prefetcher& prefetch) {
    const Panel panel{q + p * panel_bytes, scales + p * panel_params, OFFSETS ? offsets + p * panel_params : nullptr};
    const float* bias = bias_padded ? bias_padded + p * PANEL : nullptr;
    const int64_t cols = std::min<int64_t>(PANEL, n - p * PANEL);
    const int64_t steps = quiver_panels::row_blocks<MR>(m_end - m_begin) * (BITS == 8 ? k_len : k_len / 2);
    prefetch.reset(next ? reinterpret_cast<const char*>(q + (p + 1) * panel_bytes) : nullptr, panel_bytes / 64,
                   steps);
    quiver_panels::for_row_blocks<MR>(m_begin, m_end, [&](auto rows, int64_t r) {
      micro<BITS, OFFSETS, decltype(rows)::value>(x + r * k_len, k_len, group, panel, bias, y + p * PANEL + r * n,
                                                  n, cols, prefetch);
    });
  });
}

at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias,
                        int64_t n, int64_t bits, int64_t group) {
  TORCH_CHECK(x.device().is_cpu(), "linear_quant runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in]");
  const int64_t m = x.size(0), k_len = x.size(1);
  const int64_t panels = quiver_quant::check_packed(q, scales, offsets, k_len, n, bits, group, PANEL);
  const bool has_offsets = offsets.has_value();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const std::vector<float> b = quiver_quant::padded_bias(bias, n, panels, PANEL);
  const auto* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* op = has_offsets ? offsets->data_ptr<float>() : nullptr;
  const float* bp = b.empty() ? nullptr : b.data();
  float* yp = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  quiver_quant::with_format(bits, has_offsets, [&](auto bits_c, auto offsets_c) {
    run<decltype(bits_c)::value, decltype(offsets_c)::value>(xp, m, k_len, group, qp, sp, op, n, bp, yp);
  });
  return y;
}

int64_t quant_panel_width() { return PANEL; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(quiver_cpu, m) {
  m.def("linear_quant(Tensor x, Tensor q, Tensor scales, Tensor? offsets, Tensor? bias, int out_features, "
        "int bits, int group_size) -> Tensor");
  m.def("quant_panel_width() -> int");
  m.impl("linear_quant", c10::DispatchKey::CPU, &linear_quant);
  m.impl("quant_panel_width", c10::DispatchKey::CatchAll, &quant_panel_width);
}
