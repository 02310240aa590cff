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

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "fast_exp.h"

namespace {

// kHeadDim > 0 fixes head_dim at compile time (the common sizes), so the per-key loops unroll
// and vectorise fully; 0 reads it at run time.
//
// A work item is one sequence and a run of its KV heads, and walks the sequence's keys in
// position order, all of the item's heads at each position: a cache block stores a position's
// heads next to each other, so the item reads whole blocks front to back (one 32 KiB stream per
// block for the benchmark model) instead of 256-byte pieces 2 KiB apart, which the hardware
// prefetchers followed poorly. A sequence is split over its heads only as far as the threads
// need work (few sequences, e.g. one long prompt's decode).
template <typename scalar_t, int kHeadDim>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
            int64_t window, double softcap, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), heads = q.size(1);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, table_width = block_tables.size(1);
  const scalar_t* q_data = q.data_ptr<scalar_t>();
  const scalar_t* k_data = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_data = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* out_data = out.data_ptr<scalar_t>();
  const int64_t token_stride = kv_heads * head_dim;  // between offsets of one block
  const int64_t block_stride = block_size * token_stride;
  const float scale_f = static_cast<float>(scale);
  const bool capped = softcap > 0;
  const float cap = static_cast<float>(softcap), inverse_cap = capped ? 1.f / cap : 0.f;
  // KV heads per item: all of them, unless that leaves fewer than 4 items per thread.
  const int64_t wanted_items = 4 * at::get_num_threads();
  const int64_t splits = std::min(kv_heads, std::max<int64_t>(1, (wanted_items + num_seqs - 1) / num_seqs));
  const int64_t heads_per_item = (kv_heads + splits - 1) / splits;
  const int64_t items_per_seq = (kv_heads + heads_per_item - 1) / heads_per_item;

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
      auto for_each_key = [&](const scalar_t* cache, auto&& fn) {
        for (int64_t block_start = first - first % block_size; block_start < len; block_start += block_size) {
          const scalar_t* base = cache + table[block_start / block_size] * block_stride + kv_first * head_dim;
          const int64_t lo = std::max(first, block_start), hi = std::min(len, block_start + block_size);
          for (int64_t pos = lo; pos < hi; ++pos) fn(pos - first, base + (pos - block_start) * token_stride);
        }
      };
      for_each_key(k_data, [&](int64_t index, const scalar_t* k_rows) {
        for (int64_t r = 0; r < rows; ++r) {
          const float* qf = query.data() + r * head_dim;
          const scalar_t* k_row = k_rows + (r / group) * head_dim;
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
      for_each_key(v_data, [&](int64_t index, const scalar_t* v_rows) {
        for (int64_t r = 0; r < rows; ++r) {
          const float weight = scores[r * count + index];
          const scalar_t* v_row = v_rows + (r / group) * head_dim;
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
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
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
    switch (q.size(2)) {
      case 64: attend<scalar_t, 64>(q, k_cache, v_cache, tables, lens, scale, window, softcap, out); break;
      case 128: attend<scalar_t, 128>(q, k_cache, v_cache, tables, lens, scale, window, softcap, out); break;
      default: attend<scalar_t, 0>(q, k_cache, v_cache, tables, lens, scale, window, softcap, out);
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
