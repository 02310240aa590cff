// LoRA delta for decode rows on CPU (BGMV semantics), one parallel region per projection.
//
// For every row t whose slot s = token_slots[t] >= 0:
//   y[t, :] += scaling[s] * (lora_b[s] @ (lora_a[s] @ x[t]))
// with x [T, in], lora_a [S, R, in], lora_b [S, out, R], y [T, out] (rows may be strided: a
// column slice of a fused projection's output). lora_b may also be a transposed view of
// [S, R, out] storage, the layout CPU adapter slots use: the expand is then a vector sweep per
// rank instead of a horizontal sum per output, and padded ranks are skipped. The torch path needs a matmul pair per distinct
// adapter (dozens of small ops per projection with many adapters); here each row reads its
// adapter's A and B once and everything runs in one pass. Accumulation is float32; y gets one
// rounding. `kernels/lora_reference.py` defines the semantics and the tests hold this to it.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

namespace {

template <typename scalar_t>
void bgmv(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
          const at::Tensor& scaling, const at::Tensor& token_slots) {
  const int64_t rows = x.size(0), in = x.size(1), rank = lora_a.size(1), out = lora_b.size(1);
  const int64_t y_stride = y.stride(0);
  const scalar_t* x_data = x.data_ptr<scalar_t>();
  const scalar_t* a_data = lora_a.data_ptr<scalar_t>();
  const scalar_t* b_data = lora_b.data_ptr<scalar_t>();
  const float* scale_data = scaling.data_ptr<float>();
  const int32_t* slots = token_slots.data_ptr<int32_t>();
  scalar_t* y_data = y.data_ptr<scalar_t>();

  // lora_b as a transposed view of [S, R, out] storage (how CPU adapter slots hold it).
  const bool rank_major = lora_b.stride(1) == 1 && lora_b.stride(2) == out && lora_b.stride(0) == rank * out;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(in), h(rank), acc(rank_major ? out : 0);
    for (int64_t t = begin; t < end; ++t) {
      const int32_t slot = slots[t];
      if (slot < 0) continue;
      const scalar_t* x_row = x_data + t * in;
      for (int64_t i = 0; i < in; ++i) xf[i] = static_cast<float>(x_row[i]);
      const scalar_t* a = a_data + slot * rank * in;
      const float scale = scale_data[slot];
      for (int64_t r = 0; r < rank; ++r) {
        const scalar_t* a_row = a + r * in;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < in; ++i) dot += static_cast<float>(a_row[i]) * xf[i];
        h[r] = dot * scale;
      }
      scalar_t* y_row = y_data + t * y_stride;
      if (rank_major) {
        // B stored [S, R, out]: one multiply-add sweep over `out` per rank, in full vectors.
        // A rank row that is all zero (a slot's padding past its adapter's rank) gives h[r] == 0
        // exactly; its B row is zero too and is not read.
        std::fill(acc.begin(), acc.end(), 0.f);
        const scalar_t* b = b_data + slot * rank * out;
        for (int64_t r = 0; r < rank; ++r) {
          const float hr = h[r];
          if (hr == 0.f) continue;
          const scalar_t* b_row = b + r * out;
#pragma omp simd
          for (int64_t o = 0; o < out; ++o) acc[o] += hr * static_cast<float>(b_row[o]);
        }
        for (int64_t o = 0; o < out; ++o) y_row[o] = static_cast<scalar_t>(static_cast<float>(y_row[o]) + acc[o]);
        continue;
      }
      const scalar_t* b = b_data + slot * out * rank;
      for (int64_t o = 0; o < out; ++o) {
        const scalar_t* b_row = b + o * rank;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t r = 0; r < rank; ++r) dot += static_cast<float>(b_row[r]) * h[r];
        y_row[o] = static_cast<scalar_t>(static_cast<float>(y_row[o]) + dot);
      }
    }
  });
}

void lora_bgmv(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
               const at::Tensor& scaling, const at::Tensor& token_slots) {
  TORCH_CHECK(y.device().is_cpu() && x.device().is_cpu() && lora_a.device().is_cpu() &&
                  lora_b.device().is_cpu(),
              "lora_bgmv runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3,
              "x, y must be 2-D and the LoRA buffers 3-D");
  TORCH_CHECK(x.is_contiguous() && lora_a.is_contiguous() && y.stride(1) == 1,
              "x and lora_a must be contiguous, y's rows dense");
  TORCH_CHECK(lora_b.is_contiguous() || lora_b.transpose(1, 2).is_contiguous(),
              "lora_b must be contiguous [S, out, R] or a transposed view of contiguous [S, R, out]");
  TORCH_CHECK(y.size(0) == x.size(0) && lora_a.size(2) == x.size(1) && lora_b.size(1) == y.size(1) &&
                  lora_b.size(2) == lora_a.size(1) && lora_b.size(0) == lora_a.size(0),
              "shapes do not fit: y ", y.sizes(), ", x ", x.sizes(), ", A ", lora_a.sizes(), ", B ",
              lora_b.sizes());
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && x.scalar_type() == lora_a.scalar_type() &&
                  x.scalar_type() == lora_b.scalar_type(),
              "x, y and the LoRA buffers must share a dtype");
  TORCH_CHECK(scaling.scalar_type() == at::kFloat && scaling.is_contiguous() &&
                  scaling.numel() == lora_a.size(0),
              "scaling must be a contiguous float32 [slots]");
  TORCH_CHECK(token_slots.scalar_type() == at::kInt && token_slots.is_contiguous() &&
                  token_slots.numel() == x.size(0),
              "token_slots must be a contiguous int32 [T]");
  const int32_t* slots = token_slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < token_slots.numel(); ++t) {
    TORCH_CHECK(slots[t] < lora_a.size(0), "token_slots[", t, "] = ", slots[t], " is not a slot");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_bgmv", [&] {
    bgmv<scalar_t>(y, x, lora_a, lora_b, scaling, token_slots);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quiver_cpu, m) {
  m.def("lora_bgmv(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor scaling, "
        "Tensor token_slots) -> ()");
  m.impl("lora_bgmv", c10::DispatchKey::CPU, &lora_bgmv);
}
