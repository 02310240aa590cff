// Decode attention straight over the paged KV cache, for CPU shards.
//
// The torch path gathers every sequence's K/V blocks into a padded copy and runs SDPA on it:
// three passes over the keys (read, write, read) and a dozen small ops per layer. Here each
// sequence reads its keys and values once, in place, inside one parallel region.
// Semantics are those of `layers/attention.decode_attention` (its torch code is the reference):
//   out[s, j] = softmax_{i in window}(cap(q[s, j] . k[i, j / g] * scale)) @ v[i, j / g]
// over the keys 0 .. seq_lens[s] - 1 (the newest one included), restricted to the last `window`
// keys when window > 0; cap(x) = softcap * tanh(x / softcap) when softcap > 0 (Gemma 2's
// attention logit soft-capping), else x. Arithmetic is float32 whatever the cache dtype.
// The cache may be narrower than q (`--kv-cache-dtype`): bfloat16 under a float32 model, or
// float8 (e4m3 or e5m2) under any; its elements are widened to float32 as they are read.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "fast_exp.h"
#include "lane_convert.h"
#include "vec_load.h"

namespace {

// What both kernels read, and how they split the work: an item is one sequence and a run of its
// KV heads. A sequence is split over its heads only as far as the threads need work (few
// sequences, e.g. one long prompt's decode).
template <typename scalar_t, typename cache_t>
struct DecodeAttention {
  DecodeAttention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                  double softcap, at::Tensor& out)
      : num_seqs(q.size(0)), heads(q.size(1)), head_dim(q.size(2)), block_size(k_cache.size(1)),
        kv_heads(k_cache.size(2)), group(heads / kv_heads), table_width(block_tables.size(1)), window(window),
        q_data(q.data_ptr<scalar_t>()),
        k_data(static_cast<const cache_t*>(k_cache.data_ptr())), v_data(static_cast<const cache_t*>(v_cache.data_ptr())),
        tables(block_tables.data_ptr<int64_t>()), lens(seq_lens.data_ptr<int64_t>()),
        out_data(out.data_ptr<scalar_t>()), token_stride(kv_heads * head_dim),  // between offsets of one block
        block_stride(block_size * token_stride), scale_f(static_cast<float>(scale)), capped(softcap > 0),
        cap(static_cast<float>(softcap)), inverse_cap(capped ? 1.f / cap : 0.f) {
    // KV heads per item: all of them, unless that leaves fewer than 4 items per thread.
    const int64_t wanted_items = 4 * at::get_num_threads();
    const int64_t splits = std::min(kv_heads, std::max<int64_t>(1, (wanted_items + num_seqs - 1) / num_seqs));
    heads_per_item = (kv_heads + splits - 1) / splits;
    items_per_seq = (kv_heads + heads_per_item - 1) / heads_per_item;
  }

  void attend() const;
  template <int kHeadDim>
  void attend_in_registers() const;

  const int64_t num_seqs, heads, head_dim, block_size, kv_heads, group, table_width, window;
  const scalar_t* q_data;
  const cache_t* k_data;
  const cache_t* v_data;
  const int64_t* tables;
  const int64_t* lens;
  scalar_t* out_data;
  const int64_t token_stride, block_stride;
  const float scale_f;
  const bool capped;
  const float cap, inverse_cap;
  int64_t heads_per_item = 1, items_per_seq = 1;
};

