// The AMX tile machinery of the bfloat16-activation matmuls (linear_quant_amx.cpp: quantized
// weights; linear_bf16_amx.cpp: bfloat16 weights): y = x W^T (+ bias), x and y bfloat16, sums in
// float32, W in column panels of PANEL = 48 columns (3 AMX B tiles of 16).
//
// A weight Source hands the products one chunk of KC inputs of one panel at a time, in the B
// tiles' VNNI layout ([STEPS][3][16][32]: tile row r holds inputs 2r and 2r + 1 of each of its 16
// columns, interleaved):
//   const uint16_t* chunk(p, k0, buf): the chunk of panel p at input k0; `buf` is the buffer
//     prepare() filled for it, where the source needs one;
//   void prepare(p, k0, i0, i1, buf, order): readies inputs k0 + [i0, i1) (even offsets) of
//     that chunk, ahead of its use: dequantizes them into buf, or prefetches them.
// The products call prepare() for the next chunk in small pieces between their own tile steps,
// so that the vector ports (or the memory system) and the tile unit work in parallel.
//
// Up to 32 rows: each panel's sums stay in the C tiles over all of K: 16 rows in 3 C tiles (1 A,
// 3 B), 32 rows in 6 (the A and B tiles reloaded as the 6 products go round, 8 tiles in all).
// More rows: blocks of 32 rows over a group of panels, k chunk by k chunk, so x's slice stays in
// L2 over the group while a chunk's weights stay in L1 over the rows; the sums go to a float32
// scratch between chunks.
//
// Everything here is compiled only where the compiler targets AMX-BF16 and AVX512-BF16
// (-march=native on Sapphire Rapids and later; QUIVER_AMX). GCC keeps AMX enabled under
// -mno-avx512f (QUIVER_CPU_ISA=avx2), so AVX512-BF16 is what tells the AVX2 build apart; there
// the ops are stubs. Linux also needs the process to ask for the tile state (arch_prctl
// ARCH_REQ_XCOMP_PERM) once; if it refuses, the ops report unavailable.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "vec_width.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#define QUIVER_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace quiver_amx {

// linear_quant.cpp's panel width on AVX-512 (3 vectors of 16), which the quantized weights share.
constexpr int64_t PANEL = 3 * quiver_vec::VL;
static_assert(PANEL == 48, "the tile code below is written for 3 B tiles per panel");
constexpr int64_t KC = 256;                   // inputs per chunk: 24 KB of bf16 weights, in L1
constexpr int64_t STEPS = KC / 32;            // tile products per chunk, row block and B tile
constexpr int64_t TILE_ELEMS = 16 * 32;       // bf16 per A or B tile
constexpr int64_t BUF_ELEMS = STEPS * 3 * TILE_ELEMS;
constexpr int64_t ROW_CHUNK = 512;            // rows per work item (a multiple of 32)
constexpr int64_t SCRATCH_BYTES = 512 << 10;  // float32 sums of a panel group, in L2

inline bool amx_ready() {
  static const bool ready = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return false;  // AVX512-BF16
    constexpr long kGetPerm = 0x1022, kReqPerm = 0x1023, kXtileData = 18;
    if (syscall(SYS_arch_prctl, kReqPerm, kXtileData) != 0) return false;
    unsigned long granted = 0;
    return syscall(SYS_arch_prctl, kGetPerm, &granted) == 0 && (granted & (1ul << kXtileData));
  }();
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// RB = 1 (up to 16 rows): tiles 0-2 C, 3 A, 4-6 B; C and A have only the rows there are, so a
// decode step reads no padding. RB = 2 (32-row blocks): tiles 0-5 C (rows 0-15 | 16-31 by 3 B
// tiles), 6 A, 7 B, all of 16 rows.
template <int RB>
inline void configure_tiles(int rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = RB == 1 && t < 4 ? rows : 16;
  }
  _tile_loadconfig(&config);
}

// Words (k even: columns 0-15 | k odd: columns 0-15) -> (c0 k0, c0 k1, c1 k0, ...): a B tile row.
inline __m512i vnni_index() {
  alignas(64) int16_t idx[32];
  for (int c = 0; c < 16; ++c) {
    idx[2 * c] = static_cast<int16_t>(c);
    idx[2 * c + 1] = static_cast<int16_t>(16 + c);
  }
  return _mm512_load_si512(idx);
}

