// The KV write of a CPU shard's attention layer: k and v [T, kv_heads, D] (any strides: views of
// the fused qkv projection) into their caches' flat slots, in the caches' dtype, in one call.
//
// The torch path (`layers/attention.write_kv`) is two index_copy_ calls, and for a float8 cache
// a clamp, a cast and two byte views more per tensor: at one stream, where a decode step is a
// few hundred small ops, each call's dispatch costs more than its copy. The conversion is the
// torch path's: bfloat16 and float16 round to nearest even, float8 saturates then rounds
// (float8_grid.h). A slot < 0 writes nothing (as the Triton write's padding rows).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "float8_grid.h"
#include "lane_convert.h"

namespace {

template <typename cache_t>
inline cache_t stored(float f) {
  if constexpr (std::is_same_v<cache_t, c10::Float8_e4m3fn>) {
    return c10::Float8_e4m3fn(quiver_float8::encode(quiver_float8::on_grid(f, quiver_float8::kE4m3),
                                                    quiver_float8::kE4m3),
                              c10::Float8_e4m3fn::from_bits());
  } else if constexpr (std::is_same_v<cache_t, c10::Float8_e5m2>) {
    return c10::Float8_e5m2(quiver_float8::encode(quiver_float8::on_grid(f, quiver_float8::kE5m2),
                                                  quiver_float8::kE5m2),
                            c10::Float8_e5m2::from_bits());
  } else {
    return quiver::from_float<cache_t>(f);
  }
}

template <typename in_t, typename cache_t>
void write_rows(at::Tensor& cache, const at::Tensor& x, const int64_t* slots) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t row = heads * dim;
  const in_t* src = x.data_ptr<in_t>();
  cache_t* dst = static_cast<cache_t*>(cache.data_ptr());
  const int64_t st = x.stride(0), sh = x.stride(1), sd = x.stride(2);
  at::parallel_for(0, tokens, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      cache_t* out = dst + slots[t] * row;
      for (int64_t h = 0; h < heads; ++h) {
        const in_t* in = src + t * st + h * sh;
        _Pragma("omp simd")
        for (int64_t d = 0; d < dim; ++d) {
          if constexpr (std::is_same_v<in_t, cache_t>) out[h * dim + d] = in[d * sd];  // a copy
          else out[h * dim + d] = stored<cache_t>(quiver::to_float(in[d * sd]));
        }
      }
    }
  });
}

void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "the caches must be contiguous CPU [blocks, block_size, kv_heads, D] tensors of one dtype");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == v.scalar_type() &&
                  k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "k and v must be [T, kv_heads, D] of one dtype, fitting the caches");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == k.size(0),
              "slot_mapping must be int64 [T]");
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(slot[t] < capacity, "slot_mapping[", t, "] = ", slot[t], " is past the cache's ", capacity, " slots");
  const auto cache_type = k_cache.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    auto run = [&](auto cache_tag) {
      using cache_t = decltype(cache_tag);
      write_rows<scalar_t, cache_t>(k_cache, k, slot);
      write_rows<scalar_t, cache_t>(v_cache, v, slot);
    };
    if (cache_type == k.scalar_type()) {
      run(scalar_t{});
    } else if (cache_type == at::kBFloat16) {
      run(c10::BFloat16{});
    } else if (cache_type == at::kFloat8_e4m3fn) {
      run(c10::Float8_e4m3fn{});
    } else if (cache_type == at::kFloat8_e5m2) {
      run(c10::Float8_e5m2{});
    } else {
      TORCH_CHECK(false, "the cache must be in k's dtype, bfloat16 or float8, got ", cache_type, " for ",
                  k.scalar_type());
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quiver_cpu, m) {
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, &write_kv);
}
