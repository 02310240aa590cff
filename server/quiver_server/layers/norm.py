"""RMS normalisation, computed exactly as transformers' LlamaRMSNorm does (float32 statistics)."""

from __future__ import annotations

import torch
from torch import nn

from quiver_server.kernels import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dim() == 2 and cpu_ops.available():
            return cpu_ops.rms_norm(x, self.weight, self.eps)  # the same steps, in one pass
        # Statistics in float32 and the weight applied after the cast back: the same rounding
        # steps as the reference, so float32 logits match it to the last few bits.
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)