// Any head size and dtype (`attend_in_registers` takes 64 and 128 in 16 and 32 bits). A work item
// walks the sequence's keys in position order, all of the item's heads at each position: a cache
// block stores a position's heads next to each other, so the item reads whole blocks front to
// back instead of 256-byte pieces 2 KiB apart, which the hardware prefetchers followed poorly.
template <typename scalar_t, typename cache_t>
void DecodeAttention<scalar_t, cache_t>::attend() const {
  at::parallel_for(0, num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, query, acc, maxima, totals;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / items_per_seq;
      const int64_t kv_first = item % items_per_seq * heads_per_item;
      const int64_t kv_count = std::min(heads_per_item, kv_heads - kv_first);
      const int64_t rows = kv_count * group;  // query heads of this item, kv_first * group onwards
      const int64_t len = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t count = len - first;
      scores.resize(rows * count);
      query.resize(rows * head_dim);
      acc.assign(rows * head_dim, 0.f);
      maxima.assign(rows, -std::numeric_limits<float>::infinity());
      totals.assign(rows, 0.f);
      const int64_t* table = tables + seq * table_width;
      const scalar_t* q_rows = q_data + (seq * heads + kv_first * group) * head_dim;
      for (int64_t i = 0; i < rows * head_dim; ++i) query[i] = static_cast<float>(q_rows[i]) * scale_f;
      // Visits the keys first .. len - 1 block by block: fn(index from first, the position's
      // row of the item's first KV head).
      auto for_each_key = [&](const cache_t* cache, auto&& fn) {
        for (int64_t block_start = first - first % block_size; block_start < len; block_start += block_size) {
          const cache_t* base = cache + table[block_start / block_size] * block_stride + kv_first * head_dim;
          const int64_t lo = std::max(first, block_start), hi = std::min(len, block_start + block_size);
          for (int64_t pos = lo; pos < hi; ++pos) fn(pos - first, base + (pos - block_start) * token_stride);
        }
      };
      for_each_key(k_data, [&](int64_t index, const cache_t* k_rows) {
        for (int64_t r = 0; r < rows; ++r) {
          const float* qf = query.data() + r * head_dim;
          const cache_t* k_row = k_rows + (r / group) * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qf[d] * static_cast<float>(k_row[d]);
          if (capped) dot = cap * std::tanh(dot * inverse_cap);
          scores[r * count + index] = dot;
          maxima[r] = std::max(maxima[r], dot);
        }
      });
      for (int64_t r = 0; r < rows; ++r) {
        float* sp = scores.data() + r * count;
        const float max_score = maxima[r];
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < count; ++i) {
          sp[i] = quiver::fast_exp(sp[i] - max_score);
          total += sp[i];
        }
        totals[r] = total;
      }
      for_each_key(v_data, [&](int64_t index, const cache_t* v_rows) {
        for (int64_t r = 0; r < rows; ++r) {
          const float weight = scores[r * count + index];
          const cache_t* v_row = v_rows + (r / group) * head_dim;
          float* af = acc.data() + r * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) af[d] += weight * static_cast<float>(v_row[d]);
        }
      });
      scalar_t* out_rows = out_data + (seq * heads + kv_first * group) * head_dim;
      for (int64_t r = 0; r < rows; ++r) {
        const float inverse = 1.f / totals[r];
        for (int64_t d = 0; d < head_dim; ++d)
          out_rows[r * head_dim + d] = static_cast<scalar_t>(acc[r * head_dim + d] * inverse);
      }
    }
  });
}

// The start of the next work item's keys (then values), asked for a slice at a time while this
// item computes: an item's own prefetching (the next block of its table) leaves the first blocks
// of every item waiting on memory. Bounded to kLookaheadLines: the item reads its own lines
// once per KV head, and asking for the whole next item evicted them where items are large.
// Measured in a served model's decode step (32 sequences, 2 cores), attention per layer:
//   bfloat16, 3 KV heads, 250 tokens: 656 us without, 569 with 64 KB, 567 with the whole item;
//   float32, 8 KV heads, 150 tokens: 1.27 ms without, 1.27 with 64 KB, 1.59 with 256 KB, 2.03
//   with the whole item.
template <typename cache_t>
class NextItemPrefetch {
 public:
  static constexpr int64_t kLookaheadLines = 1024;  // 64 KB
  // Lines of blocks [b0, b0 + blocks) of `table`, K then V, over `visits` calls of step().
  NextItemPrefetch(const cache_t* k, const cache_t* v, const int64_t* table, int64_t b0, int64_t blocks,
                   int64_t block_stride, int64_t visits)
      : k_(k), v_(v), table_(table + b0), lines_per_block_(block_stride * int64_t(sizeof(cache_t)) / 64),
        lines_(std::min<int64_t>(2 * blocks * lines_per_block_, kLookaheadLines)),
        per_visit_(visits > 0 ? (lines_ + visits - 1) / visits : 0), block_stride_(block_stride),
        cache_lines_(blocks * lines_per_block_) {}

  // Walks the lines with counters, not divisions: two 64-bit divisions a line were a quarter of
  // the kernel's time where the keys sit in cache.
  void step() {
    for (int64_t i = 0; i < per_visit_ && next_ < lines_; ++i, ++next_) {
      if (line_ == lines_per_block_) {
        line_ = 0;
        if (++block_ == blocks_) block_ = 0, cache_ = v_;
      }
      const char* block = reinterpret_cast<const char*>(cache_ + table_[block_] * block_stride_);
      __builtin_prefetch(block + line_++ * 64, 0, 2);  // into L2
    }
  }

 private:
  const cache_t* k_;
  const cache_t* v_;
  const int64_t* table_;
  const int64_t lines_per_block_, lines_, per_visit_, block_stride_, cache_lines_;
  const int64_t blocks_ = cache_lines_ / std::max<int64_t>(1, lines_per_block_);
  int64_t next_ = 0, block_ = 0, line_ = 0;
  const cache_t* cache_ = k_;
};

