"""A-priori bounds on float32 rounding error, for kernel tests whose tolerance must hold for any
summation order (the AVX2 and AVX-512 builds, oneDNN, torch all sum in different orders).

The standard result (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1): a float32
sum or dot product of n terms, in any order and with or without fused multiply-adds, is within
gamma(n) * sum_k |x_k * w_k| of the exact value, gamma(n) = n u / (1 - n u), u = 2^-24.
"""

from __future__ import annotations

import torch

FLOAT32_UNIT_ROUNDOFF = 2.0**-24


def gamma(n: int, unit_roundoff: float = FLOAT32_UNIT_ROUNDOFF) -> float:
    assert n * unit_roundoff < 1
    return n * unit_roundoff / (1 - n * unit_roundoff)


def linear_error_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Elementwise bound on |float32 (x @ weight.T + bias) - exact|: in-features products and the
    bias are in_features + 1 terms, plus the final rounding of the stored result (u |y| <= u sum)."""
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    return (gamma(weight.shape[1] + 1) + FLOAT32_UNIT_ROUNDOFF) * magnitude


UNIT_ROUNDOFF = {torch.float32: FLOAT32_UNIT_ROUNDOFF, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def lora_error_bound(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor,
    token_slots: torch.Tensor, out_slice: slice,
) -> torch.Tensor:
    """Elementwise bound on |computed - exact| for y[:, out_slice] += scaling[s] * lora_b[s] @
    (lora_a[s] @ x) per row of slot s >= 0 (lora_a [S, R, in], lora_b [S, out, R]), accumulated
    in float32 in any order, in y's dtype d (unit roundoff u_d):
    - the shrink: in-features products and the scale, gamma(in + 1) * M, where
      M = |scaling[s]| * |lora_b[s]| @ (|lora_a[s]| @ |x|) bounds every partial delta;
    - the rank intermediate converted to d (SGMV and PEFT's 16-bit path do): 2 u_d * M;
    - the expand and the add to y: gamma(R + 2) * (|y| + M);
    - the delta converted to d before the add (torch's 16-bit matmuls), and the stored result:
      4 u_d * M + 2 u_d * |y|.
    A conversion to d counts a whole ulp (2 u_d), not half: Triton's CPU interpreter may truncate.
    Base rows (s < 0) get 0: they must come back bit for bit."""
    u_d = UNIT_ROUNDOFF[y.dtype]
    rank, in_features = lora_a.shape[1], lora_a.shape[2]
    bound = torch.zeros(y.shape[0], out_slice.stop - out_slice.start, dtype=torch.float64)
    rows = torch.nonzero(token_slots >= 0).flatten()
    if rows.numel() == 0:
        return bound
    slots = token_slots[rows].long()
    h = torch.einsum("tri,ti->tr", lora_a[slots].double().abs(), x[rows].double().abs())
    magnitude = scaling[slots].double().abs()[:, None] * torch.einsum("tor,tr->to", lora_b[slots].double().abs(), h)
    base = y[rows, out_slice].double().abs()
    expand = gamma(rank + 2)
    bound[rows] = (gamma(in_features + 1) + expand + 6 * u_d) * magnitude + (expand + 2 * u_d) * base
    return bound
