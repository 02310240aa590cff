"""Quantized matmuls on CPU (`kernels/quant_gemm.py`: the C++ kernel `cpu/linear_quant.cpp`, and
the torch fallback that dequantizes per product) against float64 matmuls of the dequantized
weight, re-derived here from q, scales and offsets (w = q * scale + offset per group): 8 and 4
bits, with and without offsets, every group size the formats use (16: Q6_K, 32: GGUF's Q8_0/Q4_*,
128: AWQ/GPTQ/--quantize int4, the whole row: --quantize int8), every micro-kernel row block and
the prefill chunking, last panels of a few columns, bias, 16-bit activations. `make test` runs
this file once per vector ISA the host has (AVX-512 and AVX2)."""

from __future__ import annotations

import pytest
import torch

from quiver_server.kernels import cpu_ops, quant_gemm
from quiver_server.quant.quantize import DEFAULT_INT4_GROUP, QuantizeSpec
from quiver_server.quant.weights import QuantizedWeight
from float_error import FLOAT32_UNIT_ROUNDOFF, UNIT_ROUNDOFF, gamma
from quant_cases import random_weight

CPU = torch.device("cpu")
KERNELS = ["cpu", "torch"]


def exact(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, |q * scale| + |offset|) in float64, from the definition."""
    scale = weight.scales.double().repeat_interleave(weight.group_size, dim=1)
    product = weight.q.double() * scale
    offset = torch.zeros_like(product)
    if weight.offsets is not None:
        offset = weight.offsets.double().repeat_interleave(weight.group_size, dim=1)
    return product + offset, product.abs() + offset.abs()


def check(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
    w, magnitude_w = exact(weight)
    want = x.double() @ w.T
    magnitude = x.double().abs() @ magnitude_w.T
    if bias is not None:
        want = want + bias.double()
        magnitude = magnitude + bias.double().abs()
    # Each weight rounded once or twice (q * scale, + offset) in float32 — and, for 16-bit x, to
    # x's dtype where the torch fallback multiplies in it —, then a float32 dot in any order
    # (float_error.py), then the result stored in x's dtype.
    u_out = UNIT_ROUNDOFF[x.dtype]
    weight_rounding = 0.0 if x.dtype == torch.float32 else u_out
    bound = (gamma(weight.in_features + 3) + FLOAT32_UNIT_ROUNDOFF + weight_rounding) * magnitude + u_out * want.abs()
    assert got.shape == want.shape and got.dtype == x.dtype
    assert ((got.double() - want).abs() <= bound).all(), (got.double() - want).abs().max()


def test_the_kernel_is_built_here() -> None:
    # Without this, the "cpu" cases would fail to pack rather than say why.
    assert cpu_ops.available() and quant_gemm.default_kernel(CPU) == "cpu"


# Rows: every row block (AVX-512: 6, 4, 2, 1; AVX2: 4, 2, 1) and prefill chunks (over 256 rows).
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bits,offsets", [(8, False), (8, True), (4, True), (4, False)])
@pytest.mark.parametrize("group,inp", [(16, 64), (32, 96), (128, 256), (80, 80)])
@pytest.mark.parametrize("rows", [0, 1, 3, 7, 13, 300])
@pytest.mark.parametrize("out", [1, 50, 100])
def test_quantized_linear_equals_float64_of_the_dequantized_weight(kernel, bits, offsets, group, inp, rows, out):
    weight = random_weight(out, inp, bits, group, offsets, seed=rows + out)
    gen = torch.Generator().manual_seed(inp)
    x = torch.randn(rows, inp, generator=gen)
    bias = torch.randn(out, generator=gen) if out == 50 else None
    check(quant_gemm.linear(x, quant_gemm.pack(weight, CPU, kernel), bias), x, weight, bias)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_activations_come_back_in_their_dtype(kernel, dtype) -> None:
    weight = random_weight(70, 128, 4, 32, True, seed=3)
    x = torch.randn(9, 128).to(dtype)
    check(quant_gemm.linear(x, quant_gemm.pack(weight, CPU, kernel), None), x, weight, None)


@pytest.mark.parametrize("kernel", KERNELS)
def test_views_and_leading_dimensions(kernel) -> None:
    weight = random_weight(40, 64, 8, 32, False, seed=4)
    packed = quant_gemm.pack(weight, CPU, kernel)
    x = torch.randn(20, 64)
    for view in (x[torch.tensor([3, 7, 19])], x[::2], x.reshape(4, 5, 64)):
        got = quant_gemm.linear(view, packed, None)
        assert got.shape == (*view.shape[:-1], 40)
        check(got.reshape(-1, 40), view.reshape(-1, 64), weight, None)


def test_quantize_then_multiply_is_the_quantizers_own_dequantized_product() -> None:
    # --quantize's output through the kernel: the same numbers as its dequantized float weight.
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(96, 256, generator=gen)
    x = torch.randn(5, 256, generator=gen)
    # int8: the whole row; int4: --quantize-group-size's default.
    for method, group in (("int8", 256), ("int4", DEFAULT_INT4_GROUP)):
        quantized = QuantizeSpec(method).apply(w)
        assert quantized.group_size == group
        check(quant_gemm.linear(x, quant_gemm.pack(quantized, CPU), None), x, quantized, None)


def test_odd_group_sizes_are_refused_by_the_cpu_kernel() -> None:
    weight = random_weight(8, 15, 8, 15, False, seed=7)
    with pytest.raises(ValueError, match="even group"):
        quant_gemm.pack(weight, CPU, "cpu")
