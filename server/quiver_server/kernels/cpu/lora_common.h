// Checks and layout tests shared by the CPU LoRA kernels (lora_bgmv.cpp, lora_sgmv.cpp).
#pragma once

#include <ATen/ATen.h>

namespace quiver_lora {

// A transposed view of contiguous [S, R, out] storage: the CPU adapter slots' lora_B layout.
inline bool rank_major(const at::Tensor& lora_b) {
  return lora_b.stride(1) == 1 && lora_b.stride(2) == lora_b.size(1) &&
         lora_b.stride(0) == lora_b.size(1) * lora_b.size(2);
}

inline void check_common(const at::Tensor& y, const at::Tensor& x, const at::Tensor& scaling) {
  TORCH_CHECK(y.device().is_cpu() && x.device().is_cpu(), "the LoRA kernels run on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2, "x and y must be 2-D");
  TORCH_CHECK(x.is_contiguous() && y.stride(1) == 1, "x must be contiguous, y's rows dense");
  TORCH_CHECK(y.size(0) == x.size(0), "shapes do not fit: y ", y.sizes(), ", x ", x.sizes());
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y must share a dtype");
  TORCH_CHECK(scaling.scalar_type() == at::kFloat && scaling.is_contiguous() && scaling.dim() == 1,
              "scaling must be a contiguous float32 [slots]");
}

inline void check_part(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                       const at::Tensor& lora_b, int64_t column, const at::Tensor& scaling) {
  TORCH_CHECK(lora_a.device().is_cpu() && lora_b.device().is_cpu(), "the LoRA kernels run on CPU tensors");
  TORCH_CHECK(lora_a.dim() == 3 && lora_b.dim() == 3, "the LoRA buffers must be 3-D");
  TORCH_CHECK(lora_a.is_contiguous(), "lora_a must be contiguous");
  TORCH_CHECK(lora_b.is_contiguous() || lora_b.transpose(1, 2).is_contiguous(),
              "lora_b must be contiguous [S, out, R] or a transposed view of contiguous [S, R, out]");
  TORCH_CHECK(lora_a.size(2) == x.size(1) && lora_b.size(2) == lora_a.size(1) &&
                  lora_b.size(0) == lora_a.size(0) && column >= 0 &&
                  column + lora_b.size(1) <= y.size(1),
              "shapes do not fit: y ", y.sizes(), ", x ", x.sizes(), ", A ", lora_a.sizes(), ", B ",
              lora_b.sizes(), ", column ", column);
  TORCH_CHECK(x.scalar_type() == lora_a.scalar_type() && x.scalar_type() == lora_b.scalar_type(),
              "x, y and the LoRA buffers must share a dtype");
  TORCH_CHECK(scaling.numel() == lora_a.size(0), "scaling must have one entry per slot");
}

inline void check_ranks(const at::Tensor& ranks, const at::Tensor& lora_a) {
  TORCH_CHECK(ranks.device().is_cpu() && ranks.scalar_type() == at::kInt && ranks.dim() == 1 &&
                  ranks.is_contiguous() && ranks.numel() == lora_a.size(0),
              "slot_ranks must be contiguous int32 [slots], got ", ranks.sizes(), " ", ranks.scalar_type());
  const int32_t* data = ranks.data_ptr<int32_t>();
  for (int64_t s = 0; s < ranks.numel(); ++s) {
    TORCH_CHECK(data[s] >= 0 && data[s] <= lora_a.size(1), "slot_ranks[", s, "] = ", data[s],
                " is outside 0..", lora_a.size(1));
  }
}

// Slot indices (token_slots or seg_slots): int32, contiguous, each -1 (base model) or a slot.
inline void check_slots(const at::Tensor& slots, const at::Tensor& scaling, const char* name) {
  TORCH_CHECK(slots.scalar_type() == at::kInt && slots.is_contiguous() && slots.dim() == 1,
              name, " must be a contiguous int32 1-D tensor");
  const int32_t* data = slots.data_ptr<int32_t>();
  for (int64_t i = 0; i < slots.numel(); ++i) {
    TORCH_CHECK(data[i] >= -1 && data[i] < scaling.numel(), name, "[", i, "] = ", data[i], " is not a slot");
  }
}

}  // namespace quiver_lora
