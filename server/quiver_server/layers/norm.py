"""RMS normalisation, computed exactly as transformers' LlamaRMSNorm does (float32 statistics),
by the shard's `KernelOps` (`kernels.torch_ops.rms_norm` states the steps)."""

from __future__ import annotations

import torch
from torch import nn

from quiver_server.kernels.ops import KernelOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: KernelOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)