// Where the A tiles come from: x in place (up to 16 rows) or blocked_rows' copy.
struct Rows {
  const uint16_t* x;
  int64_t stride;       // bytes between a tile's rows
  int64_t step_elems;   // from one 32-input step to the next
  int64_t block_elems;  // from one block of 16 rows to the next

  const uint16_t* at(int64_t block, int64_t step) const { return x + block * block_elems + step * step_elems; }
};

// The C tiles += one step's A tiles (block `block` and, RB = 2, the next) times its 3 B tiles at
// b. Tile numbers are immediates, hence no loops. With RB = 2 the A and B tiles are reloaded as
// the 6 products go round (7 loads for 6 products, where 2 x 3 separate tiles would not fit).
template <int RB>
inline void product_step(const Rows& rows, int64_t block, int64_t step, const uint16_t* b) {
  if constexpr (RB == 1) {
    _tile_loadd(3, rows.at(block, step), rows.stride);
    _tile_loadd(4, b, 64);
    _tile_loadd(5, b + TILE_ELEMS, 64);
    _tile_loadd(6, b + 2 * TILE_ELEMS, 64);
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_dpbf16ps(2, 3, 6);
  } else {
    _tile_loadd(6, rows.at(block, step), rows.stride);
    _tile_loadd(7, b, 64);
    _tile_dpbf16ps(0, 6, 7);
    _tile_loadd(7, b + TILE_ELEMS, 64);
    _tile_dpbf16ps(1, 6, 7);
    _tile_loadd(7, b + 2 * TILE_ELEMS, 64);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(6, rows.at(block + 1, step), rows.stride);
    _tile_dpbf16ps(5, 6, 7);
    _tile_loadd(7, b + TILE_ELEMS, 64);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(7, b, 64);
    _tile_dpbf16ps(3, 6, 7);
  }
}

// The sums of RB * 16 rows by PANEL columns, c [RB * 16][PANEL] float32.
template <int RB>
inline void zero_sums() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  if constexpr (RB == 2) {
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
  }
}

template <int RB>
inline void load_sums(const float* c) {
  _tile_loadd(0, c, PANEL * 4);
  _tile_loadd(1, c + 16, PANEL * 4);
  _tile_loadd(2, c + 32, PANEL * 4);
  if constexpr (RB == 2) {
    _tile_loadd(3, c + 16 * PANEL, PANEL * 4);
    _tile_loadd(4, c + 16 * PANEL + 16, PANEL * 4);
    _tile_loadd(5, c + 16 * PANEL + 32, PANEL * 4);
  }
}

template <int RB>
inline void store_sums(float* c) {
  _tile_stored(0, c, PANEL * 4);
  _tile_stored(1, c + 16, PANEL * 4);
  _tile_stored(2, c + 32, PANEL * 4);
  if constexpr (RB == 2) {
    _tile_stored(3, c + 16 * PANEL, PANEL * 4);
    _tile_stored(4, c + 16 * PANEL + 16, PANEL * 4);
    _tile_stored(5, c + 16 * PANEL + 32, PANEL * 4);
  }
}

struct Problem {
  Rows rows;
  int64_t m, k_pad, n, panels;
  const float* bias;   // padded to panels * PANEL, or null
  at::BFloat16* y;
};

// x as [blocks][k_pad / 32][16][32], zero-padded to `blocks` blocks of 16 rows: an A tile is 1 KB
// in a row, where 16 rows of a K = 2048 x would sit 4 KB apart, all in one L1 set.
inline at::Tensor blocked_rows(const at::Tensor& x, int64_t k_pad, int64_t blocks) {
  const int64_t m = x.size(0), k_len = x.size(1), steps = k_pad / 32;
  at::Tensor out = at::empty({blocks, steps, 16, 32}, x.options());
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t stride = x.stride(0);
  at::parallel_for(0, blocks * 16, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / 16, i = r % 16;
      for (int64_t s = 0; s < steps; ++s) {
        uint16_t* row = dst + ((b * steps + s) * 16 + i) * 32;
        const int64_t valid = r < m ? std::clamp<int64_t>(k_len - s * 32, 0, 32) : 0;
        if (valid) std::memcpy(row, src + r * stride + s * 32, valid * 2);
        std::memset(row + valid, 0, (32 - valid) * 2);
      }
    }
  });
  return out;
}

