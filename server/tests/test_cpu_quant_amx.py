"""The AMX kernel for quantized matmuls of bfloat16 activations (`cpu/linear_quant_amx.cpp`, driven
by `quant_gemm.linear`) against float64 matmuls of the same bf16 x with the weight dequantized
as the kernel's rule says, re-derived here from q, scales and offsets: w = q * scale + offset per
group, the product and the sum each rounded in float32, then rounded to bfloat16 (what a bf16
model's dequantized weight is). 8 and 4 bits, with and without offsets, group sizes 16, 32, 128
and the whole row, inputs that are and are not multiples of the tiles' 32, outputs in partial
panels and tiles, every row path (up to 16 rows, 17-32, blocks of 32 past that, row chunks
past 512), bias or not.

Where the build or the CPU has no AMX-BF16 (`make test`'s QUIVER_CPU_ISA=avx2 run, an AVX2-only
CPU), the op must say it is unavailable and `quant_gemm.linear` must serve bf16 activations with
the float32 kernel; every case then runs through that path against its own rule (each weight one
float32 fused multiply-add, q * scale + offset, not rounded to bf16), so no case is skipped, and
`test_amx_is_there_exactly_where_it_can_be` holds the choice to what the build and the CPU say."""

from __future__ import annotations

import pytest
import torch

from quiver_server.kernels import cpu_ops, quant_gemm
from quiver_server.quant.weights import QuantizedWeight
from float_error import UNIT_ROUNDOFF, gamma
from quant_cases import random_weight

CPU = torch.device("cpu")
AMX_CPU_FLAGS = {"amx_tile", "amx_bf16", "avx512_bf16"}


def amx_expected() -> bool:
    """The AMX path is built into the AVX-512 kernels of a CPU with AMX-BF16 and AVX512-BF16
    (Linux grants the tiles on request from 5.16 on)."""
    _, flags = cpu_ops.cpu_model_and_flags()
    return cpu_ops.loaded_isa() == "avx512" and AMX_CPU_FLAGS <= flags


def amx_here() -> bool:
    return cpu_ops.available() and bool(torch.ops.quiver_cpu.quant_amx_available())


def bf16_weight(weight: QuantizedWeight) -> torch.Tensor:
    """The AMX kernel's weight, from the definition: float32 q * scale, float32 + offset, then bf16."""
    w = weight.q.to(torch.float32) * weight.scales.repeat_interleave(weight.group_size, dim=1)
    if weight.offsets is not None:
        w = w + weight.offsets.repeat_interleave(weight.group_size, dim=1)
    return w.to(torch.bfloat16)


def fma_weight(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 kernel's weight: q * scale + offset rounded once to float32 (a fused
    multiply-add), computed exactly in float64 first."""
    w = weight.q.double() * weight.scales.double().repeat_interleave(weight.group_size, dim=1)
    if weight.offsets is not None:
        w = w + weight.offsets.double().repeat_interleave(weight.group_size, dim=1)
    return w.float()


def kernel_weight(weight: QuantizedWeight) -> torch.Tensor:
    """The weight the bf16 product multiplies by on this build."""
    return bf16_weight(weight) if amx_here() else fma_weight(weight)


def amx(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    q, scales, offsets = quant_gemm.pack(weight, CPU, "cpu").data
    return torch.ops.quiver_cpu.linear_quant_amx(x, q, scales, offsets, bias, weight.out_features, weight.bits,
                                                 weight.group_size)


def bf16_product(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The product of bf16 activations on this build: the AMX op itself where it is built, else
    what `quant_gemm.linear` serves (the float32 kernel)."""
    if amx_here():
        return amx(x, weight, bias)
    return quant_gemm.linear(x, quant_gemm.pack(weight, CPU, "cpu"), bias)


def check(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
    w = kernel_weight(weight).double()
    want = x.double() @ w.T
    magnitude = x.double().abs() @ w.abs().T
    if bias is not None:
        want = want + bias.double()
        magnitude = magnitude + bias.double().abs()
    # Products of bf16 x and the kernel's weight (bf16, or float32 on the float32 kernel) are
    # rounded at most once in float32; their sum and the bias's (in + 1 terms) in float32 in any
    # order (float_error.py), then rounded to bf16: u |sum| <= u (|want| + that).
    u = UNIT_ROUNDOFF[torch.bfloat16]
    bound = gamma(weight.in_features + 1) * (1 + u) * magnitude + u * want.abs()
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() - bound).max()


