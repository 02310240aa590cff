"""The canonical form of a weight-only quantized [out, in] projection weight.

Every source maps onto it — `--quantize int8|int4` at load, GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K,
Q6_K), AWQ/GPTQ — and every kernel packs its own layout from it once at load:

    w[n, k] = q[n, k] * scales[n, k // group_size] + offsets[n, k // group_size]

- bits 8: q is int8 in [-128, 127] (llama.cpp's Q8_0 and Q6_K, per-channel int8: no offsets).
- bits 4: q is uint8 holding one value in [0, 15] per byte (unpacked: packing is each kernel's
  business); affine formats carry offsets (Q4_1, Q4_K, AWQ/GPTQ's zero points as -scale * zero,
  Q4_0's fixed 8 as -8 * scale).
- offsets may be None (symmetric) for either width.

Parts of one fused projection may come in different forms (a Q4_K_M file stores v_proj as Q6_K
beside a Q4_K q_proj); `common_form` rewrites them exactly into one (`concat_rows`).

A float offset rather than an integer zero point covers every format above exactly: scale and
offset are float32, products of a 16-bit scale and a small integer, which float32 holds exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BITS = (8, 4)


@dataclass(frozen=True)
class QuantizedWeight:
    bits: int
    q: torch.Tensor  # int8 (bits 8) or uint8 (bits 4, values 0..15) [out, in]
    scales: torch.Tensor  # float32 [out, in // group_size]
    offsets: torch.Tensor | None  # float32 [out, in // group_size]; None: symmetric
    group_size: int

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"quantized weights have 8 or 4 bits, not {self.bits}")
        out, inp = self.q.shape
        expected = torch.int8 if self.bits == 8 else torch.uint8
        if self.q.dtype != expected:
            raise ValueError(f"{self.bits}-bit q must be {expected}, got {self.q.dtype}")
        if self.group_size < 1 or inp % self.group_size:
            raise ValueError(f"group size {self.group_size} does not divide {inp} input features")
        groups = (out, inp // self.group_size)
        if tuple(self.scales.shape) != groups or self.scales.dtype != torch.float32:
            raise ValueError(f"scales must be float32 {groups}, got {self.scales.dtype} {tuple(self.scales.shape)}")
        if self.offsets is not None and (tuple(self.offsets.shape) != groups or self.offsets.dtype != torch.float32):
            raise ValueError(f"offsets must be float32 {groups}")

    @property
    def out_features(self) -> int:
        return int(self.q.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.q.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] it stands for, computed in float32 (one rounding per
        product, as the kernels do), then cast to `dtype`."""
        scales = self.scales.repeat_interleave(self.group_size, dim=1)
        w = self.q.to(torch.float32) * scales
        if self.offsets is not None:
            w = w + self.offsets.repeat_interleave(self.group_size, dim=1)
        return w.to(dtype)

    def rows(self, start: int, end: int) -> QuantizedWeight:
        """Output rows [start, end) (one part of a fused projection)."""
        offsets = None if self.offsets is None else self.offsets[start:end]
        return QuantizedWeight(self.bits, self.q[start:end], self.scales[start:end], offsets, self.group_size)


def regroup(weight: QuantizedWeight, bits: int, group_size: int, with_offsets: bool) -> QuantizedWeight:
    """The same weights in a wider or equal form: 4-bit values widened to int8, groups split into
    smaller ones dividing them (scales repeated), zero offsets added. Exact: every w is unchanged."""
    if bits < weight.bits or weight.group_size % group_size:
        raise ValueError(f"cannot narrow {weight.bits}-bit groups of {weight.group_size} "
                         f"to {bits}-bit groups of {group_size}")
    repeat = weight.group_size // group_size
    scales = weight.scales.repeat_interleave(repeat, dim=1)
    offsets = None
    if weight.offsets is not None:
        offsets = weight.offsets.repeat_interleave(repeat, dim=1)
    elif with_offsets:
        offsets = torch.zeros_like(scales)
    q = weight.q if bits == weight.bits else weight.q.to(torch.int8)  # 0..15 fits int8
    return QuantizedWeight(bits, q, scales, offsets, group_size)


def common_form(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """The parts rewritten exactly into one bit width, group size and offset form."""
    bits = max(p.bits for p in parts)
    group = parts[0].group_size
    for p in parts[1:]:
        group = math.gcd(group, p.group_size)
    with_offsets = any(p.offsets is not None for p in parts)
    return [regroup(p, bits, group, with_offsets) for p in parts]


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Parts stacked by output rows (q|k|v, gate|up), brought to one form first."""
    if len({p.in_features for p in parts}) != 1:
        raise ValueError("fused parts must share their input features")
    parts = common_form(parts)
    first = parts[0]
    offsets = None if first.offsets is None else torch.cat([p.offsets for p in parts if p.offsets is not None])
    return QuantizedWeight(first.bits, torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                           offsets, first.group_size)
