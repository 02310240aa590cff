// Fused row-wise ops of the Llama block for CPU shards: RMS norm, SiLU-and-multiply, rotary.
//
// In torch each is 3-6 ops, every one a full pass over [tokens, width] with its own temporary
// (and its own OpenMP region); on a long prefill they cost as much memory traffic as a matmul.
// Here each is one pass, parallel over tokens, with the arithmetic of the torch code it replaces
// (`layers/norm.py`, `models/llama.py` MLP, `layers/rotary.py`), which stays the reference:
// float32 statistics for the norm, the same multiply/add order for the rotation.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "fast_exp.h"
#include "flush_denormals.h"
#include "lane_convert.h"

namespace {

// Rows per task: about 32K elements, as torch's own elementwise grain. A decode step's few rows
// then run on the calling thread: waking the other threads would cost more than the work, and
// every parallel region is one more barrier where a thread descheduled by a neighbouring process
// (the router, a client on a small box) holds up the rest.
int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width)); }

// weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), as transformers' LlamaRMSNorm.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x must be a CPU [T, D] with dense rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [D] of x's dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t rows = x.size(0), dim = x.size(1), stride = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xd = x.data_ptr<scalar_t>();
    const scalar_t* wd = weight.data_ptr<scalar_t>();
    scalar_t* od = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = xd + t * stride;
        float squares = 0.f;
        _Pragma("omp simd reduction(+ : squares)")
        for (int64_t d = 0; d < dim; ++d) {
          const float v = quiver::to_float(row[d]);
          squares += v * v;
        }
        const float inverse = 1.f / std::sqrt(squares / static_cast<float>(dim) + static_cast<float>(eps));
        scalar_t* o = od + t * dim;
        _Pragma("omp simd")
        for (int64_t d = 0; d < dim; ++d) {
          const float normed = quiver::round_to<scalar_t>(quiver::to_float(row[d]) * inverse);
          o[d] = quiver::from_float<scalar_t>(quiver::to_float(wd[d]) * normed);
        }
      }
    });
  });
  return out;
}

// silu(gate) * up for gate_up = [gate | up] ([T, 2I]) -> [T, I].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 2 == 0,
              "gate_up must be a CPU [T, 2I] with dense rows");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = at::empty({rows, width}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* od = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(2 * width), [&](int64_t begin, int64_t end) {
      const quiver::FlushDenormals flush;
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* gate = in + t * stride;
        const scalar_t* up = gate + width;
        scalar_t* o = od + t * width;
        _Pragma("omp simd")
        for (int64_t i = 0; i < width; ++i) {
          const float g = quiver::to_float(gate[i]);
          const float activated = quiver::round_to<scalar_t>(g / (1.f + quiver::fast_exp(-g)));
          o[i] = quiver::from_float<scalar_t>(activated * quiver::to_float(up[i]));
        }
      }
    });
  });
  return out;
}

// In place on x [T, H, D] (any row and head strides, dense last dim), half-split rotation:
//   x[:half] = x1 * cos + (-x2) * sin,  x[half:] = x2 * cos + x1 * sin   (cos, sin [T, D]).
void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x must be a CPU [T, heads, D] with a dense, even last dim");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2) && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin must be contiguous [T, D] of x's dtype");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    scalar_t* xd = x.data_ptr<scalar_t>();
    const scalar_t* cd = cos.data_ptr<scalar_t>();
    const scalar_t* sd = sin.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(heads * dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cd + t * dim;
        const scalar_t* s = sd + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* v = xd + t * row_stride + h * head_stride;
          _Pragma("omp simd")
          for (int64_t i = 0; i < half; ++i) {
            // Each product rounded to the dtype, then the sum: torch's x * cos + rotated * sin.
            const float x1 = quiver::to_float(v[i]), x2 = quiver::to_float(v[i + half]);
            const float a = quiver::round_to<scalar_t>(x1 * quiver::to_float(c[i]));
            const float b = quiver::round_to<scalar_t>(-x2 * quiver::to_float(s[i]));
            const float e = quiver::round_to<scalar_t>(x2 * quiver::to_float(c[i + half]));
            const float f = quiver::round_to<scalar_t>(x1 * quiver::to_float(s[i + half]));
            v[i] = quiver::from_float<scalar_t>(a + b);
            v[i + half] = quiver::from_float<scalar_t>(e + f);
          }
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quiver_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.impl("rotary_", c10::DispatchKey::CPU, &rotary_);
}
