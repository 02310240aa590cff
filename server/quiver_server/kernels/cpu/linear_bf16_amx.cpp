// bfloat16 projections on AMX (tdpbf16ps) for bfloat16 models: y = x W^T (+ bias), x, W and y
// bfloat16, sums in float32; the tile products are amx_tiles.h's.
//
// torch's F.linear (oneDNN) reads a plain [out, in] weight and rearranges it for the tiles on
// every call: at decode sizes its products moved ~10 GB/s of weights where this host streams
// ~20. Here the weight is rearranged once at load (kernels/cpu_gemm.py) into the B tiles' own
// layout, [P][S][3][16][32] for P panels of 48 outputs and S steps of 32 inputs (zero-padded):
// tile row r of step s holds inputs 32s + 2r and 32s + 2r + 1 of each of the tile's 16 outputs,
// interleaved. The products then load their B tiles straight from the weight, which a panel
// reads front to back.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "amx_tiles.h"
#include "quant_packed.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

#if defined(QUIVER_AMX)

using namespace quiver_amx;

// amx_tiles.h's weight source: the packed weight itself.
struct PackedSource {
  const uint16_t* packed;
  int64_t steps;  // S: steps of 32 inputs per panel

  const uint16_t* chunk(int64_t p, int64_t k0, const uint16_t*) const {
    return packed + (p * steps + k0 / 32) * 3 * TILE_ELEMS;
  }
  // Nothing to prepare: a panel's weights are one sequential stream, which the hardware
  // prefetchers follow (prefetching the next chunk by hand measured no faster).
  void prepare(int64_t, int64_t, int64_t, int64_t, uint16_t*, __m512i) const {}
};

// Rows per work item beyond 32 rows: x's slice (blocked, 36 KB per 32 rows of K = 576) stays in
// L2 while the item's panels go by.
constexpr int64_t ITEM_BLOCKS = 8;

// More than 32 rows: items of up to ITEM_BLOCKS blocks of 32 rows by a range of panels; per panel
// and block, the sums stay in the C tiles over all of K (amx_tiles.h's panel groups keep them
// in memory between chunks, which the quantized weights need so as to dequantize a chunk once
// for all the rows; a weight read as it is does not).
void run_blocks(const Problem& pr, const PackedSource& source) {
  const int64_t blocks = (pr.m + 31) / 32, steps = pr.k_pad / 32;
  const int64_t row_items = (blocks + ITEM_BLOCKS - 1) / ITEM_BLOCKS;
  const int64_t threads = at::get_num_threads();
  const int64_t panel_items = std::min(pr.panels, std::max<int64_t>(1, (2 * threads + row_items - 1) / row_items));
  at::parallel_for(0, row_items * panel_items, 1, [&](int64_t begin, int64_t end) {
    configure_tiles<2>(16);
    alignas(64) float sums[32 * PANEL];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t rows_item = item / panel_items, panels_item = item % panel_items;
      const int64_t b0 = rows_item * ITEM_BLOCKS, b1 = std::min(blocks, b0 + ITEM_BLOCKS);
      const int64_t p0 = panels_item * pr.panels / panel_items, p1 = (panels_item + 1) * pr.panels / panel_items;
      for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* weights = source.chunk(p, 0, nullptr);
        for (int64_t b = b0; b < b1; ++b) {
          zero_sums<2>();
          for (int64_t s = 0; s < steps; ++s) product_step<2>(pr.rows, 2 * b, s, weights + s * 3 * TILE_ELEMS);
          store_sums<2>(sums);
          store_rows(pr, p, p + 1, b * 32, std::min<int64_t>(32, pr.m - b * 32), sums, 32);
        }
      }
    }
    _tile_release();
  });
}

bool available() { return amx_ready(); }

at::Tensor linear_bf16_amx(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t n) {
  TORCH_CHECK(amx_ready(), "linear_bf16_amx unavailable: the CPU or the OS does not grant AMX tiles");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "linear_bf16_amx runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a bfloat16 [rows, in] with contiguous rows");
  const int64_t m = x.size(0), k_len = x.size(1);
  const int64_t panels = (n + PANEL - 1) / PANEL, steps = (k_len + 31) / 32;
  TORCH_CHECK(n > 0 && k_len > 0, "empty weight");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.sizes() == at::IntArrayRef({panels, steps, 3, 16, 32}),
              "packed weight ", packed.sizes(), " does not fit ", k_len, " inputs and ", n, " outputs");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const std::vector<float> b = quiver_quant::padded_bias(bias, n, panels, PANEL);
  const int64_t k_pad = steps * 32;
  at::Tensor xs;
  const Rows rows = a_rows(x, k_pad, xs);
  const Problem pr{rows, m, k_pad, n, panels, b.empty() ? nullptr : b.data(), y.data_ptr<at::BFloat16>()};
  const PackedSource source{reinterpret_cast<const uint16_t*>(packed.data_ptr()), steps};
  if (m <= 32) run(pr, source);
  else run_blocks(pr, source);
  return y;
}

#else  // no AMX-BF16 in this build: cpu_gemm leaves bfloat16 weights to F.linear

bool available() { return false; }

at::Tensor linear_bf16_amx(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false, "linear_bf16_amx unavailable: this build does not target AMX-BF16 and AVX512-BF16");
  return {};
}

#endif

bool bf16_amx_available() { return available(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(quiver_cpu, m) {
  m.def("linear_bf16_amx(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("bf16_amx_available() -> bool");
  m.impl("linear_bf16_amx", c10::DispatchKey::CPU, &linear_bf16_amx);
  m.impl("bf16_amx_available", c10::DispatchKey::CatchAll, &bf16_amx_available);
}
