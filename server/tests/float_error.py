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
