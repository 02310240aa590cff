"""CPU float32 matmuls on weights packed once at load time.

`F.linear` on CPU calls MKL's sgemm, which repacks the whole weight matrix on every call; at
decode sizes (a few dozen rows) that repacking costs as much as the product. Packing once at
load is what torch's inductor does for frozen CPU models, and the packed copy replaces the plain
weight, so memory does not grow. Two packings:

- quiver's own (`cpu/linear.cpp`, when the C++ kernels are built): column panels whose product
  prefetches the next panel while it computes. Decode steps read their weights from DRAM, and
  this overlap makes a 32-row step's projections ~30% and its LM head ~40% faster than oneDNN's
  packed product; prefill-sized products run at oneDNN's speed.
- oneDNN's blocked layout (`mkldnn._linear_pointwise` on a `_reorder_linear_weight`), where the
  C++ kernels are not available (no compiler, or QUIVER_CPU_KERNELS=0).

float32 only: without AVX512-BF16/AMX, 16-bit products are no faster packed than `F.linear`.
QUIVER_CPU_PACKED_WEIGHTS=0 turns packing off (plain `F.linear`), to compare or to rule it out
when debugging.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from quiver_server.kernels import cpu_ops

# The row count oneDNN's packed layout is tuned for: a full decode batch. Any row count works.
BATCH_HINT = 32


@dataclass(frozen=True)
class PackedWeight:
    """A [out_features, in_features] weight in `kernel`'s packed layout ("quiver" or "onednn")."""

    data: torch.Tensor
    out_features: int
    in_features: int
    kernel: str


def available(weight: torch.Tensor) -> bool:
    return (
        os.environ.get("QUIVER_CPU_PACKED_WEIGHTS", "1") != "0"
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and (cpu_ops.available() or _onednn_available())
    )


def _onednn_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack(weight: torch.Tensor, kernel: str | None = None) -> PackedWeight:
    """weight [out, in] (as F.linear takes it) -> its packed form for `linear`. kernel: "quiver"
    or "onednn"; by default quiver's where the C++ kernels are built."""
    kernel = kernel or ("quiver" if cpu_ops.available() else "onednn")
    weight = weight.detach().contiguous()
    if kernel == "quiver":
        if not cpu_ops.available():
            raise RuntimeError("quiver's packed matmul needs the C++ CPU kernels, which are not built")
        data = torch.ops.quiver_cpu.pack_linear_weight(weight)
    elif kernel == "onednn":
        data = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
    else:
        raise ValueError(f"unknown packed-matmul kernel {kernel!r}")
    return PackedWeight(data, weight.shape[0], weight.shape[1], kernel)


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) on the packed weight; x [..., in] -> [..., out]."""
    if packed.kernel == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
    rows = x.reshape(-1, packed.in_features).contiguous()
    y = torch.ops.quiver_cpu.linear_packed(rows, packed.data, bias, packed.out_features)
    return y.reshape(*x.shape[:-1], packed.out_features)
