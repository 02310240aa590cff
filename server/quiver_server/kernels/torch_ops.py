"""Plain-torch versions of the fused row ops: what runs where the C++ kernels do not (CUDA,
QUIVER_CPU_KERNELS=0), and the semantics those kernels are tested against.

Each follows transformers' Llama code step for step (same float32 statistics, same rounding
points), so float32 logits match the reference to the last few bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: statistics in float32, the weight applied after the cast back."""
    input_dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(input_dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by the half-split (GPT-NeoX style) rotary embedding, cos/sin
    [T, 1, D]: x * cos + rotate_half(x) * sin, as a new tensor."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> gelu_tanh(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def logprob_at(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[row, tokens[row]] per row, without writing the [B, V] log_softmax."""
    return logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


def greedy_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [B, V] -> (argmax token per row [B] long, its log-softmax [B] float32)."""
    tokens = logits.argmax(dim=-1)
    return tokens, logprob_at(logits, tokens)
