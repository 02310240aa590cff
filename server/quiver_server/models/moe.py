"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE), computed as transformers does.

Routing: softmax of the router logits in float32, the top-k experts per token, optionally
renormalised to sum to one, the weights cast to the activation dtype or kept in float32
(`MoeConfig`). Experts: gated MLPs whose weights are stacked, gate|up [E, 2I, H] and down
[E, H, I]. The batch's (token, expert) pairs are sorted by expert and each projection runs as
one grouped matmul over all experts (torch's grouped_mm, on CPU and CUDA): no loop over tokens,
and where torch has the grouped kernel for the device and dtype, none over experts either.

Checkpoints store each expert's projections apart (model.layers.N.mlp.experts.E.gate_proj);
they load into the stacks by expert index.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quiver_server.forward_batch import ForwardBatch
from quiver_server.kernels.ops import KernelOps
from quiver_server.layers.activation import gated_activation
from quiver_server.models.decoder_config import DecoderConfig

Loader = Callable[[torch.Tensor], None]


class SparseMoe(nn.Module):
    def __init__(self, cfg: DecoderConfig, ops: KernelOps) -> None:
        super().__init__()
        assert cfg.moe is not None
        moe = cfg.moe
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.width = moe.intermediate_size
        self.normalize_top_k, self.weights_in_float32 = moe.normalize_top_k, moe.weights_in_float32
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)  # the router
        self.gate_up = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, cfg.hidden_size))
        self.down = nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size, moe.intermediate_size))
        self.act = gated_activation(cfg.activation, ops)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        del batch  # no LoRA on the experts yet
        weights, experts = self.route(x)
        flat_experts = experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        token_of = order // self.top_k
        counts = torch.bincount(flat_experts, minlength=self.num_experts)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        hidden = grouped_linear(x[token_of], self.gate_up, offsets)
        out = grouped_linear(self.act(hidden), self.down, offsets)
        out = out * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token_of, out.to(x.dtype))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (routing weights [T, k], expert ids [T, k])."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_float32:
            weights = weights.to(logits.dtype)
        return weights, experts

    def checkpoint_loaders(self, prefix: str) -> dict[str, Loader]:
        """Per-expert checkpoint names -> their rows of the stacks; the router as it is."""
        loaders: dict[str, Loader] = {f"{prefix}.gate.weight": _copy_into(self.gate.weight)}
        width = self.width
        for expert in range(self.num_experts):
            base = f"{prefix}.experts.{expert}"
            loaders[f"{base}.gate_proj.weight"] = _copy_into(self.gate_up[expert, :width])
            loaders[f"{base}.up_proj.weight"] = _copy_into(self.gate_up[expert, width:])
            loaders[f"{base}.down_proj.weight"] = _copy_into(self.down[expert])
        return loaders


# torch's grouped matmul (public from 2.10, private before); where it is missing or refuses a
# device and dtype, one matmul per expert stands in. Probed once per (device type, dtype).
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_grouped_works: dict[tuple[str, torch.dtype], bool] = {}


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by group; group g (rows offsets[g-1]:offsets[g]) times weight[g]^T
    ([E, out, in]). One grouped kernel where torch has one for this device and dtype, else one
    matmul per expert."""
    if _has_grouped_mm(x.device, x.dtype):
        assert _GROUPED_MM is not None
        return _GROUPED_MM(x, weight.transpose(1, 2), offs=offsets)
    return _per_expert_linear(x, weight, offsets)


def _has_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    key = (device.type, dtype)
    if key not in _grouped_works:
        _grouped_works[key] = _probe_grouped_mm(device, dtype)
    return _grouped_works[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the grouped kernel runs here and agrees with per-expert matmuls (two groups,
    one of them empty, on shapes that meet the CUDA kernel's alignment)."""
    if _GROUPED_MM is None:
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 32, generator=generator).to(device, dtype)
    weight = torch.randn(3, 16, 32, generator=generator).to(device, dtype)
    offsets = torch.tensor([3, 3, 8], dtype=torch.int32, device=device)
    try:
        grouped = _GROUPED_MM(x, weight.transpose(1, 2), offs=offsets)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    looped = _per_expert_linear(x, weight, offsets)
    return bool(torch.allclose(grouped.float(), looped.float(), atol=0.1, rtol=0.05))


def _per_expert_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(x.shape[0], weight.shape[1])
    bounds = [0, *offsets.tolist()]
    for expert in range(weight.shape[0]):
        start, end = bounds[expert], bounds[expert + 1]
        if end > start:
            out[start:end] = F.linear(x[start:end], weight[expert])
    return out


def _copy_into(destination: torch.Tensor) -> Loader:
    def load(tensor: torch.Tensor) -> None:
        if destination.shape != tensor.shape:
            raise ValueError(f"expert tensor has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}")
        destination.data.copy_(tensor)

    return load
