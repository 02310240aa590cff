// float8 KV caches (`--kv-cache-dtype fp8`, `fp8_e5m2`) on CPU: the two conversions a prefill
// makes per layer, one vectorised pass each.
//
// torch widens float8 e4m3fn at ~2 ns an element (a branchy scalar loop), which made an e4m3
// cache 7% slower end to end than a bfloat16 one although attention reads half the bytes: a
// prefill reads its new tokens' K/V as the cache holds them (`kv_cache_dtype.as_stored`) and a
// prompt's later chunks widen the earlier ones'. Here:
// - `float8_grid_(x, cache)`: x (float32, bfloat16 or float16) rounded in place to the values
//   a float8 cache holds, as torch's cast does (saturated at the largest finite value, then to
//   nearest, ties to even), so that the cast into the cache is then exact;
// - `widen_float8(cache, dtype)`: a float8 tensor in `dtype`, exactly (vec_load.h's widening).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "float8_grid.h"
#include "lane_convert.h"
#include "vec_load.h"

namespace {

using quiver_float8::Grid;
using quiver_float8::kE4m3;
using quiver_float8::kE5m2;
using quiver_float8::on_grid;

constexpr int64_t kGrain = 32768;

at::Tensor& float8_grid_(at::Tensor& x, at::ScalarType cache) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "x must be a contiguous CPU tensor");
  TORCH_CHECK(cache == at::kFloat8_e4m3fn || cache == at::kFloat8_e5m2, "the cache dtype must be float8, got ", cache);
  const Grid grid = cache == at::kFloat8_e4m3fn ? kE4m3 : kE5m2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "float8_grid_", [&] {
    scalar_t* data = x.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      _Pragma("omp simd")
      for (int64_t i = begin; i < end; ++i)
        data[i] = quiver::from_float<scalar_t>(on_grid(quiver::to_float(data[i]), grid));
    });
  });
  return x;
}

template <typename cache_t, typename out_t>
void widen(const cache_t* src, out_t* dst, int64_t begin, int64_t end) {
  using quiver_vec::VL;
  int64_t i = begin;
  alignas(64) float lanes[VL];
  for (; i + VL <= end; i += VL) {
    const quiver_vec::vfloat v = quiver_vec::load_float(src + i);
    if constexpr (std::is_same_v<out_t, float>) {
      quiver_vec::vstore(dst + i, v);
    } else {
      quiver_vec::vstore(lanes, v);
      for (int j = 0; j < VL; ++j) dst[i + j] = quiver::from_float<out_t>(lanes[j]);  // exact
    }
  }
  for (; i < end; ++i) dst[i] = quiver::from_float<out_t>(static_cast<float>(src[i]));
}

at::Tensor widen_float8(const at::Tensor& cache, at::ScalarType dtype) {
  TORCH_CHECK(cache.device().is_cpu() && cache.is_contiguous(), "cache must be a contiguous CPU tensor");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "float8 widens to float32, bfloat16 or float16, not ", dtype);
  auto out = at::empty(cache.sizes(), cache.options().dtype(dtype));
  auto run = [&](auto cache_tag) {
    using cache_t = decltype(cache_tag);
    const cache_t* src = static_cast<const cache_t*>(cache.data_ptr());
    at::parallel_for(0, cache.numel(), kGrain, [&](int64_t begin, int64_t end) {
      switch (dtype) {
        case at::kFloat: widen(src, out.data_ptr<float>(), begin, end); break;
        case at::kBFloat16: widen(src, out.data_ptr<at::BFloat16>(), begin, end); break;
        default: widen(src, out.data_ptr<at::Half>(), begin, end);
      }
    });
  };
  if (cache.scalar_type() == at::kFloat8_e4m3fn) run(c10::Float8_e4m3fn{});
  else if (cache.scalar_type() == at::kFloat8_e5m2) run(c10::Float8_e5m2{});
  else TORCH_CHECK(false, "cache must be float8 (e4m3fn or e5m2), got ", cache.scalar_type());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quiver_cpu, m) {
  m.def("float8_grid_(Tensor(a!) x, ScalarType cache) -> Tensor(a!)");
  m.def("widen_float8(Tensor cache, ScalarType dtype) -> Tensor");
  m.impl("float8_grid_", c10::DispatchKey::CPU, &float8_grid_);
  m.impl("widen_float8", c10::DispatchKey::CPU, &widen_float8);
}
