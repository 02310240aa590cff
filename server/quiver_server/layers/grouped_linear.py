"""Stacked per-expert projections of a sparse MLP, run as one grouped matmul.

`GroupedLinear` holds weight [E, out, in] (a fused one may stack several checkpoint parts side by
side in its output columns, gate|up) and takes rows of x already sorted by expert, group g being
rows offsets[g-1]:offsets[g]. Like `Linear` it knows nothing of adapters: a
`layers.lora.LoraGroupedLinear` wraps it when adapter slots are allocated, each row then reading
the buffer row of its (slot, expert) pair from the metadata the caller built.

The matmul is torch's grouped_mm (public from 2.10, private before) where it runs for the device
and dtype, else one matmul per expert; which one is probed once per (device type, dtype).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from quiver_server.kernels.lora_meta import LoraBatchMeta
from quiver_server.kernels.ops import KernelOps
from quiver_server.layers.linear import part_columns
from quiver_server.parallel import RowSpans


class GroupedLinear(nn.Module):
    def __init__(self, num_experts: int, in_features: int, parts: dict[str, int], ops: KernelOps) -> None:
        """parts: LoRA target name of each part -> its output width, in output-column order."""
        super().__init__()
        self.ops = ops
        self.num_experts = num_experts
        self.in_features = in_features
        self.parts = dict(parts)
        self.out_features = sum(parts.values())
        self.part_columns = part_columns(self.parts)
        self.weight = nn.Parameter(torch.empty(num_experts, self.out_features, in_features))
        # Tensor parallelism, as `Linear` has it: the checkpoint rows of each part this rank keeps
        # (split by output) or its input columns (split by input), and the unsplit shapes
        # adapters are made for.
        self.split_rows: dict[str, RowSpans] | None = None
        self.split_inputs: slice | None = None
        self.whole_in_features = in_features
        self.whole_parts = dict(self.parts)

    def split_by_output(self, rows: dict[str, RowSpans], whole_parts: dict[str, int]) -> None:
        self.split_rows, self.whole_parts = dict(rows), dict(whole_parts)

    def split_by_input(self, inputs: slice, whole_in_features: int) -> None:
        self.split_inputs, self.whole_in_features = inputs, whole_in_features

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, lora: LoraBatchMeta | None) -> torch.Tensor:
        """x [N, in] sorted by expert, offsets int32 [E] (each group's end row) -> [N, out].
        `lora` (the rows' adapter buffer rows) is for a LoRA wrapper's sake; the matmul ignores it."""
        del lora
        return grouped_linear(x, self.weight, offsets)


_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_grouped_works: dict[tuple[str, torch.dtype], bool] = {}


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by group; group g (rows offsets[g-1]:offsets[g]) times weight[g]^T
    ([E, out, in]). One grouped kernel where torch has one for this device and dtype, else one
    matmul per expert."""
    if has_grouped_mm(x.device, x.dtype):
        assert _GROUPED_MM is not None
        return _GROUPED_MM(x, weight.transpose(1, 2), offs=offsets)
    return per_expert_linear(x, weight, offsets)


def host_sync_free(modules: Iterable[nn.Module], device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model of these modules runs its forward pass without reading device values on
    the host, as a CUDA graph capture needs. A grouped (MoE) matmul does so only on torch's
    CUTLASS kernel (bfloat16 on compute capability 9 or 10); elsewhere torch's fallback, like
    `per_expert_linear`, copies the group offsets to the host and loops over the experts."""
    if device.type != "cuda" or not any(isinstance(module, GroupedLinear) for module in modules):
        return True
    return (dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)
            and has_grouped_mm(device, dtype))


def has_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
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
    looped = per_expert_linear(x, weight, offsets)
    return bool(torch.allclose(grouped.float(), looped.float(), atol=0.1, rtol=0.05))


def per_expert_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(x.shape[0], weight.shape[1])
    bounds = [0, *offsets.tolist()]
    for expert in range(weight.shape[0]):
        start, end = bounds[expert], bounds[expert + 1]
        if end > start:
            out[start:end] = F.linear(x[start:end], weight[expert])
    return out
