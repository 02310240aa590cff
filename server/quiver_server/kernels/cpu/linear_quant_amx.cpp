// Weight-only int8/int4 projections with bfloat16 activations on AMX (tdpbf16ps):
// y = x dequant(W)^T (+ bias), x and y bfloat16, sums in float32.
//
// The weight is the one linear_quant.cpp reads, packed once by kernels/quant_gemm.py (so a
// model holds one copy whichever kernel runs): column panels of PANEL = 48 columns (the AVX-512
// build's; every AMX host has AVX-512), k-major, scales and offsets [P, G, PANEL]. A panel is 3
// AMX B tiles of 16 columns.
//
// Per panel and chunk of KC = 256 inputs, the weights are dequantized once per call into a 24 KB
// bf16 buffer in the B tiles' VNNI layout (tile row r: inputs 2r and 2r + 1 of each of 16
// columns, interleaved), which stays in L1 while the row blocks use it. Each weight is
// bf16(q * scale + offset), product and sum rounded in float32, then to bf16 (to nearest even):
// the weight a bf16 model dequantizes to (QuantizedWeight.dequantize(torch.bfloat16)). The
// dequantization costs ~10 vector instructions per 32 weights whatever the rows, where the
// float32 FMA kernel spends 2 FMAs per row on them: that kernel wins at 1-2 rows, this one from
// a few rows on (quant_gemm dispatches by rows), and the tile unit makes prefill-sized products
// about as fast as oneDNN's bf16 ones on the dequantized weight.
//
// Up to 32 rows: each panel's sums stay in the C tiles over all of K: 16 rows in 3 C tiles (1 A,
// 3 B), 32 rows in 6 (the A and B tiles reloaded as the 6 products go round, 8 tiles in all).
// More rows: blocks of 32 rows over a group of panels, k chunk by k chunk, so x's slice stays in
// L2 over the group while a chunk's weights stay in L1 over the rows; the sums go to a float32
// scratch between chunks. The dequantization of the next chunk goes into a second buffer,
// interleaved with the products of this one (vector ports and tile unit in parallel, as far as
// the stores let the tile loads go).
//
// Everything AMX is compiled only where the compiler targets AMX-BF16 and AVX512-BF16
// (-march=native on Sapphire Rapids and later). GCC keeps AMX enabled under -mno-avx512f
// (QUIVER_CPU_ISA=avx2), so AVX512-BF16 is what tells the AVX2 build apart; there the ops are a
// stub and quant_gemm uses linear_quant.cpp. Linux also needs the process to ask for the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM) once; if it refuses, the op reports unavailable.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "quant_packed.h"
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
#endif

