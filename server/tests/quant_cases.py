"""Random quantized weights for the quantized-matmul kernel tests (CPU, AMX, Triton): values over
the whole range of their width, positive scales, offsets around zero."""

from __future__ import annotations

import torch

from quiver_server.quant.weights import QuantizedWeight


def random_weight(out: int, inp: int, bits: int, group: int, offsets: bool, seed: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    if bits == 8:
        q = torch.randint(-128, 128, (out, inp), generator=gen, dtype=torch.int8)
    else:
        q = torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.uint8)
    groups = (out, inp // group)
    scales = torch.rand(groups, generator=gen) * 0.02 + 1e-3
    offs = (torch.randn(groups, generator=gen) * 0.1) if offsets else None
    return QuantizedWeight(bits, q, scales, offs, group)