// The same attention for head sizes of 64 and 128 (nearly every model) in vector registers,
// 1.9x faster than `attend` on a 32-sequence decode. `attend` sums each query-key product lane by
// lane, a dependent chain of VL scalar adds per score (60% of its time), and keeps the weighted
// sum of values in memory. Here, per KV head and tile of up to kTile of its query heads, the
// tile's query rows stay in registers while each key is loaded once, each score is summed as a
// tree (hsum), the tile's outputs accumulate in registers over the values, and the next block of
// the table is prefetched (blocks lie anywhere in the cache; the hardware does not follow).
template <typename scalar_t, typename cache_t>
template <int kHeadDim>
void DecodeAttention<scalar_t, cache_t>::attend_in_registers() const {
  using quiver_vec::hsum;
  using quiver_vec::kLoadScale;
  using quiver_vec::load_float;
  using quiver_vec::load_scaled;
  using quiver_vec::vfloat;
  using quiver_vec::VL;
  constexpr int kChunks = kHeadDim / VL;
  constexpr int64_t kRowBytes = kHeadDim * sizeof(cache_t);
  // Registers: the tile's query (or output) rows, plus one key's (or value's) chunks.
  constexpr int kTile = std::max(1, std::min(4, (quiver_vec::kVecRegs - 2 * kChunks) / kChunks));
  // Keys and values are read as `load_scaled` gives them (float8 e4m3 at 2^-8 of its value): the
  // queries carry the factor into the scores, the normaliser takes it out of the outputs. Both
  // are powers of two, so every rounding stays where it was.
  const float query_scale = scale_f * kLoadScale<cache_t>;
#if defined(__AVX512BF16__)
  // bfloat16 queries over a bfloat16 cache: the scores' products in vdpbf16ps (attend_rows).
  constexpr bool kBf16Dots =
      std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16> && kHeadDim % 32 == 0;
#endif

  at::parallel_for(0, num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> widened(block_size * kHeadDim);  // one block's keys as float32
    alignas(64) float staged[kHeadDim];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / items_per_seq;
      const int64_t kv_first = item % items_per_seq * heads_per_item;
      const int64_t kv_count = std::min(heads_per_item, kv_heads - kv_first);
      const int64_t len = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t count = len - first;
      scores.resize(kTile * count);
      const int64_t* table = tables + seq * table_width;
      auto first_block = [&](int64_t length) {
        return (window > 0 ? std::max<int64_t>(0, length - window) : 0) / block_size;
      };
      const int64_t visits = 2 * kv_count * ((len - 1) / block_size + 1 - first_block(len));
      const int64_t next_seq = item + 1 < end ? (item + 1) / items_per_seq : seq;
      const int64_t next_b0 = first_block(lens[next_seq]);
      NextItemPrefetch<cache_t> next_item(k_data, v_data, tables + next_seq * table_width, next_b0,
                                          next_seq == seq ? 0 : (lens[next_seq] - 1) / block_size + 1 - next_b0,
                                          block_stride, visits);
      // Asks for a block's rows of KV head `kv` ahead of their use.
      auto prefetch_block = [&](const cache_t* cache, int64_t block_index, int64_t kv) {
        const char* rows = reinterpret_cast<const char*>(cache + table[block_index] * block_stride + kv * kHeadDim);
        for (int64_t pos = 0; pos < block_size; ++pos)
          for (int64_t line = 0; line < kRowBytes; line += 64)
            __builtin_prefetch(rows + pos * token_stride * sizeof(cache_t) + line);
      };
      // fn(index from first, the row of KV head `kv` at that position, n) for runs of n consecutive
      // keys (rows token_stride apart) covering first .. len - 1, one run per block, with the
      // next block on its way while one is read.
      auto for_each_run = [&](const cache_t* cache, int64_t kv, auto&& fn) {
        const int64_t last_block = (len - 1) / block_size;
        for (int64_t block_start = first - first % block_size; block_start < len; block_start += block_size) {
          const int64_t block_index = block_start / block_size;
          const cache_t* base = cache + table[block_index] * block_stride + kv * kHeadDim;
          const int64_t lo = std::max(first, block_start), hi = std::min(len, block_start + block_size);
          if (block_index < last_block) prefetch_block(cache, block_index + 1, kv);
          next_item.step();
          fn(lo - first, base + (lo - block_start) * token_stride, hi - lo);
        }
      };
      auto for_each_key = [&](const cache_t* cache, int64_t kv, auto&& fn) {
        for_each_run(cache, kv, [&](int64_t index, const cache_t* row, int64_t n) {
          for (int64_t j = 0; j < n; ++j) fn(index + j, row + j * token_stride);
        });
      };
      for (int64_t kv = kv_first; kv < kv_first + kv_count; ++kv) {
        for (int64_t g0 = 0; g0 < group; g0 += kTile) {
          const int64_t head0 = kv * group + g0;
          // kRows query heads from head0, kRows a constant so that their rows stay in registers.
          auto attend_rows = [&](auto rows_constant) {
            constexpr int kRows = decltype(rows_constant)::value;
            vfloat rows[kRows][kChunks];
            for (int t = 0; t < kRows; ++t) {
              const scalar_t* q_row = q_data + (seq * heads + head0 + t) * kHeadDim;
              for (int c = 0; c < kChunks; ++c) rows[t][c] = load_float(q_row + c * VL) * query_scale;
            }
            auto dot = [&](int t, const auto* k_row) {
              vfloat sum = rows[t][0] * load_scaled(k_row);
              for (int c = 1; c < kChunks; ++c) sum += rows[t][c] * load_scaled(k_row + c * VL);
              return sum;
            };
            // The scores of n keys from k_rows, `stride` elements apart, at index onwards: each
            // dot_fn(t, row)'s lanes summed, times `after` (1 where the query carries the scale).
            auto score_run = [&](auto&& dot_fn, float after, int64_t index, const auto* k_rows, int64_t stride,
                                 int64_t n) {
              int64_t j = 0;
#if defined(__AVX512F__)
              // Whole runs of 16 keys: their 16 dot products summed across lanes at once.
              for (; j + 16 <= n; j += 16) {
                for (int t = 0; t < kRows; ++t) {
                  vfloat dots[16];
                  for (int i = 0; i < 16; ++i) dots[i] = dot_fn(t, k_rows + (j + i) * stride);
                  quiver_vec::vstore(scores.data() + t * count + index + j, quiver_vec::lane_sums(dots) * after);
                }
              }
#endif
              for (; j < n; ++j) {
                const auto* k_row = k_rows + j * stride;
                for (int t = 0; t < kRows; ++t) scores[t * count + index + j] = hsum(dot_fn(t, k_row)) * after;
              }
            };
#if defined(__AVX512BF16__)
            if constexpr (kBf16Dots) {
              // q . k as bfloat16 pairs (vdpbf16ps: each product exact in float32, as the widened
              // product is), straight from the cache with nothing widened; the scale goes on the
              // score instead of the query, which q in bfloat16 cannot carry.
              constexpr int kPairs = kHeadDim / 32;
              __m512bh q_pairs[kRows][kPairs];
              for (int t = 0; t < kRows; ++t)
                for (int c = 0; c < kPairs; ++c)
                  q_pairs[t][c] =
                      (__m512bh)_mm512_loadu_si512(q_data + (seq * heads + head0 + t) * kHeadDim + 32 * c);
              auto pair_dot = [&](int t, const cache_t* k_row) {
                __m512 sum = _mm512_setzero_ps();
                for (int c = 0; c < kPairs; ++c)
                  sum = _mm512_dpbf16_ps(sum, q_pairs[t][c], (__m512bh)_mm512_loadu_si512(k_row + 32 * c));
                return (vfloat)sum;
              };
              for_each_run(k_data, kv, [&](int64_t index, const cache_t* k_rows, int64_t n) {
                score_run(pair_dot, query_scale, index, k_rows, token_stride, n);
              });
            } else
#endif
            for_each_run(k_data, kv, [&](int64_t index, const cache_t* k_rows, int64_t n) {
              if constexpr (kRows > 1 && !std::is_same_v<cache_t, float>) {
                // Each key widened once, into L1, rather than once per query row: the rows read
                // float32 back (float8's widening is five instructions a vector, bfloat16's two).
                for (int64_t j = 0; j < n; ++j)
                  for (int c = 0; c < kChunks; ++c)
                    quiver_vec::vstore(widened.data() + j * kHeadDim + c * VL,
                                       load_scaled(k_rows + j * token_stride + c * VL));
                score_run(dot, 1.f, index, widened.data(), int64_t{kHeadDim}, n);
              } else {
                score_run(dot, 1.f, index, k_rows, token_stride, n);
              }
            });
            float inverse[kRows];
            for (int t = 0; t < kRows; ++t) {
              float* sp = scores.data() + t * count;
              if (capped)
                for (int64_t i = 0; i < count; ++i) sp[i] = cap * std::tanh(sp[i] * inverse_cap);
              // The maximum a vector at a time (GCC left the `omp simd` max loop scalar).
              vfloat maxima = quiver_vec::vfloat{} - std::numeric_limits<float>::infinity();
              int64_t i = 0;
              for (; i + VL <= count; i += VL) {
                const vfloat v = quiver_vec::vload(sp + i);
                maxima = v > maxima ? v : maxima;
              }
              float max_score = -std::numeric_limits<float>::infinity();
              for (int l = 0; l < VL; ++l) max_score = std::max(max_score, maxima[l]);
              for (; i < count; ++i) max_score = std::max(max_score, sp[i]);
              float total = 0.f;
#pragma omp simd reduction(+ : total)
              for (int64_t i = 0; i < count; ++i) {
                sp[i] = quiver::fast_exp(sp[i] - max_score);
                total += sp[i];
              }
              inverse[t] = kLoadScale<cache_t> / total;
            }
            for (int t = 0; t < kRows; ++t)
              for (int c = 0; c < kChunks; ++c) rows[t][c] = vfloat{};
            for_each_key(v_data, kv, [&](int64_t index, const cache_t* v_row) {
              vfloat value[kChunks];
              for (int c = 0; c < kChunks; ++c) value[c] = load_scaled(v_row + c * VL);
              for (int t = 0; t < kRows; ++t) {
                const float weight = scores[t * count + index];
                for (int c = 0; c < kChunks; ++c) rows[t][c] += weight * value[c];
              }
            });
            for (int t = 0; t < kRows; ++t) {
              for (int c = 0; c < kChunks; ++c) quiver_vec::vstore(staged + c * VL, rows[t][c] * inverse[t]);
              scalar_t* out_row = out_data + (seq * heads + head0 + t) * kHeadDim;
              for (int64_t d = 0; d < kHeadDim; ++d) out_row[d] = quiver::from_float<scalar_t>(staged[d]);
            }
          };
          switch (std::min<int64_t>(kTile, group - g0)) {
            case 1: attend_rows(std::integral_constant<int, 1>{}); break;
            case 2: if constexpr (kTile >= 2) attend_rows(std::integral_constant<int, 2>{}); break;
            case 3: if constexpr (kTile >= 3) attend_rows(std::integral_constant<int, 3>{}); break;
            default: if constexpr (kTile >= 4) attend_rows(std::integral_constant<int, 4>{});
          }
        }
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window,
                                  double softcap) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q must be [B, heads, d] and the caches [blocks, block_size, kv_heads, d]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q and the caches must be contiguous");
  const auto cache_type = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == cache_type, "the K and V caches must share a dtype");
  TORCH_CHECK(cache_type == q.scalar_type() ||
                  (q.scalar_type() != at::kDouble &&
                   (cache_type == at::kBFloat16 || cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2)),
              "the cache must be in q's dtype, bfloat16 or float8 (e4m3fn, e5m2), got ", cache_type, " under ",
              q.scalar_type());
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "head_dim differs, or heads is not a multiple of kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  seq_lens.numel() == q.size(0),
              "block_tables must be [B, nb] and seq_lens [B], both int64");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t max_len = tables.size(1) * k_cache.size(1);
  const int64_t* len_data = lens.data_ptr<int64_t>();
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0);
  for (int64_t s = 0; s < lens.numel(); ++s) {
    TORCH_CHECK(len_data[s] >= 1 && len_data[s] <= max_len,
                "seq_lens[", s, "] = ", len_data[s], " is outside [1, ", max_len, "]");
    for (int64_t b = 0; b < (len_data[s] + block_size - 1) / block_size; ++b) {
      const int64_t block = table_data[s * tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", s, ", ", b, "] = ", block,
                  " is not a block of the cache");
    }
  }
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto cache_tag) {
      using cache_t = decltype(cache_tag);
      const DecodeAttention<scalar_t, cache_t> attention(q, k_cache, v_cache, tables, lens, scale, window, softcap,
                                                         out);
      if constexpr (std::is_same_v<scalar_t, double>) {
        attention.attend();
      } else {
        switch (q.size(2)) {
          case 64: attention.template attend_in_registers<64>(); break;
          case 128: attention.template attend_in_registers<128>(); break;
          default: attention.attend();
        }
      }
    };
    if (cache_type == q.scalar_type()) {
      run(scalar_t{});
    } else if constexpr (!std::is_same_v<scalar_t, double>) {
      switch (cache_type) {
        case at::kBFloat16: run(c10::BFloat16{}); break;
        case at::kFloat8_e4m3fn: run(c10::Float8_e4m3fn{}); break;
        default: run(c10::Float8_e5m2{});
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quiver_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window, float softcap) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
