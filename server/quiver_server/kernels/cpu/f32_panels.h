// The frame shared by the column-panel matmuls that accumulate in float32 vector registers
// (linear.cpp: float32 weights; linear_quant.cpp: int8 / 4-bit weights dequantized in registers):
// the panel width, the next panel's prefetch, the block's multiply-adds and store, the split of
// rows into register blocks and of the product into per-thread work items. Each kernel keeps its
// own rows per block (MR) and its own way of producing a panel row's weight vectors. Everything
// here is a template or inline (the pieces of a micro-kernel always inlined, not left as shared
// out-of-line symbols), so the micro-kernels compile to the same loops as when each file spelled
// them out.
#pragma once

#include <ATen/Parallel.h>

#include "vec_f32.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace quiver_panels {

using quiver_vec::kVecRegs;
using quiver_vec::VL;
using quiver_vec::vfloat;
using quiver_vec::vload;
using quiver_vec::vstore;

// Vectors per panel row. AVX-512: 3 (with linear.cpp's 8 rows, 24 accumulators of 32 zmm). AVX2:
// 2 (with 6 rows, 12 of 16 ymm), measured faster than 3 x 4 at 32-128 rows, and its panel row is
// one 64-byte line.
constexpr int NV = kVecRegs >= 32 ? 3 : 2;
constexpr int64_t PANEL = NV * VL;
// Most rows per work item of a prefill-sized product: x's chunk stays near the core while the
// panels stream, and each chunk streams every panel once more. A product is cut into the fewest
// chunks of at most this many rows, of equal size: a mixed step's 256 prompt rows plus 32 decode
// rows stream the weights twice, not three times as 128 + 128 + 32 did (that made such a step
// 12% slower than its prefill and decode run apart), and a 2,040-token prefill on the demo model
// took 3.3-3.8 s against 4.1-4.2 with 128-row chunks (2-core Xeon, AVX-512, docs/benchmarks.md).
constexpr int64_t ROW_CHUNK = 256;

template <int ROWS>
using RowCount = std::integral_constant<int, ROWS>;

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

// acc[i] += x[i * k_len + k] * w for the block's ROWS rows: one broadcast of x per row against the
// panel row's NV weight vectors.
template <int ROWS>
[[gnu::always_inline]] inline void fma_rows(vfloat (&acc)[ROWS][NV], const float* x, int64_t k_len, int64_t k,
                                            const vfloat (&w)[NV]) {
#pragma GCC unroll 8
  for (int i = 0; i < ROWS; ++i) {
    const float xi = x[i * k_len + k];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] += xi * w[v];
  }
}

// y[0 : ROWS, :cols] = acc (+ bias, padded to the panel); y rows y_stride apart.
template <int ROWS>
[[gnu::always_inline]] inline void store_rows(vfloat (&acc)[ROWS][NV], const float* bias, float* y, int64_t y_stride,
                                              int64_t cols) {
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

// Rows [m_begin, m_end) in blocks of MR, then 4 (when MR is larger), 2 and 1 rows:
// block(RowCount<ROWS>{}, first_row) once per block.
template <int MR, typename Block>
inline void for_row_blocks(int64_t m_begin, int64_t m_end, Block&& block) {
  int64_t m = m_begin;
  for (; m + MR <= m_end; m += MR) block(RowCount<MR>{}, m);
  if constexpr (MR > 4) {
    if (m + 4 <= m_end) {
      block(RowCount<4>{}, m);
      m += 4;
    }
  }
  if (m + 2 <= m_end) {
    block(RowCount<2>{}, m);
    m += 2;
  }
  if (m < m_end) block(RowCount<1>{}, m);
}

// How many blocks for_row_blocks<MR> makes of `rows` rows.
template <int MR>
inline int64_t row_blocks(int64_t rows) {
  const int64_t rest = rows % MR;
  return rows / MR + (MR > 4 && rest >= 4) + (rest % 4 >= 2) + (rest % 2);
}

// Work items are (row chunk, panel) pairs, chunk-major, split into one contiguous range per
// thread; a decode-sized product is one chunk, so the threads split the panels.
// item(panel, m_begin, m_end, prefetch_next, prefetcher) once per item; prefetch_next says whether
// this thread's next item is the next panel over the same rows.
template <typename Item>
inline void for_panel_items(int64_t m, int64_t panels, Item&& item) {
  const int64_t fewest = std::max<int64_t>(1, (m + ROW_CHUNK - 1) / ROW_CHUNK);
  // Equal chunks, rounded up to whole 8-row blocks (the chunk count may then shrink).
  const int64_t chunk = std::max<int64_t>(1, ((m + fewest - 1) / fewest + 7) / 8 * 8);
  const int64_t chunks = (m + chunk - 1) / chunk;
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    Prefetcher prefetch;
    for (int64_t it = begin; it < end; ++it) {
      const int64_t c = it / panels, p = it % panels;
      const int64_t m_begin = c * chunk, m_end = std::min(m, m_begin + chunk);
      item(p, m_begin, m_end, it + 1 < end && p + 1 < panels, prefetch);
    }
  });
}

}  // namespace quiver_panels
