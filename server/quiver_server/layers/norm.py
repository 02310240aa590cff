"""RMS normalisation in the two forms checkpoints use, each computed exactly as transformers
does (float32 statistics), through the shard's `KernelOps` where the rounding allows it.

- `RMSNorm` (Llama, Qwen, Phi, Granite, Mixtral): the weight multiplies after the cast back to
  the activation dtype (`kernels.torch_ops.rms_norm` states the steps).
- `GemmaRMSNorm` (Gemma 1-3): the checkpoint stores w and the scale is (1 + w), applied in float32
  before the cast back. In float32 both forms are the same arithmetic, so the fused kernel runs
  it with (1 + w); in 16-bit dtypes the torch form keeps Gemma's rounding.

Either norm can run over the last dimension of a 3-d tensor (q/k norms over head_dim).
"""

from __future__ import annotations

import torch
from torch import nn

from quiver_server.kernels.ops import KernelOps


class RMSNorm(nn.Module):
    gemma_form = False

    def __init__(self, dim: int, eps: float, ops: KernelOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)

    def add_and_norm(
        self, block_out: torch.Tensor, residual: torch.Tensor, scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of the new residual stream, the stream): residual + block_out * scale, in one
        pass where the ops fuse it (the stream may then be updated in place: use the result)."""
        fused = self.ops.add_rms_norm(block_out, residual, self.weight, self.eps, scale, self.gemma_form)
        if fused is not None:
            return fused
        stream = residual + block_out * scale if scale != 1.0 else residual + block_out
        return self(stream), stream


class GemmaRMSNorm(RMSNorm):
    """The same parameters as `RMSNorm`; only the scale differs."""

    gemma_form = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        if x.dtype == torch.float32:
            flat = x.reshape(-1, x.shape[-1])
            return self.ops.rms_norm(flat, scale, self.eps).view(x.shape)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * scale).to(x.dtype)


def make_norm(kind: str, dim: int, eps: float, ops: KernelOps) -> RMSNorm:
    """The norm a family declares: "rms" or "gemma"."""
    if kind == "gemma":
        return GemmaRMSNorm(dim, eps, ops)
    if kind == "rms":
        return RMSNorm(dim, eps, ops)
    raise ValueError(f"unknown norm kind {kind!r}")