def test_amx_is_there_exactly_where_it_can_be() -> None:
    assert cpu_ops.available()
    assert amx_here() == amx_expected() == quant_gemm.amx_available()
    if not amx_here():  # the op refuses rather than computing anything
        with pytest.raises(RuntimeError, match="unavailable"):
            amx(torch.zeros(4, 96, dtype=torch.bfloat16), random_weight(50, 96, 4, 32, True, seed=1), None)


# Groups: Q6_K's 16 (K = 80: a partial step of 32 inputs), GGUF's 32 (K = 608: 2 chunks of 256
# and a partial one), AWQ/GPTQ's 128, and the whole row (int8's: K = 80 and 512).
# Rows: 1 and 3 (tiles of that many rows), 16, 17 and 32 (two row tiles), 33, 100, 300 (blocks
# of 32 through the scratch, the last partial). Outputs: a part of one tile, 2 panels and a part.
@pytest.mark.parametrize("bits,offsets", [(8, False), (8, True), (4, True), (4, False)])
@pytest.mark.parametrize("group,inp", [(16, 80), (32, 608), (128, 256), (80, 80), (512, 512)])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 33, 100, 300])
@pytest.mark.parametrize("out", [5, 100])
def test_bf16_products_equal_float64_of_the_kernels_weight(bits, offsets, group, inp, rows, out) -> None:
    weight = random_weight(out, inp, bits, group, offsets, seed=rows + out + inp)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, inp, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out, generator=gen) if rows % 2 else None
    check(bf16_product(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("rows", [40, 600])
def test_many_panels_and_row_chunks_split_over_threads(rows) -> None:
    # 21 panels in groups over both threads; 600 rows: two chunks of rows.
    weight = random_weight(1000, 320, 4, 32, True, seed=rows)
    x = torch.randn(rows, 320).to(torch.bfloat16)
    bias = torch.randn(1000).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        for count in {1, 2, threads}:
            torch.set_num_threads(count)
            check(bf16_product(x, weight, bias), x, weight, bias)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bits,offsets", [(8, False), (8, True), (4, True)])
@pytest.mark.parametrize("inp,group", [(80, 16), (96, 96)])
def test_each_weight_is_rounded_as_the_rule_says(bits, offsets, inp, group) -> None:
    # Unit rows pick single weights: the outputs are the kernel's weights (rounded to bf16), bit for bit.
    weight = random_weight(70, inp, bits, group, offsets, seed=inp)
    for rows in (torch.eye(inp), torch.eye(inp)[:16], torch.eye(inp)[5:6]):
        x = rows.to(torch.bfloat16)
        want = x.float().mm(kernel_weight(weight).float().T).to(torch.bfloat16)
        assert torch.equal(bf16_product(x, weight, None), want)


def test_no_rows_and_strided_rows() -> None:
    weight = random_weight(50, 64, 8, 64, False, seed=2)
    assert bf16_product(torch.zeros(0, 64, dtype=torch.bfloat16), weight, None).shape == (0, 50)
    x = torch.randn(20, 128).to(torch.bfloat16)[:, :64]  # rows 128 apart
    check(bf16_product(x, weight, None), x, weight, None)


def test_linear_takes_amx_for_bf16_rows_but_fma_rows_and_the_float32_kernel_without_amx() -> None:
    weight = random_weight(100, 256, 4, 32, True, seed=3)
    packed = quant_gemm.pack(weight, CPU)
    q, scales, offsets = packed.data
    bias = torch.randn(100).to(torch.bfloat16)
    for rows in (1, 2, 3, 4, 5, 40):
        x = torch.randn(rows, 256)
        fma = torch.ops.quiver_cpu.linear_quant(x, q, scales, offsets, bias.float(), 100, 4, 32)
        # float32 activations keep the float32 kernel at any rows.
        assert torch.equal(quant_gemm.linear(x, packed, bias), fma)
        xb = x.to(torch.bfloat16)
        if rows in quant_gemm.FMA_ROWS or not amx_here():
            want = torch.ops.quiver_cpu.linear_quant(xb.float(), q, scales, offsets, bias.float(), 100, 4, 32)
            want = want.to(torch.bfloat16)
        else:
            want = amx(xb, weight, bias)
        assert torch.equal(quant_gemm.linear(xb, packed, bias), want)
        got3 = quant_gemm.linear(xb.reshape(1, rows, 256), packed, bias)
        assert got3.shape == (1, rows, 100) and torch.equal(got3[0], want)
