// Decode attention straight over the paged KV cache, for CPU shards.
//
// The torch path gathers every sequence's K/V blocks into a padded copy and runs SDPA on it:
// three passes over the keys (read, write, read) and a dozen small ops per layer. Here each
// (sequence, KV head) pair reads its keys and values once, in place, inside one parallel region.
// Semantics are those of `layers/attention.decode_attention` (its torch code is the reference):
//   out[s, j] = softmax_{i in window}(q[s, j] . k[i, j / g] * scale) @ v[i, j / g]
// over the keys 0 .. seq_lens[s] - 1 (the newest one included), restricted to the last `window`
// keys when window > 0. Arithmetic is float32 whatever the cache dtype.

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
template <typename scalar_t, int kHeadDim>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
            int64_t window, at::Tensor& out) {
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

  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, query(head_dim), acc(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / kv_heads, kv_head = item % kv_heads;
      const int64_t len = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      scores.resize(len - first);
      const int64_t* table = tables + seq * table_width;
      // Visits the keys first .. len - 1 block by block: fn(position, row of that key).
      auto for_each_key = [&](const scalar_t* cache, auto&& fn) {
        for (int64_t block_start = first - first % block_size; block_start < len; block_start += block_size) {
          const scalar_t* base = cache + table[block_start / block_size] * block_stride + kv_head * head_dim;
          const int64_t lo = std::max(first, block_start), hi = std::min(len, block_start + block_size);
          for (int64_t pos = lo; pos < hi; ++pos) fn(pos, base + (pos - block_start) * token_stride);
        }
      };
      for (int64_t j = 0; j < group; ++j) {
        const int64_t head = kv_head * group + j;
        const scalar_t* q_row = q_data + (seq * heads + head) * head_dim;
        float* qf = query.data();
        for (int64_t d = 0; d < head_dim; ++d) qf[d] = static_cast<float>(q_row[d]) * scale_f;
        float max_score = -std::numeric_limits<float>::infinity();
        for_each_key(k_data, [&](int64_t pos, const scalar_t* k_row) {
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qf[d] * static_cast<float>(k_row[d]);
          scores[pos - first] = dot;
          max_score = std::max(max_score, dot);
        });
        float total = 0.f;
        float* sp = scores.data();
        const int64_t count = static_cast<int64_t>(scores.size());
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < count; ++i) {
          sp[i] = quiver::fast_exp(sp[i] - max_score);
          total += sp[i];
        }
        float* af = acc.data();
        std::fill(af, af + head_dim, 0.f);
        for_each_key(v_data, [&](int64_t pos, const scalar_t* v_row) {
          const float weight = scores[pos - first];
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) af[d] += weight * static_cast<float>(v_row[d]);
        });
        scalar_t* out_row = out_data + (seq * heads + head) * head_dim;
        const float inverse = 1.f / total;
        for (int64_t d = 0; d < head_dim; ++d) out_row[d] = static_cast<scalar_t>(af[d] * inverse);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q must be [B, heads, d] and the caches [blocks, block_size, kv_heads, d]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q and the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
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
      case 64: attend<scalar_t, 64>(q, k_cache, v_cache, tables, lens, scale, window, out); break;
      case 128: attend<scalar_t, 128>(q, k_cache, v_cache, tables, lens, scale, window, out); break;
      default: attend<scalar_t, 0>(q, k_cache, v_cache, tables, lens, scale, window, out);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quiver_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
