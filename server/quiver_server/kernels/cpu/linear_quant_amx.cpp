// Weight-only int8/int4 projections with bfloat16 activations on AMX (tdpbf16ps):
// y = x dequant(W)^T (+ bias), x and y bfloat16, sums in float32; the tile products are
// amx_tiles.h's.
//
// The weight is the one linear_quant.cpp reads, packed once by kernels/quant_gemm.py (so a
// model holds one copy whichever kernel runs): column panels of PANEL = 48 columns (the AVX-512
// build's; every AMX host has AVX-512), k-major, scales and offsets [P, G, PANEL].
//
// Per panel and chunk of KC = 256 inputs, the weights are dequantized once per call into a 24 KB
// bf16 buffer in the B tiles' VNNI layout, which stays in L1 while the row blocks use it. Each
// weight is bf16(q * scale + offset), product and sum rounded in float32, then to bf16 (to nearest
// even): the weight a bf16 model dequantizes to (QuantizedWeight.dequantize(torch.bfloat16)). The
// dequantization costs ~10 vector instructions per 32 weights whatever the rows, where the
// float32 FMA kernel spends 2 FMAs per row on them: that kernel wins at 1-2 rows, this one from
// a few rows on (quant_gemm dispatches by rows), and the tile unit makes prefill-sized products
// about as fast as oneDNN's bf16 ones on the dequantized weight. The next chunk's dequantization
// goes into a second buffer, interleaved with the products of this one (measured: 7-20% less
// time than dequantizing and multiplying in turn; a tile load never reads lines just stored).
//
// Where the build has no AMX (amx_tiles.h), the op is a stub and quant_gemm uses linear_quant.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx_tiles.h"
#include "quant_packed.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

#if defined(QUIVER_AMX)

using namespace quiver_amx;

struct Weights {
  const uint8_t* q;       // [P, K or K / 2, PANEL]
  const float* scales;    // [P, G, PANEL]
  const float* offsets;   // same, or null
  int64_t k_len, group, groups;
};

// How far ahead dequantize() asks for the weights. The hardware prefetchers alone left the
// dequantization waiting on memory: a model's projections at 32 rows took 15 ms in int8 against
// 12 with this (int4 13 -> 11, 8 rows 12.7 -> 9.9; 2 AMX Xeon cores, weights from DRAM).
constexpr int64_t PREFETCH_INPUTS = 2 * KC;

// Inputs k0 + [i0, i1) (even offsets) of panel p's chunk at k0 into buf [STEPS][3][16][32], the B
// tiles' VNNI layout; inputs past K (up to the next multiple of 32) are zero.
template <int BITS, bool OFFSETS>
void dequantize(const Weights& w, int64_t p, int64_t k0, int64_t i0, int64_t i1, uint16_t* buf, __m512i order) {
  const int64_t k_stop = std::min((w.k_len + 31) / 32 * 32, k0 + i1);
  const int64_t k_end = std::min(w.k_len, k_stop);
  const float* scales = w.scales + p * w.groups * PANEL;
  const float* offsets = OFFSETS ? w.offsets + p * w.groups * PANEL : nullptr;
  const uint8_t* q = w.q + p * (w.k_len * PANEL * BITS / 8);
  int64_t k = k0 + i0;
  while (k < k_end) {
    const int64_t g = k / w.group, g_end = std::min(k_end, (g + 1) * w.group);
    __m512 s[3], m[3];
    for (int t = 0; t < 3; ++t) {
      s[t] = _mm512_loadu_ps(scales + g * PANEL + t * 16);
      m[t] = OFFSETS ? _mm512_loadu_ps(offsets + g * PANEL + t * 16) : _mm512_setzero_ps();
    }
    for (; k < g_end; k += 2) {  // group sizes are even, so k and k + 1 share a group
      const int64_t kk = k - k0;
      // The weights PREFETCH_INPUTS on (two chunks; past the panel's end, the next panel's, which
      // follows in memory; past the tensor's end a prefetch is a no-op, never a fault).
      const char* ahead = reinterpret_cast<const char*>(q + (k + PREFETCH_INPUTS) * PANEL * BITS / 8);
      __builtin_prefetch(ahead);
      __builtin_prefetch(ahead + 64);
      uint16_t* row = buf + (kk / 32) * 3 * TILE_ELEMS + ((kk % 32) / 2) * 32;
#pragma GCC unroll 3
      for (int t = 0; t < 3; ++t) {
        __m512 even, odd;
        if constexpr (BITS == 8) {
          const auto* src = reinterpret_cast<const __m128i*>(q + k * PANEL + t * 16);
          even = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src)));
          odd = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src + PANEL / 16)));
        } else {
          const __m512i both = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (k / 2) * PANEL + t * 16)));
          even = _mm512_cvtepi32_ps(_mm512_and_si512(both, _mm512_set1_epi32(15)));
          odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(both, 4));
        }
        even = _mm512_mul_ps(even, s[t]);  // no FMA: q * scale and + offset round as torch's do
        odd = _mm512_mul_ps(odd, s[t]);
        if constexpr (OFFSETS) {
          even = _mm512_add_ps(even, m[t]);
          odd = _mm512_add_ps(odd, m[t]);
        }
        const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
        _mm512_store_si512(row + t * TILE_ELEMS, _mm512_permutexvar_epi16(order, words));
      }
    }
  }
  for (; k < k_stop; k += 2) {
    const int64_t kk = k - k0;
    uint16_t* row = buf + (kk / 32) * 3 * TILE_ELEMS + ((kk % 32) / 2) * 32;
    for (int t = 0; t < 3; ++t) _mm512_store_si512(row + t * TILE_ELEMS, _mm512_setzero_si512());
  }
}

