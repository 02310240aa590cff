"""CPU matmuls on weights packed once at load time.

`F.linear` on CPU calls MKL's sgemm (float32) or oneDNN (bfloat16), which rearrange the whole
weight matrix on every call; at decode sizes (a few dozen rows) that costs as much as the
product. Packing once at load is what torch's inductor does for frozen CPU models, and the packed
copy replaces the plain weight, so memory does not grow. The packings:

- float32, quiver's own (`cpu/linear.cpp`, when the C++ kernels are built): column panels whose
  product prefetches the next panel while it computes. Decode steps read their weights from DRAM,
  and this overlap makes a 32-row step's projections ~30% and its LM head ~40% faster than
  oneDNN's packed product; prefill-sized products run at oneDNN's speed.
- float32, oneDNN's blocked layout (`mkldnn._linear_pointwise` on a `_reorder_linear_weight`),
  where the C++ kernels are not available (no compiler, or QUIVER_CPU_KERNELS=0).
- bfloat16 on a CPU with AMX (`cpu/linear_bf16_amx.cpp`): the AMX B tiles' own layout. Decode
  steps stream the weights at about twice oneDNN's rate (a demo-model step's projections and LM
  head: 1 row 12 ms against 16, 32 rows 16.5 against 26, on a 2-core Xeon); prefill chunks of
  2048 rows run ~35% slower than `F.linear`, up to 1024 rows as fast or faster.

Other 16-bit weights (float16; bfloat16 without AMX) stay plain `F.linear` weights: without the
tile unit, packing them measured no faster. QUIVER_CPU_PACKED_WEIGHTS=0 turns packing off (plain
`F.linear`), to compare or to rule it out when debugging.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from quiver_server.kernels import cpu_ops

# The row count oneDNN's packed layout is tuned for: a full decode batch. Any row count works.
BATCH_HINT = 32
# Outputs per panel of the bfloat16 AMX layout: 3 tiles of 16 (cpu/amx_tiles.h's PANEL).
PANEL = 48


@dataclass(frozen=True)
class PackedWeight:
    """A [out_features, in_features] weight in `kernel`'s packed layout ("quiver" or "onednn")."""

    data: torch.Tensor
    out_features: int
    in_features: int
    kernel: str


def available(weight: torch.Tensor) -> bool:
    if os.environ.get("QUIVER_CPU_PACKED_WEIGHTS", "1") == "0" or weight.device.type != "cpu":
        return False
    if weight.dtype == torch.bfloat16:
        return amx_bf16_available()
    return weight.dtype == torch.float32 and (cpu_ops.available() or _onednn_available())


def amx_bf16_available() -> bool:
    """quiver's bfloat16 AMX matmul is built here and the OS grants the tiles."""
    return cpu_ops.available() and bool(torch.ops.quiver_cpu.bf16_amx_available())


def _onednn_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack(weight: torch.Tensor, kernel: str | None = None) -> PackedWeight:
    """weight [out, in] (as F.linear takes it) -> its packed form for `linear`. kernel: "quiver"
    or "onednn" for a float32 weight (by default quiver's where the C++ kernels are built); a
    bfloat16 weight packs for "amx_bf16" whichever is asked."""
    weight = weight.detach().contiguous()
    if weight.dtype == torch.bfloat16:
        if not amx_bf16_available():
            raise RuntimeError("the bfloat16 packed matmul needs AMX and the C++ CPU kernels")
        return PackedWeight(amx_tiles(weight), weight.shape[0], weight.shape[1], "amx_bf16")
    kernel = kernel or ("quiver" if cpu_ops.available() else "onednn")
    if kernel == "quiver":
        if not cpu_ops.available():
            raise RuntimeError("quiver's packed matmul needs the C++ CPU kernels, which are not built")
        data = torch.ops.quiver_cpu.pack_linear_weight(weight)
    elif kernel == "onednn":
        data = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
    else:
        raise ValueError(f"unknown packed-matmul kernel {kernel!r}")
    return PackedWeight(data, weight.shape[0], weight.shape[1], kernel)


def amx_tiles(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [P, S, 3, 16, 32], the layout `linear_bf16_amx` reads: P panels of 48
    outputs (3 tiles of 16), S steps of 32 inputs, zero-padded; row r of a tile holds inputs
    2r and 2r + 1 of each of its 16 outputs, interleaved (the AMX B tiles' VNNI layout)."""
    n, k = weight.shape
    panels, steps = -(-n // PANEL), -(-k // 32)
    padded = weight.new_zeros(panels * PANEL, steps * 32)
    padded[:n, :k] = weight
    # [panel, tile, output, step, pair, input of the pair] -> [panel, step, tile, pair, output, input]
    tiles = padded.view(panels, 3, 16, steps, 16, 2).permute(0, 3, 1, 4, 2, 5)
    return tiles.reshape(panels, steps, 3, 16, 32)


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) on the packed weight; x [..., in] -> [..., out]."""
    if packed.kernel == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
    rows = x.reshape(-1, packed.in_features).contiguous()
    if packed.kernel == "amx_bf16":
        y = torch.ops.quiver_cpu.linear_bf16_amx(rows, packed.data, bias, packed.out_features)
    else:
        y = torch.ops.quiver_cpu.linear_packed(rows, packed.data, bias, packed.out_features)
    return y.reshape(*x.shape[:-1], packed.out_features)
