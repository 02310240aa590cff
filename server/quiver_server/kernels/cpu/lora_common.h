// Checks and layout tests shared by the CPU LoRA kernels (lora_bgmv.cpp, lora_sgmv.cpp).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

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

// The parts of one fused projection as the *_parts ops take them (a lora_a, a lora_b, an optional
// slot_ranks and an output column each), held in vectors for the kernels' per-dtype templates.
struct Parts {
  std::vector<at::Tensor> a, b, ranks;
  std::vector<int64_t> columns;
};

// The parts, each checked against y, x and scaling; `rank_major_op` names the op that needs
// every lora_b in the CPU slots' rank-major layout (null: either layout).
inline Parts check_parts(const at::Tensor& y, const at::Tensor& x, at::TensorList lora_a, at::TensorList lora_b,
                         at::TensorList slot_ranks, at::IntArrayRef columns, const at::Tensor& scaling,
                         const char* rank_major_op = nullptr) {
  TORCH_CHECK(!lora_a.empty() && lora_a.size() == lora_b.size() && lora_a.size() == columns.size(),
              "one lora_a, lora_b and column per part");
  TORCH_CHECK(slot_ranks.empty() || slot_ranks.size() == lora_a.size(), "slot_ranks: none, or one per part");
  Parts parts{{lora_a.begin(), lora_a.end()}, {lora_b.begin(), lora_b.end()},
              {slot_ranks.begin(), slot_ranks.end()}, {columns.begin(), columns.end()}};
  for (size_t p = 0; p < parts.a.size(); ++p) {
    check_part(y, x, parts.a[p], parts.b[p], parts.columns[p], scaling);
    if (rank_major_op)
      TORCH_CHECK(rank_major(parts.b[p]), rank_major_op, ": lora_b must be a transposed view of "
                  "contiguous [S, R, out] (the CPU slots' layout)");
    if (!parts.ranks.empty()) check_ranks(parts.ranks[p], parts.a[p]);
  }
  return parts;
}

// One part's pointers, sizes and layout for the dtype a kernel runs in, read once per call rather
// than per row; max_rank and max_out size the kernels' per-thread buffers.
template <typename scalar_t>
struct PartViews {
  struct Part {
    const scalar_t* a;
    const scalar_t* b;
    const int32_t* ranks;  // a slot's own rank in this part (rows past it are zero); null: R
    int64_t rank, out, column;
    bool rank_major;
  };
  std::vector<Part> parts;
  int64_t max_rank = 0, max_out = 0;

  explicit PartViews(const Parts& checked) {
    for (size_t p = 0; p < checked.a.size(); ++p) {
      const int32_t* ranks = checked.ranks.empty() ? nullptr : checked.ranks[p].data_ptr<int32_t>();
      parts.push_back({checked.a[p].data_ptr<scalar_t>(), checked.b[p].data_ptr<scalar_t>(), ranks,
                       checked.a[p].size(1), checked.b[p].size(1), checked.columns[p], rank_major(checked.b[p])});
      max_rank = std::max(max_rank, parts.back().rank);
      max_out = std::max(max_out, parts.back().out);
    }
  }
};

}  // namespace quiver_lora