// amx_tiles.h's weight source: each chunk dequantized into the pipeline's buffer.
template <int BITS, bool OFFSETS>
struct QuantSource {
  Weights w;
  const uint16_t* chunk(int64_t, int64_t, const uint16_t* buf) const { return buf; }
  void prepare(int64_t p, int64_t k0, int64_t i0, int64_t i1, uint16_t* buf, __m512i order) const {
    dequantize<BITS, OFFSETS>(w, p, k0, i0, i1, buf, order);
  }
};

bool available() { return amx_ready(); }

at::Tensor linear_quant_amx(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& bias,
                            int64_t n, int64_t bits, int64_t group) {
  TORCH_CHECK(amx_ready(), "linear_quant_amx unavailable: the CPU or the OS does not grant AMX tiles");
  TORCH_CHECK(x.device().is_cpu(), "linear_quant_amx runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a bfloat16 [rows, in] with contiguous rows");
  const int64_t m = x.size(0), k_len = x.size(1);
  const int64_t panels = quiver_quant::check_packed(q, scales, offsets, k_len, n, bits, group, PANEL);
  const bool has_offsets = offsets.has_value();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const std::vector<float> b = quiver_quant::padded_bias(bias, n, panels, PANEL);
  const int64_t k_pad = (k_len + 31) / 32 * 32;
  at::Tensor xs;
  const Rows rows = a_rows(x, k_pad, xs);
  const Problem pr{rows, m, k_pad, n, panels, b.empty() ? nullptr : b.data(), y.data_ptr<at::BFloat16>()};
  const Weights w{static_cast<const uint8_t*>(q.data_ptr()), scales.data_ptr<float>(),
                  has_offsets ? offsets->data_ptr<float>() : nullptr, k_len, group, k_len / group};
  quiver_quant::with_format(bits, has_offsets, [&](auto bits_c, auto offsets_c) {
    run(pr, QuantSource<decltype(bits_c)::value, decltype(offsets_c)::value>{w});
  });
  return y;
}

#else  // no AMX-BF16 in this build: quant_gemm keeps to linear_quant

bool available() { return false; }

at::Tensor linear_quant_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                            const c10::optional<at::Tensor>&, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "linear_quant_amx unavailable: this build does not target AMX-BF16 and AVX512-BF16");
  return {};
}

#endif

bool quant_amx_available() { return available(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(quiver_cpu, m) {
  m.def("linear_quant_amx(Tensor x, Tensor q, Tensor scales, Tensor? offsets, Tensor? bias, int out_features, "
        "int bits, int group_size) -> Tensor");
  m.def("quant_amx_available() -> bool");
  m.impl("linear_quant_amx", c10::DispatchKey::CPU, &linear_quant_amx);
  m.impl("quant_amx_available", c10::DispatchKey::CatchAll, &quant_amx_available);
}
