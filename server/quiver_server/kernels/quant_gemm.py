"""Weight-only quantized matmuls: y = x @ dequant(W)^T (+ bias) for a `quant.QuantizedWeight`,
packed once at load for the device's kernel.

- CPU with the C++ kernels (`cpu/linear_quant.cpp`): column panels of int8 or two-per-byte 4-bit
  values with their scales, dequantized in registers; x goes in as float32 (a 16-bit model's
  activations are widened for the product and the result rounded back to their dtype). On AMX
  hosts, bfloat16 x goes to `cpu/linear_quant_amx.cpp` instead (but at FMA_ROWS), on the same
  packed weight: dequantized to bf16 once per call, multiplied in the tile unit.
- CUDA: Triton, two kernels on one packed layout (`quant_triton_layout`), chosen per call by the
  row count (`triton_linear`): multiply-adds on the CUDA cores for 1 to 4 rows where an H100
  sweep found them faster (`quant_gemv_triton`), tensor-core dots otherwise (`quant_matmul_triton`).
- CPU with `--quantize-activations int8` (`cpu/linear_int8_dot.cpp`, kernel "cpu-int8-dot"): x
  is rounded to int8 in blocks of 32 inputs per call, and the products run in 8-bit integer dot
  products (VNNI, or AVX2's byte multiply-adds) on a weight packed in 4-byte lanes. Weights whose
  inputs or groups are not whole blocks of 32 keep the "cpu" kernel (`int8_dot_fits`).
- Elsewhere (QUIVER_CPU_KERNELS=0, no compiler): the weight is kept quantized and dequantized
  into a temporary for each product: slow, but the memory stays small and the numbers are the
  same products (a fallback for correctness, not for speed).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from quiver_server.kernels import cpu_ops
from quiver_server.quant.weights import QuantizedWeight

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # triton is imported only when the Triton kernels are chosen
    from quiver_server.kernels.quant_gemv_triton import GemvConfig
    from quiver_server.kernels.quant_matmul_triton import LaunchConfig
    from quiver_server.kernels.quant_triton_layout import TritonQuantWeight


@dataclass(frozen=True)
class PackedQuantWeight:
    """`weight` in `kernel`'s layout ("cpu", "triton" or "torch"); `data` is the kernel's own."""

    kernel: str
    out_features: int
    in_features: int
    bits: int
    group_size: int
    data: Any


def default_kernel(device: torch.device) -> str:
    if device.type == "cuda":
        return "triton"
    return "cpu" if device.type == "cpu" and cpu_ops.available() else "torch"


def pack(weight: QuantizedWeight, device: torch.device, kernel: str | None = None) -> PackedQuantWeight:
    kernel = kernel or default_kernel(device)
    if kernel == "cpu":
        data: Any = _pack_cpu(weight)
    elif kernel == "cpu-int8-dot":
        data = _pack_int8_dot(weight)
    elif kernel == "triton":
        from quiver_server.kernels.quant_triton_layout import pack_for_triton  # imports triton

        data = pack_for_triton(weight, device)
    elif kernel == "torch":
        data = QuantizedWeight(weight.bits, weight.q.to(device), weight.scales.to(device),
                               None if weight.offsets is None else weight.offsets.to(device), weight.group_size)
    else:
        raise ValueError(f"unknown quantized-matmul kernel {kernel!r}")
    return PackedQuantWeight(kernel, weight.out_features, weight.in_features, weight.bits, weight.group_size, data)


def _panels(t: torch.Tensor, panel: int, fill: int | float = 0) -> torch.Tensor:
    """[N, C] -> [P, C, panel]: columns of t's transpose in panels of `panel`, padded past N."""
    n, c = t.shape
    panels = -(-n // panel)
    padded = t.new_full((panels * panel, c), fill)
    padded[:n] = t
    return padded.view(panels, panel, c).transpose(1, 2).contiguous()


def _pack_cpu(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if weight.group_size % 2:
        raise ValueError(f"the CPU kernel takes even group sizes, not {weight.group_size}")
    panel = int(torch.ops.quiver_cpu.quant_panel_width())
    q = weight.q.cpu()
    if weight.bits == 4:
        pairs = q.view(q.shape[0], -1, 2)  # (value 2k, value 2k+1) in one byte: low, high nibble
        q = pairs[..., 0] | (pairs[..., 1] << 4)
    packed = _panels(q, panel)
    scales = _panels(weight.scales.cpu(), panel)
    offsets = None if weight.offsets is None else _panels(weight.offsets.cpu(), panel)
    return packed, scales, offsets


INT8_DOT_BLOCK = 32  # inputs per activation scale of the "cpu-int8-dot" kernel


def int8_dot_fits(weight: QuantizedWeight) -> bool:
    """Whether the 8-bit-activation kernel takes this weight: its inputs and groups in whole blocks
    of 32, and 8-bit values in [-127, 127] (AVX2's sign trick cannot negate -128)."""
    if weight.in_features % INT8_DOT_BLOCK or weight.group_size % INT8_DOT_BLOCK:
        return False
    return weight.bits == 4 or bool((weight.q != -128).all())


def _pack_int8_dot(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Values in the 4-byte lanes of `cpu/linear_int8_dot.cpp`, [P, K / 4 (8-bit) or K / 8 (4-bit),
    panel * 4] uint8: 8-bit q + 128, four inputs a lane; 4-bit q, eight inputs a lane, byte t
    holding inputs t (low nibble) and t + 4 (high) of the lane's eight."""
    if not int8_dot_fits(weight):
        raise ValueError(f"8-bit activations need a weight in whole blocks of {INT8_DOT_BLOCK} inputs "
                         f"(this one: {weight.in_features} inputs, groups of {weight.group_size})")
    if not cpu_ops.available():
        raise ValueError("8-bit activations run on the C++ CPU kernels, which are not built here")
    panel = int(torch.ops.quiver_cpu.quant_panel_width())
    q = weight.q.cpu()
    n, k = q.shape
    if weight.bits == 8:
        lanes = (q.to(torch.int16) + 128).to(torch.uint8).view(n, k // 4, 4)
    else:
        octets = q.view(n, k // 8, 2, 4)
        lanes = octets[:, :, 0] | (octets[:, :, 1] << 4)
    panels = -(-n // panel)
    padded = lanes.new_zeros((panels * panel, lanes.shape[1], 4))
    padded[:n] = lanes
    packed = padded.view(panels, panel, lanes.shape[1], 4).transpose(1, 2).reshape(panels, lanes.shape[1], panel * 4)
    scales = _panels(weight.scales.cpu(), panel)
    offsets = None if weight.offsets is None else _panels(weight.offsets.cpu(), panel)
    return packed.contiguous(), scales, offsets


def check_int8_activations(weights: Iterable[PackedQuantWeight]) -> None:
    """After load under `--quantize-activations int8`: refuses a model with no projection the
    8-bit kernel took (nothing quantized, or no weight in whole blocks of 32), and logs how many
    keep float activations."""
    kernels = [weight.kernel for weight in weights]
    dot = kernels.count("cpu-int8-dot")
    if not dot:
        raise ValueError("--quantize-activations int8 needs quantized projections (--quantize int8|int4, or a "
                         f"quantized checkpoint) with inputs and groups in whole blocks of {INT8_DOT_BLOCK}; "
                         "this model has none")
    if dot < len(kernels):
        log.warning("--quantize-activations int8: %d of %d quantized projections keep float activations (inputs "
                    "or groups not in whole blocks of %d)", len(kernels) - dot, len(kernels), INT8_DOT_BLOCK)


# Row counts at which bfloat16 x keeps the float32 FMA kernel; any other takes the AMX one. The AMX
# kernel dequantizes every weight to bf16 once per call whatever the rows; the FMA kernel does so
# once per micro-kernel block of rows (AVX-512: 6, 4, 2, 1) and adds 2 FMAs per row and weight.
# Measured on 2 AMX Xeon cores, us for an 8192x2048 weight, int8 per row | int4 in groups of 32:
#   rows   FMA kernel    AMX kernel    bf16 F.linear (oneDNN)
#      1    420 | 400     655 | 725     630
#      2    460 | 455     660 | 735     965
#      3    765 | 805     665 | 740     965
#      4    595 | 645     670 | 765     965
#      6    745 | 785     675 | 755     970
#      8   1140 | 1225    690 | 785     990
#     32   3960 | 4215    855 | 910    1270
#    256                 3300 | 3700   3985 | 4220
FMA_ROWS = frozenset({1, 2, 4})


@functools.cache
def amx_available() -> bool:
    """Whether the loaded CPU kernels have the AMX path and Linux lets this process use the tiles."""
    return cpu_ops.available() and bool(torch.ops.quiver_cpu.quant_amx_available())


# The C++ op of each CPU kernel, looked up when first called (the library loads on first use).
_CPU_OPS = {"cpu": lambda: torch.ops.quiver_cpu.linear_quant,
            "cpu-int8-dot": lambda: torch.ops.quiver_cpu.linear_int8_dot}


def linear(x: torch.Tensor, packed: PackedQuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, dequant(W), bias); x [..., in] -> [..., out] in x's dtype."""
    if x.dtype == torch.float32 and x.dim() == 2 and packed.kernel in _CPU_OPS:
        # Float32 rows as a step has them (the ops take the bias in any dtype): the general path's
        # Python glue below cost about as much as a one-row product itself (~8 us a call).
        q, scales, offsets = packed.data
        return _CPU_OPS[packed.kernel]()(x.contiguous(), q, scales, offsets, bias, packed.out_features, packed.bits,
                                         packed.group_size)
    if packed.kernel == "triton":
        return triton_linear(x, packed.data, bias)
    if packed.kernel == "torch":
        weight: QuantizedWeight = packed.data
        return F.linear(x, weight.dequantize(x.dtype), bias)
    q, scales, offsets = packed.data
    x2 = x.reshape(-1, packed.in_features)
    if packed.kernel == "cpu-int8-dot":
        fbias = None if bias is None else bias.to(torch.float32).contiguous()
        y = torch.ops.quiver_cpu.linear_int8_dot(x2.to(torch.float32).contiguous(), q, scales, offsets, fbias,
                                                 packed.out_features, packed.bits, packed.group_size)
        return y.to(x.dtype).reshape(*x.shape[:-1], packed.out_features)
    if x.dtype == torch.bfloat16 and x2.shape[0] not in FMA_ROWS and amx_available():
        x2 = x2.contiguous()
        y = torch.ops.quiver_cpu.linear_quant_amx(x2, q, scales, offsets, bias, packed.out_features, packed.bits,
                                                  packed.group_size)
        return y.reshape(*x.shape[:-1], packed.out_features)
    rows = x2.to(torch.float32).contiguous()
    fbias = None if bias is None else bias.to(torch.float32).contiguous()
    y = torch.ops.quiver_cpu.linear_quant(rows, q, scales, offsets, fbias, packed.out_features, packed.bits,
                                          packed.group_size)
    return y.to(x.dtype).reshape(*x.shape[:-1], packed.out_features)


def triton_linear(x: torch.Tensor, packed: TritonQuantWeight, bias: torch.Tensor | None = None,
                  config: LaunchConfig | GemvConfig | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(W)^T + bias -> [..., N] in x's dtype, float32 accumulation, on CUDA (or
    Triton's interpreter). A few rows run the multiply-add kernel (`quant_gemv_triton.preferred`:
    1 to 4 by the weight's scales), the others the dot kernel; a `LaunchConfig` pins the dot
    kernel, a `GemvConfig` the multiply-add one (tests, benchmarks)."""
    from quiver_server.kernels import quant_gemv_triton, quant_matmul_triton  # import triton

    k, n = packed.in_features, packed.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"activations must be float32, bfloat16 or float16, not {x.dtype}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape ({n},)")
    rows = x.reshape(-1, k)  # a view where the strides allow: the kernels take any strides
    m = rows.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    bias_arg = None if bias is None else bias.contiguous()
    if isinstance(config, quant_gemv_triton.GemvConfig) or (
            config is None and quant_gemv_triton.preferred(packed, m)):
        quant_gemv_triton.quant_gemv(rows, packed, bias_arg, y, config or quant_gemv_triton.GemvConfig())
    else:
        quant_matmul_triton.quant_matmul(rows, packed, bias_arg, y, config or quant_matmul_triton.LaunchConfig())
    return y.reshape(*x.shape[:-1], n)