namespace {

#if defined(QUIVER_AMX)

// linear_quant.cpp's panel width on AVX-512 (3 vectors of 16); the op checks q's last dim.
constexpr int64_t PANEL = 3 * quiver_vec::VL;
static_assert(PANEL == 48, "the tile code below is written for 3 B tiles per panel");
constexpr int64_t KC = 256;                   // inputs per chunk: 24 KB of dequantized weights, in L1
constexpr int64_t STEPS = KC / 32;            // tile products per chunk, row block and B tile
constexpr int64_t TILE_ELEMS = 16 * 32;       // bf16 per A or B tile
constexpr int64_t BUF_ELEMS = STEPS * 3 * TILE_ELEMS;
constexpr int64_t ROW_CHUNK = 512;            // rows per work item (a multiple of 32)
constexpr int64_t SCRATCH_BYTES = 512 << 10;  // float32 sums of a panel group, in L2

bool amx_ready() {
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
void configure_tiles(int rows) {
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

struct Weights {
  const uint8_t* q;       // [P, K or K / 2, PANEL]
  const float* scales;    // [P, G, PANEL]
  const float* offsets;   // same, or null
  int64_t k_len, group, groups;
};

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
  Weights w;
  Rows rows;
  int64_t m, k_pad, n, panels;
  const float* bias;   // padded to panels * PANEL, or null
  at::BFloat16* y;
};

// x as [blocks][k_pad / 32][16][32], zero-padded to `blocks` blocks of 16 rows: an A tile is 1 KB
// in a row, where 16 rows of a K = 2048 x would sit 4 KB apart, all in one L1 set.
at::Tensor blocked_rows(const at::Tensor& x, int64_t k_pad, int64_t blocks) {
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
void store_rows(const Problem& pr, int64_t p0, int64_t p1, int64_t r0, int64_t count, const float* sums,
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

// A thread's work is a sequence of units, each one panel's chunk of KC inputs: its weights are
// dequantized into one of two buffers, interleaved with the tile products of the previous unit,
// which read the other. The vector ports and the tile unit then work in parallel as far as the
// dequantization's stores let the tile loads go (measured: 7-20% less time than dequantizing
// and multiplying in turn), and a tile load never reads lines just stored (which stalls it).
struct Pipeline {
  uint16_t* bufs[2];
  __m512i order;
};

// Up to 32 rows (RB blocks of 16) over panels [p0, p1): the sums stay in the C tiles over all of
// K, and each panel's weights are dequantized chunk by chunk as the products go, a step of the
// next unit's before each product step of this one's (interleaving any coarser measured slower).
template <int BITS, bool OFFSETS, int RB>
void resident(const Problem& pr, int64_t p0, int64_t p1, Pipeline& pipe, float* sums) {
  const int64_t chunks = (pr.k_pad + KC - 1) / KC, units = (p1 - p0) * chunks;
  dequantize<BITS, OFFSETS>(pr.w, p0, 0, 0, KC, pipe.bufs[0], pipe.order);
  for (int64_t i = 0; i < units; ++i) {
    const int64_t p = p0 + i / chunks, k0 = (i % chunks) * KC;
    const int64_t next_p = p0 + (i + 1) / chunks, next_k0 = ((i + 1) % chunks) * KC;
    const uint16_t* buf = pipe.bufs[i & 1];
    uint16_t* next = pipe.bufs[(i + 1) & 1];
    const int64_t steps = std::min(STEPS, (pr.k_pad - k0) / 32);
    if (k0 == 0) zero_sums<RB>();
    for (int64_t s = 0; s < STEPS; ++s) {
      if (i + 1 < units) dequantize<BITS, OFFSETS>(pr.w, next_p, next_k0, 32 * s, 32 * s + 32, next, pipe.order);
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
// The next unit's dequantization is spread over the current one's product steps, a few input
// pairs at a time.
template <int BITS, bool OFFSETS>
void panel_group(const Problem& pr, int64_t r0, int64_t r1, int64_t p0, int64_t p1, Pipeline& pipe, float* sums) {
  const int64_t blocks = (r1 - r0 + 31) / 32, panel_sums = blocks * 32 * PANEL, np = p1 - p0;
  const int64_t chunks = (pr.k_pad + KC - 1) / KC, units = chunks * np;
  dequantize<BITS, OFFSETS>(pr.w, p0, 0, 0, KC, pipe.bufs[0], pipe.order);
  for (int64_t i = 0; i < units; ++i) {
    const int64_t k0 = (i / np) * KC, p = p0 + i % np;
    const int64_t next_k0 = ((i + 1) / np) * KC, next_p = p0 + (i + 1) % np;
    const uint16_t* buf = pipe.bufs[i & 1];
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
        if (done < target) dequantize<BITS, OFFSETS>(pr.w, next_p, next_k0, 2 * done, 2 * target, next, pipe.order);
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

template <int BITS, bool OFFSETS>
void run(const Problem& pr) {
  if (pr.m <= 32) {
    at::parallel_for(0, pr.panels, 1, [&](int64_t begin, int64_t end) {
      auto bufs = aligned<uint16_t>(2 * BUF_ELEMS);
      Pipeline pipe{{bufs.get(), bufs.get() + BUF_ELEMS}, vnni_index()};
      alignas(64) float sums[32 * PANEL];
      if (pr.m <= 16) {
        configure_tiles<1>(static_cast<int>(pr.m));
        resident<BITS, OFFSETS, 1>(pr, begin, end, pipe, sums);
      } else {
        configure_tiles<2>(16);
        resident<BITS, OFFSETS, 2>(pr, begin, end, pipe, sums);
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
        panel_group<BITS, OFFSETS>(pr, r0, r1, g * pr.panels / groups, (g + 1) * pr.panels / groups, pipe,
                                   sums.get());
    }
    _tile_release();
  });
}

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
  // Tile loads read x in whole steps of 32 inputs: up to 16 rows are read in place (the tiles
  // configured to their count) unless K is no multiple of 32; more go through a blocked copy.
  const int64_t k_pad = (k_len + 31) / 32 * 32;
  at::Tensor xs = x;
  Rows rows;
  if (m > 16) {
    xs = blocked_rows(x, k_pad, (m + 31) / 32 * 2);
    rows = Rows{reinterpret_cast<const uint16_t*>(xs.data_ptr()), 64, TILE_ELEMS, k_pad / 32 * TILE_ELEMS};
  } else {
    if (k_pad != k_len) {
      xs = at::zeros({m, k_pad}, x.options());
      xs.narrow(1, 0, k_len).copy_(x);
    }
    rows = Rows{reinterpret_cast<const uint16_t*>(xs.data_ptr()), xs.stride(0) * 2, 32, 16 * xs.stride(0)};
  }
  Problem pr{Weights{static_cast<const uint8_t*>(q.data_ptr()), scales.data_ptr<float>(),
                     has_offsets ? offsets->data_ptr<float>() : nullptr, k_len, group, k_len / group},
             rows, m, k_pad, n, panels, b.empty() ? nullptr : b.data(), y.data_ptr<at::BFloat16>()};
  if (bits == 8) {
    if (has_offsets) run<8, true>(pr);
    else run<8, false>(pr);
  } else {
    if (has_offsets) run<4, true>(pr);
    else run<4, false>(pr);
  }
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