// y[rows r0 .. r0 + count, panels p0 .. p1] = sums (+ bias), rounded to bf16; sums [p1 - p0][rows
// of `panel_rows`][PANEL]. Row by row, so that y is written in runs of whole panels.
inline void store_rows(const Problem& pr, int64_t p0, int64_t p1, int64_t r0, int64_t count, const float* sums,
                int64_t panel_rows) {
  for (int64_t i = 0; i < count; ++i) {
    at::BFloat16* y = pr.y + (r0 + i) * pr.n;
    for (int64_t p = p0; p < p1; ++p) {
      const float* row = sums + ((p - p0) * panel_rows + i) * PANEL;
      for (int t = 0; t < 3; ++t) {
        const int64_t col = p * PANEL + t * 16, c = std::min<int64_t>(16, pr.n - col);
        if (c <= 0) break;
        __m512 v = _mm512_loadu_ps(row + t * 16);
        if (pr.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(pr.bias + col));
        _mm256_mask_storeu_epi16(y + col, static_cast<__mmask16>((1u << c) - 1), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}

// A thread's work is a sequence of units, each one panel's chunk of KC inputs; the source
// prepares the next unit (into the other of two buffers, where it needs one) interleaved with the
// tile products of the current one.
struct Pipeline {
  uint16_t* bufs[2];
  __m512i order;
};

// Up to 32 rows (RB blocks of 16) over panels [p0, p1): the sums stay in the C tiles over all of
// K, and each panel's weights are prepared chunk by chunk as the products go, a step of the
// next unit's before each product step of this one's (interleaving any coarser measured slower).
template <class Source, int RB>
void resident(const Problem& pr, const Source& source, int64_t p0, int64_t p1, Pipeline& pipe, float* sums) {
  const int64_t chunks = (pr.k_pad + KC - 1) / KC, units = (p1 - p0) * chunks;
  source.prepare(p0, 0, 0, KC, pipe.bufs[0], pipe.order);
  for (int64_t i = 0; i < units; ++i) {
    const int64_t p = p0 + i / chunks, k0 = (i % chunks) * KC;
    const int64_t next_p = p0 + (i + 1) / chunks, next_k0 = ((i + 1) % chunks) * KC;
    const uint16_t* buf = source.chunk(p, k0, pipe.bufs[i & 1]);
    uint16_t* next = pipe.bufs[(i + 1) & 1];
    const int64_t steps = std::min(STEPS, (pr.k_pad - k0) / 32);
    if (k0 == 0) zero_sums<RB>();
    for (int64_t s = 0; s < STEPS; ++s) {
      if (i + 1 < units) source.prepare(next_p, next_k0, 32 * s, 32 * s + 32, next, pipe.order);
      if (s < steps) product_step<RB>(pr.rows, 0, k0 / 32 + s, buf + s * 3 * TILE_ELEMS);
    }
    if (k0 + KC >= pr.k_pad) {
      store_sums<RB>(sums);
      store_rows(pr, p, p + 1, 0, pr.m, sums, 0);
    }
  }
}

// Rows [r0, r1) in blocks of 32 over panels [p0, p1), k chunk by k chunk, each chunk's panels in
// turn (x's slice stays in L2 over the group); sums [p1 - p0][blocks * 32][PANEL] in between.
// The next unit's preparation is spread over the current one's product steps, a few input
// pairs at a time.
template <class Source>
void panel_group(const Problem& pr, const Source& source, int64_t r0, int64_t r1, int64_t p0, int64_t p1,
                 Pipeline& pipe, float* sums) {
  const int64_t blocks = (r1 - r0 + 31) / 32, panel_sums = blocks * 32 * PANEL, np = p1 - p0;
  const int64_t chunks = (pr.k_pad + KC - 1) / KC, units = chunks * np;
  source.prepare(p0, 0, 0, KC, pipe.bufs[0], pipe.order);
  for (int64_t i = 0; i < units; ++i) {
    const int64_t k0 = (i / np) * KC, p = p0 + i % np;
    const int64_t next_k0 = ((i + 1) / np) * KC, next_p = p0 + (i + 1) % np;
    const uint16_t* buf = source.chunk(p, k0, pipe.bufs[i & 1]);
    uint16_t* next = pipe.bufs[(i + 1) & 1];
    const int64_t steps = std::min(STEPS, (pr.k_pad - k0) / 32), total = blocks * steps;
    const int64_t due = i + 1 < units ? KC / 2 : 0;  // input pairs of the next unit
    int64_t done = 0, j = 0;
    float* ps = sums + (p - p0) * panel_sums;
    for (int64_t b = 0; b < blocks; ++b) {
      float* c = ps + b * 32 * PANEL;
      if (k0 == 0) zero_sums<2>();
      else load_sums<2>(c);
      for (int64_t s = 0; s < steps; ++s, ++j) {
        const int64_t target = (j + 1) * due / total;
        if (done < target) source.prepare(next_p, next_k0, 2 * done, 2 * target, next, pipe.order);
        done = target;
        product_step<2>(pr.rows, r0 / 16 + 2 * b, k0 / 32 + s, buf + s * 3 * TILE_ELEMS);
      }
      store_sums<2>(c);
    }
  }
  store_rows(pr, p0, p1, r0, r1 - r0, sums, blocks * 32);
}

template <typename T>
std::unique_ptr<T[]> aligned(int64_t count) {
  return std::unique_ptr<T[]>(new (std::align_val_t(64)) T[count]);
}

template <class Source>
void run(const Problem& pr, const Source& source) {
  if (pr.m <= 32) {
    at::parallel_for(0, pr.panels, 1, [&](int64_t begin, int64_t end) {
      auto bufs = aligned<uint16_t>(2 * BUF_ELEMS);
      Pipeline pipe{{bufs.get(), bufs.get() + BUF_ELEMS}, vnni_index()};
      alignas(64) float sums[32 * PANEL];
      if (pr.m <= 16) {
        configure_tiles<1>(static_cast<int>(pr.m));
        resident<Source, 1>(pr, source, begin, end, pipe, sums);
      } else {
        configure_tiles<2>(16);
        resident<Source, 2>(pr, source, begin, end, pipe, sums);
      }
      _tile_release();
    });
    return;
  }
  // Work items: (row chunk, group of panels); a group's sums fill about SCRATCH_BYTES.
  const int64_t chunks = (pr.m + ROW_CHUNK - 1) / ROW_CHUNK;
  const int64_t chunk_rows = ((pr.m + chunks - 1) / chunks + 31) / 32 * 32;
  const int64_t per_group = std::max<int64_t>(1, SCRATCH_BYTES / (chunk_rows * PANEL * 4));
  // Items in a multiple of the threads where there are panels enough (parallel_for hands each
  // thread one contiguous range of them), at the cost of reading x more often.
  const int64_t threads = at::get_num_threads();
  int64_t groups = (pr.panels + per_group - 1) / per_group;
  groups = std::min(pr.panels, (groups * chunks + threads - 1) / threads * threads / chunks);
  at::parallel_for(0, chunks * groups, 1, [&](int64_t begin, int64_t end) {
    configure_tiles<2>(16);
    auto bufs = aligned<uint16_t>(2 * BUF_ELEMS);
    Pipeline pipe{{bufs.get(), bufs.get() + BUF_ELEMS}, vnni_index()};
    auto sums = aligned<float>(((pr.panels + groups - 1) / groups) * chunk_rows * PANEL);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item / groups, g = item % groups;
      const int64_t r0 = c * chunk_rows, r1 = std::min(pr.m, r0 + chunk_rows);
      if (r0 < r1)
        panel_group<Source>(pr, source, r0, r1, g * pr.panels / groups, (g + 1) * pr.panels / groups, pipe,
                                   sums.get());
    }
    _tile_release();
  });
}

// The A tiles' source for x [m, K] bfloat16: x in place (up to 16 rows; a zero-padded copy when K
// is no multiple of 32, as tile loads read whole steps of 32 inputs) or blocked_rows' copy;
// `holder` keeps whichever tensor the tiles read alive.
inline Rows a_rows(const at::Tensor& x, int64_t k_pad, at::Tensor& holder) {
  const int64_t m = x.size(0), k_len = x.size(1);
  holder = x;
  if (m > 16) {
    holder = blocked_rows(x, k_pad, (m + 31) / 32 * 2);
    return Rows{reinterpret_cast<const uint16_t*>(holder.data_ptr()), 64, TILE_ELEMS, k_pad / 32 * TILE_ELEMS};
  }
  if (k_pad != k_len) {
    holder = at::zeros({m, k_pad}, x.options());
    holder.narrow(1, 0, k_len).copy_(x);
  }
  return Rows{reinterpret_cast<const uint16_t*>(holder.data_ptr()), holder.stride(0) * 2, 32, 16 * holder.stride(0)};
}

}  // namespace quiver_amx

#endif
