// Checks shared by the quantized-matmul ops (linear_quant.cpp, linear_quant_amx.cpp; the scales
// and offsets also linear_int8_dot.cpp's), which read the same packed weight: values
// [P, K or K / 2, panel] (int8, or two 4-bit values a byte), scales and offsets
// [P, K / group, panel] float32, and a bias of the outputs padded to panels.
#pragma once

#include <ATen/ATen.h>

#include <cstring>
#include <type_traits>
#include <vector>

namespace quiver_quant {

// Scales and offsets (if any) as the panels hold them: contiguous float32 [panels, groups, panel].
inline void check_params(const at::Tensor& scales, const c10::optional<at::Tensor>& offsets, int64_t groups,
                         int64_t panels, int64_t panel) {
  const std::vector<int64_t> params{panels, groups, panel};
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.sizes() == params,
              "scales must be a contiguous float32 ", at::IntArrayRef(params));
  if (offsets.has_value())
    TORCH_CHECK(offsets->scalar_type() == at::kFloat && offsets->is_contiguous() && offsets->sizes() == params,
                "offsets must be a contiguous float32 ", at::IntArrayRef(params));
}

// The number of panels, once q, scales and offsets are checked against k_len inputs and n outputs.
inline int64_t check_packed(const at::Tensor& q, const at::Tensor& scales, const c10::optional<at::Tensor>& offsets,
                            int64_t k_len, int64_t n, int64_t bits, int64_t group, int64_t panel) {
  TORCH_CHECK(q.device().is_cpu(), "the quantized matmuls run on CPU tensors");
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  const int64_t panels = (n + panel - 1) / panel;
  TORCH_CHECK(n > 0 && group > 0 && k_len % group == 0 && group % 2 == 0, "group ", group, " does not fit ", k_len,
              " inputs (even groups dividing them)");
  TORCH_CHECK(q.scalar_type() == (bits == 8 ? at::kChar : at::kByte) && q.is_contiguous() && q.dim() == 3 &&
                  q.size(0) == panels && q.size(1) == (bits == 8 ? k_len : k_len / 2) && q.size(2) == panel,
              "packed values ", q.sizes(), " do not fit ", k_len, " inputs and ", n, " outputs");
  check_params(scales, offsets, k_len / group, panels, panel);
  return panels;
}

// The bias in float32, zero-padded to whole panels (the kernels add full vectors); empty if none.
inline std::vector<float> padded_bias(const c10::optional<at::Tensor>& bias, int64_t n, int64_t panels,
                                      int64_t panel) {
  std::vector<float> out;
  if (!bias.has_value()) return out;
  TORCH_CHECK(bias->dim() == 1 && bias->numel() == n, "bias must be [", n, "]");
  const at::Tensor fb = bias->to(at::kFloat).contiguous();
  out.assign(panels * panel, 0.f);
  std::memcpy(out.data(), fb.data_ptr<float>(), n * sizeof(float));
  return out;
}

// f(integral_constant<int, BITS>, bool_constant<OFFSETS>) for the packed format, so each kernel
// picks its template instance (8- or 4-bit values, with or without offsets) in one place.
template <typename F>
inline void with_format(int64_t bits, bool has_offsets, F&& f) {
  if (bits == 8) {
    if (has_offsets) f(std::integral_constant<int, 8>{}, std::true_type{});
    else f(std::integral_constant<int, 8>{}, std::false_type{});
  } else {
    if (has_offsets) f(std::integral_constant<int, 4>{}, std::true_type{});
    else f(std::integral_constant<int, 4>{}, std::false_type{});
  }
}

}  // namespace quiver_quant
