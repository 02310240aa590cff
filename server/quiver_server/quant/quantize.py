"""`--quantize int8|int4`: weight-only quantization of a float projection weight at load.

- int8: symmetric, one scale per output channel (what TGI's and LoRAX's EETQ/bitsandbytes int8
  give): scale = max|w| / 127, q = round(w / scale).
- int4: affine, one scale and offset per group of `group_size` input features along each output
  row: scale = (max - min) / 15, q = round((w - min) / scale) clamped to [0, 15], offset = min
  (llama.cpp's Q4_1). The range includes 0 only if the group's does, as the formats' own
  quantizers do with a float zero point.

`--quantize-group-size` sets int4's group. The default is 32, llama.cpp's Q4 block: rounding
alone (no calibration data) in AWQ's and GPTQ's groups of 128 triples the demo model's
perplexity, where those formats' calibration recovers most of it; groups of 32 cost a third more
memory for scales (0.75 bytes a weight instead of 0.5625). docs/quantization.md has the
measurements. A group size that does not divide the input features falls back to the largest
power of two below it that does (down to 32), else to one group per row.
"""

from __future__ import annotations

import torch

from dataclasses import dataclass

from quiver_server.quant import DEFAULT_INT4_GROUP
from quiver_server.quant.weights import QuantizedWeight

METHODS = ("int8", "int4")


@dataclass(frozen=True)
class QuantizeSpec:
    """What `--quantize` and `--quantize-group-size` ask for."""

    method: str
    group_size: int = DEFAULT_INT4_GROUP
    lm_head: bool = False  # --quantize-lm-head: the LM head too (a copy of it where it is tied)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization {self.method!r}, expected one of {', '.join(METHODS)}")
        if self.group_size < 16 or self.group_size & (self.group_size - 1):
            raise ValueError(f"quantization group size {self.group_size}: a power of two, 16 or more")

    def apply(self, weight: torch.Tensor, row_absmax: torch.Tensor | None = None,
              whole_in_features: int | None = None) -> QuantizedWeight:
        """`weight`'s quantization. A rank's input-column share of a split projection
        (models/tensor_split.py) quantizes as its columns of the whole one do: int8 from the
        whole rows' `row_absmax` [out, 1], int4 in the groups the whole `whole_in_features` take."""
        if self.method == "int8":
            return quantize_int8(weight, row_absmax)
        group = int4_group_size(whole_in_features or weight.shape[1], self.group_size)
        if weight.shape[1] % group:
            raise ValueError(f"int4 groups of {group} inputs do not split into shares of {weight.shape[1]}: "
                             "pick a --quantize-group-size that divides them, or fewer shards")
        return quantize_int4(weight, group)


def quantize_int8(weight: torch.Tensor, row_absmax: torch.Tensor | None = None) -> QuantizedWeight:
    """Per output row: scale = max |w| / 127 over the row (or `row_absmax` [out, 1] given)."""
    w = weight.detach().to(torch.float32)
    scales = (w.abs().amax(dim=1, keepdim=True) if row_absmax is None else row_absmax) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row stays zero
    q = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(8, q.contiguous(), scales.contiguous(), None, w.shape[1])


def int4_group_size(in_features: int, wanted: int) -> int:
    group = wanted
    while group >= min(wanted, 32):  # a group of 16 asked for is kept where it divides
        if in_features % group == 0:
            return group
        group //= 2
    return in_features


def quantize_int4(weight: torch.Tensor, group_size: int = DEFAULT_INT4_GROUP) -> QuantizedWeight:
    w = weight.detach().to(torch.float32)
    out, inp = w.shape
    group = int4_group_size(inp, group_size)
    grouped = w.view(out, inp // group, group)
    low = grouped.amin(dim=2)
    high = grouped.amax(dim=2)
    scales = (high - low) / 15.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group: q = 0, w = offset
    q = torch.round((grouped - low.unsqueeze(2)) / scales.unsqueeze(2)).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight(4, q.view(out, inp).contiguous(), scales.contiguous(), low.contiguous(), group)
