// Quantized projections with 8-bit activations (`--quantize-activations int8`), on CPU:
//
//   y[m, n] = sum over blocks b of 32 inputs of  d[m, b] * (s[n, g(b)] * (sum_{k in b} q[n, k] * a[m, k])
//                                                              + o[n, g(b)] * (sum_{k in b} a[m, k]))  (+ bias[n])
//
// where x's row m is rounded block by block to a[m, k] = round(x[m, k] * 127 / max|x[m, b]|) in
// [-127, 127], d[m, b] = max|x[m, b]| / 127 (as llama.cpp multiplies its quantized files: its Q8_0
// activation blocks are these), q and s, o are the weight's values, scales and offsets (w = q * s + o)
// and g(b) the weight group holding block b (groups are whole blocks): the product of the rounded
// x with the weight, the offsets included. (Offsets times the sum of x itself, unrounded, left
// the rounding errors times q in 0..15 rather than times w: 3.6% more perplexity on the demo
// model in int4, against 0.7%.) The inner sums are exact 32-bit integers, made by the
// 8-bit dot-product instructions: VNNI's vpdpbusd (64 products an instruction with AVX-512, where
// a float32 multiply-add makes 16), or AVX2's vpmaddubsw + vpmaddwd where there is no VNNI. They
// multiply an unsigned byte by a signed one, so the weight is stored unsigned:
//   8-bit: q + 128, [P, K / 4, PANEL, 4]: lane j of a 32-bit word holds q[j, 4 i .. 4 i + 3];
//          the sum then carries 128 * sum(a) too, taken back out by starting it at -128 * sum(a).
//          (AVX2 multiplies |a| by q with a's sign instead, which cannot saturate vpmaddubsw.)
//   4-bit: q (0..15), [P, K / 8, PANEL, 4]: byte i of lane j holds q[j, 8 i + t] | q[j, 8 i + 4 + t] << 4.
// kernels/quant_gemm.py packs them; the scales and offsets keep linear_quant.cpp's panels.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "f32_panels.h"
#include "quant_packed.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using quiver_panels::NV;
using quiver_panels::PANEL;
using quiver_panels::Prefetcher;
using quiver_panels::vfloat;
using quiver_panels::vload;
using quiver_panels::VL;

constexpr int64_t kBlock = 32;  // inputs per activation scale
constexpr int64_t kPanelBytes = PANEL * 4;  // one panel row of 4-byte lanes

