"""CPU matmuls on weights prepacked once into oneDNN's blocked layout.

`F.linear` on CPU calls MKL's sgemm, which repacks the whole weight matrix on every call. At
decode sizes (a few to a few dozen rows) that repacking is as costly as the product itself:
on the benchmark model a [32, 512] x [512, 2816] product took 0.7 ms with `F.linear` and
0.45 ms on the prepacked weight, the [32, 512] x [512, 32000] LM head 8 ms and 4.6 ms. Packing
once at load time is what torch's own inductor does for frozen CPU models
(`mkldnn._linear_pointwise` on a `_reorder_linear_weight`); the packed copy replaces the plain
weight, so memory does not grow.

float32 only: without AVX512-BF16/AMX, oneDNN's bfloat16 and float16 paths are no faster than
`F.linear`. QUIVER_CPU_PACKED_WEIGHTS=0 turns packing off (plain `F.linear`), to compare or to
rule it out when debugging.
"""

from __future__ import annotations

import os

import torch

# The row count the packed layout is tuned for: a full decode batch. Any row count works.
BATCH_HINT = 32


def available(weight: torch.Tensor) -> bool:
    return (
        os.environ.get("QUIVER_CPU_PACKED_WEIGHTS", "1") != "0"
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] (as F.linear takes it) -> an opaque oneDNN tensor for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) on the packed weight; x [..., in] -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