#if defined(__AVX512F__)
typedef __m512i vint;
// Accumulators and weights for ROWS rows: AVX-512 keeps 4 rows x 3 vectors of each (24 of 32 zmm).
constexpr int MR = 4;
inline vint load_int(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline vint splat(int32_t v) { return _mm512_set1_epi32(v); }
inline vint zero_int() { return _mm512_setzero_si512(); }
inline vfloat to_float(vint v) { return (vfloat)_mm512_cvtepi32_ps(v); }
inline vint low_nibbles(vint v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline vint high_nibbles(vint v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
#else
typedef __m256i vint;
constexpr int MR = 2;  // 16 ymm: 2 rows x 2 vectors of each, with the sign and weight temporaries
inline vint load_int(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vint splat(int32_t v) { return _mm256_set1_epi32(v); }
inline vint zero_int() { return _mm256_setzero_si256(); }
inline vfloat to_float(vint v) { return (vfloat)_mm256_cvtepi32_ps(v); }
inline vint low_nibbles(vint v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline vint high_nibbles(vint v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
constexpr bool kVnni = true;
// acc + the sums of 4 products u[i] * s[i] per 32-bit lane (u unsigned, s signed bytes).
inline vint dot_unsigned(vint acc, vint u, vint s) { return _mm512_dpbusd_epi32(acc, u, s); }
#elif !defined(__AVX512F__) && defined(__AVXVNNI__)
constexpr bool kVnni = true;
inline vint dot_unsigned(vint acc, vint u, vint s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#elif defined(__AVX512F__)
constexpr bool kVnni = false;
// Exact while each pair of products fits 16 bits: the callers keep u below 128 (|a|, or 4-bit q).
inline vint dot_unsigned(vint acc, vint u, vint s) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
#else
constexpr bool kVnni = false;
inline vint dot_unsigned(vint acc, vint u, vint s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

// acc + q . a for signed bytes q (stored as q + 128) and a, per 4-byte lane. VNNI multiplies the
// stored q + 128 by a (the caller's start of -128 * sum(a) takes the excess back); without it,
// |a| by q carrying a's sign, since (q + 128) * a can overflow vpmaddubsw's 16-bit pairs.
inline vint dot_signed(vint acc, vint stored, vint a) {
  if constexpr (kVnni) {
    return dot_unsigned(acc, stored, a);
  } else {
#if defined(__AVX512F__)
    const vint q = _mm512_xor_si512(stored, _mm512_set1_epi8(-128));
    const __mmask64 negative = _mm512_movepi8_mask(a);
    const vint signed_q = _mm512_mask_sub_epi8(q, negative, _mm512_setzero_si512(), q);
    return dot_unsigned(acc, _mm512_abs_epi8(a), signed_q);
#else
    const vint q = _mm256_xor_si256(stored, _mm256_set1_epi8(-128));
    return dot_unsigned(acc, _mm256_abs_epi8(a), _mm256_sign_epi8(q, a));
#endif
  }
}

// x's rows rounded to bytes, block by block, and what the sums need of each block.
struct Activations {
  std::vector<int8_t> a;       // [M, K]
  std::vector<float> scale;    // [M, K / 32]: d = max|x| / 127
  std::vector<float> sum;      // [M, K / 32]: d * sum(a) (for the offsets)
  std::vector<int32_t> start;  // [M, K / 32]: -128 * sum(a) (8-bit weights on VNNI), else 0
  int64_t k_len = 0, blocks = 0;

  Activations(const float* x, int64_t m, int64_t k) : a(m * k), scale(m * (k / kBlock)), sum(m * (k / kBlock)),
                                                      start(m * (k / kBlock)), k_len(k), blocks(k / kBlock) {
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t b = 0; b < blocks; ++b) round_block(x + r * k + b * kBlock, r * blocks + b, r * k + b * kBlock);
    });
  }

  void round_block(const float* x, int64_t at, int64_t first) {
    float amax = 0.f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
    // 127 / amax and x * that, each rounded to float32, then to the nearest integer (ties to
    // even): the reference (kernels/quant_gemm.py) computes the same bytes.
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    int32_t bytes_sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const float scaled = x[i] * inverse;
      const int32_t v = static_cast<int32_t>(std::nearbyint(scaled));
      a[first + i] = static_cast<int8_t>(v);
      bytes_sum += v;
    }
    scale[at] = amax / 127.f;
    sum[at] = scale[at] * static_cast<float>(bytes_sum);
    start[at] = -128 * bytes_sum;
  }
};

struct Panel {
  const uint8_t* q;      // this panel's packed values
  const float* scales;   // [G, PANEL]
  const float* offsets;  // [G, PANEL] or null
};

inline int32_t quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// y[r0 : r0 + ROWS, :cols] for one panel. PER_ROW: one scale per output for all of K (int8 per
// channel, no offsets), applied once at the end; otherwise each block takes its group's.
template <int BITS, bool OFFSETS, bool PER_ROW, int ROWS>
void micro(const Activations& acts, int64_t r0, int64_t group, const Panel& panel, const float* bias, float* y,
           int64_t y_stride, int64_t cols, Prefetcher& prefetch) {
  const int64_t k_len = acts.k_len, blocks = acts.blocks;
  vfloat acc[ROWS][NV];
  for (int t = 0; t < ROWS; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v] = vfloat{};
  const int8_t* a_rows = acts.a.data() + r0 * k_len;
  for (int64_t b = 0; b < blocks; ++b) {
    vint sums[ROWS][NV];
    for (int t = 0; t < ROWS; ++t) {
      const vint first = (BITS == 8 && kVnni) ? splat(acts.start[(r0 + t) * blocks + b]) : zero_int();
      for (int v = 0; v < NV; ++v) sums[t][v] = first;
    }
    const int8_t* a_block = a_rows + b * kBlock;
    if constexpr (BITS == 8) {
      const uint8_t* q = panel.q + b * (kBlock / 4) * kPanelBytes;
#pragma GCC unroll 8
      for (int i = 0; i < kBlock / 4; ++i) {
        vint w[NV];
        for (int v = 0; v < NV; ++v) w[v] = load_int(q + i * kPanelBytes + v * VL * 4);
        prefetch.step();
        for (int t = 0; t < ROWS; ++t) {
          const vint a = splat(quad(a_block + t * k_len + 4 * i));
          for (int v = 0; v < NV; ++v) sums[t][v] = dot_signed(sums[t][v], w[v], a);
        }
      }
    } else {
      const uint8_t* q = panel.q + b * (kBlock / 8) * kPanelBytes;
#pragma GCC unroll 4
      for (int i = 0; i < kBlock / 8; ++i) {
        vint packed[NV], w[NV];
        for (int v = 0; v < NV; ++v) {
          packed[v] = load_int(q + i * kPanelBytes + v * VL * 4);
          w[v] = low_nibbles(packed[v]);
        }
        prefetch.step();
        for (int t = 0; t < ROWS; ++t) {
          const vint a = splat(quad(a_block + t * k_len + 8 * i));
          for (int v = 0; v < NV; ++v) sums[t][v] = dot_unsigned(sums[t][v], w[v], a);
        }
        for (int v = 0; v < NV; ++v) w[v] = high_nibbles(packed[v]);
        for (int t = 0; t < ROWS; ++t) {
          const vint a = splat(quad(a_block + t * k_len + 8 * i + 4));
          for (int v = 0; v < NV; ++v) sums[t][v] = dot_unsigned(sums[t][v], w[v], a);
        }
      }
    }
    if constexpr (PER_ROW) {
      for (int t = 0; t < ROWS; ++t) {
        const float d = acts.scale[(r0 + t) * blocks + b];
        for (int v = 0; v < NV; ++v) acc[t][v] += to_float(sums[t][v]) * d;
      }
    } else {
      const int64_t g = b * kBlock / group;
      vfloat s[NV];
      for (int v = 0; v < NV; ++v) s[v] = vload(panel.scales + g * PANEL + v * VL);
      for (int t = 0; t < ROWS; ++t) {
        const float d = acts.scale[(r0 + t) * blocks + b];
        for (int v = 0; v < NV; ++v) acc[t][v] += to_float(sums[t][v]) * (s[v] * d);
      }
      if constexpr (OFFSETS) {
        for (int t = 0; t < ROWS; ++t) {
          const float a_sum = acts.sum[(r0 + t) * blocks + b];
          for (int v = 0; v < NV; ++v) acc[t][v] += vload(panel.offsets + g * PANEL + v * VL) * a_sum;
        }
      }
    }
  }
  if constexpr (PER_ROW) {
    for (int v = 0; v < NV; ++v) {
      const vfloat s = vload(panel.scales + v * VL);
      for (int t = 0; t < ROWS; ++t) acc[t][v] *= s;
    }
  }
  quiver_panels::store_rows<ROWS>(acc, bias, y, y_stride, cols);
}

template <int BITS, bool OFFSETS, bool PER_ROW>
void run(const Activations& acts, int64_t m, int64_t group, const uint8_t* q, const float* scales,
         const float* offsets, int64_t n, const float* bias_padded, float* y) {
  const int64_t k_len = acts.k_len;
  const int64_t panels = (n + PANEL - 1) / PANEL;
  const int64_t panel_bytes = k_len * PANEL * BITS / 8;
  const int64_t panel_params = (k_len / group) * PANEL;
  quiver_panels::for_panel_items(m, panels, [&](int64_t p, int64_t m_begin, int64_t m_end, bool next,
                                                Prefetcher& prefetch) {
    const Panel panel{q + p * panel_bytes, scales + p * panel_params, OFFSETS ? offsets + p * panel_params : nullptr};
    const float* bias = bias_padded ? bias_padded + p * PANEL : nullptr;
    const int64_t cols = std::min<int64_t>(PANEL, n - p * PANEL);
    const int64_t steps = quiver_panels::row_blocks<MR>(m_end - m_begin) * k_len / (BITS == 8 ? 4 : 8);
    prefetch.reset(next ? reinterpret_cast<const char*>(q + (p + 1) * panel_bytes) : nullptr, panel_bytes / 64,
                   steps);
    quiver_panels::for_row_blocks<MR>(m_begin, m_end, [&](auto rows, int64_t r) {
      micro<BITS, OFFSETS, PER_ROW, decltype(rows)::value>(acts, r, group, panel, bias, y + p * PANEL + r * n, n,
                                                           cols, prefetch);
    });
  });
}

at::Tensor linear_int8_dot(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias, int64_t n,
                           int64_t bits, int64_t group) {
  TORCH_CHECK(x.device().is_cpu(), "linear_int8_dot runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in]");
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  const int64_t m = x.size(0), k_len = x.size(1);
  TORCH_CHECK(k_len % kBlock == 0 && group % kBlock == 0 && k_len % group == 0, "8-bit activations need inputs (",
              k_len, ") and groups (", group, ") in whole blocks of ", kBlock);
  const int64_t panels = (n + PANEL - 1) / PANEL;
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 3 && q.size(0) == panels &&
                  q.size(1) == k_len / (bits == 8 ? 4 : 8) && q.size(2) == kPanelBytes,
              "packed values ", q.sizes(), " do not fit ", k_len, " inputs and ", n, " outputs");
  quiver_quant::check_params(scales, offsets, k_len / group, panels, PANEL);
  const bool has_offsets = offsets.has_value();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const Activations acts(x.data_ptr<float>(), m, k_len);
  const std::vector<float> b = quiver_quant::padded_bias(bias, n, panels, PANEL);
  const auto* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = has_offsets ? offsets->data_ptr<float>() : nullptr;
  const float* bp = b.empty() ? nullptr : b.data();
  float* yp = y.data_ptr<float>();
  const bool per_row = !has_offsets && group == k_len;
  quiver_quant::with_format(bits, has_offsets, [&](auto bits_c, auto offsets_c) {
    constexpr int kBits = decltype(bits_c)::value;
    constexpr bool kOffsets = decltype(offsets_c)::value;
    if (per_row) {
      if constexpr (!kOffsets) run<kBits, false, true>(acts, m, group, qp, sp, op, n, bp, yp);
    } else {
      run<kBits, kOffsets, false>(acts, m, group, qp, sp, op, n, bp, yp);
    }
  });
  return y;
}

// Whether the 8-bit products run on VNNI (else on AVX2's byte multiply-adds).
bool int8_dot_vnni() { return kVnni; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(quiver_cpu, m) {
  m.def("linear_int8_dot(Tensor x, Tensor q, Tensor scales, Tensor? offsets, Tensor? bias, int out_features, "
        "int bits, int group_size) -> Tensor");
  m.def("int8_dot_vnni() -> bool");
  m.impl("linear_int8_dot", c10::DispatchKey::CPU, &linear_int8_dot);
  m.impl("int8_dot_vnni", c10::DispatchKey::CatchAll, &int8_dot_vnni);
}
