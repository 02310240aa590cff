"""The 8-bit-activation quantized matmul (`--quantize-activations int8`: `kernels/quant_gemm.py`'s
"cpu-int8-dot", `cpu/linear_int8_dot.cpp`) against float64 of its documented definition,
re-derived here: each row of x rounded in blocks of 32 inputs to a = round(x * (127 / max|x|))
(both float32 operations, ties to even), d = max|x| / 127, and

    y = sum over blocks of  d * (s * (q . a)  +  o * sum(a))   (+ bias)

with the weight's q, scale s and offset o of the block's group: the rounded x times the weight.
The integer dot products are exact, so any wrong byte of `a` (a rounding off by one) shows as an
error of about s * d * |q|, hundreds of times the float32 bound the test allows. Every row block
(AVX-512: 4, 2, 1; AVX2: 2, 1), prefill chunks, last panels of a few columns, per-row and grouped
scales, offsets, bias, 16-bit activations. `make test` runs this file once per vector ISA the
host has (the AVX-512 build with VNNI where the CPU has it; the AVX2 build multiplies with
vpmaddubsw instead)."""

from __future__ import annotations

import pytest
import torch

from quiver_server.kernels import cpu_ops, quant_gemm
from quiver_server.kernels.ops import CpuKernelOps, select_ops
from quiver_server.quant.quantize import QuantizeSpec
from quiver_server.quant.weights import QuantizedWeight
from float_error import FLOAT32_UNIT_ROUNDOFF, UNIT_ROUNDOFF, gamma
from quant_cases import random_weight

CPU = torch.device("cpu")
BLOCK = 32


def weight_for_int8_inputs(out: int, inp: int, bits: int, group: int, offsets: bool, seed: int) -> QuantizedWeight:
    """random_weight with 8-bit values in [-127, 127], the range int8 quantizers produce."""
    weight = random_weight(out, inp, bits, group, offsets, seed)
    if bits == 8:
        weight = QuantizedWeight(8, weight.q.clamp(-127, 127), weight.scales, weight.offsets, group)
    return weight


def expected(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, an error bound) in float64 from the definition above."""
    rows, k = x.shape
    blocks = x.float().view(rows, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    a = torch.round(blocks * inverse).double()
    d = (amax / 127.0).double().squeeze(2)  # [rows, blocks]

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [out, groups] -> [out, blocks]
        return t.double().repeat_interleave(weight.group_size // BLOCK, dim=1)

    s = per_block(weight.scales)
    q = weight.q.double().view(weight.out_features, k // BLOCK, BLOCK)
    terms = torch.einsum("rbk,obk->rob", a, q) * d[:, None, :] * s[None]
    y = terms.sum(2)
    magnitude = terms.abs().sum(2)
    if weight.offsets is not None:
        sums = a.sum(2) * d  # [rows, blocks]: d * sum(a), rounded once to float32 by the kernel
        offset_terms = sums[:, None, :] * per_block(weight.offsets)[None]
        y = y + offset_terms.sum(2)
        magnitude = magnitude + offset_terms.abs().sum(2)
    if bias is not None:
        y = y + bias.double()
        magnitude = magnitude + bias.double().abs()
    # float32: a block's s * d (or d * sum(a)), its product with the exact sum, the sum over
    # blocks (+ offsets, bias) in any order; then the result stored in x's dtype.
    u_out = UNIT_ROUNDOFF[x.dtype]
    bound = (gamma(2 * (k // BLOCK) + BLOCK + 4) + FLOAT32_UNIT_ROUNDOFF) * magnitude + u_out * y.abs()
    return y, bound


def check(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
    want, bound = expected(x.float(), weight, bias)
    if x.dtype != torch.float32:  # x widened exactly, the result rounded to x's dtype
        bound = bound + UNIT_ROUNDOFF[x.dtype] * want.abs()
    assert got.shape == want.shape and got.dtype == x.dtype
    assert ((got.double() - want).abs() <= bound).all(), (got.double() - want).abs().max()


def test_the_kernel_is_built_here() -> None:
    assert cpu_ops.available()
    # The AVX-512 build multiplies with VNNI exactly where the CPU has it.
    _, flags = cpu_ops.cpu_model_and_flags()
    vnni = cpu_ops.loaded_isa() == "avx512" and "avx512_vnni" in flags or "avx_vnni" in flags
    assert bool(torch.ops.quiver_cpu.int8_dot_vnni()) == vnni


@pytest.mark.parametrize("bits,offsets", [(8, False), (8, True), (4, True), (4, False)])
@pytest.mark.parametrize("group,inp", [(32, 96), (64, 128), (128, 256), (96, 96)])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 7, 300])
@pytest.mark.parametrize("out", [1, 50, 100])
def test_int8_inputs_times_quantized_weight_equals_float64_of_the_definition(bits, offsets, group, inp, rows, out):
    weight = weight_for_int8_inputs(out, inp, bits, group, offsets, seed=rows + out)
    gen = torch.Generator().manual_seed(inp + rows)
    x = torch.randn(rows, inp, generator=gen) * torch.rand(inp, generator=gen) * 4  # uneven block ranges
    bias = torch.randn(out, generator=gen) if out == 50 else None
    check(quant_gemm.linear(x, quant_gemm.pack(weight, CPU, "cpu-int8-dot"), bias), x, weight, bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_activations_come_back_in_their_dtype(dtype) -> None:
    weight = weight_for_int8_inputs(70, 128, 4, 32, True, seed=3)
    x = torch.randn(9, 128).to(dtype)
    check(quant_gemm.linear(x, quant_gemm.pack(weight, CPU, "cpu-int8-dot"), None), x, weight, None)


def test_views_leading_dimensions_and_zero_blocks() -> None:
    weight = weight_for_int8_inputs(40, 64, 8, 64, False, seed=4)
    packed = quant_gemm.pack(weight, CPU, "cpu-int8-dot")
    x = torch.randn(20, 64)
    x[2, :32] = 0  # a block of zeros: d = 0, no division by it
    x[5] = 0
    for view in (x[torch.tensor([2, 5, 19])], x[::2], x.reshape(4, 5, 64)):
        got = quant_gemm.linear(view, packed, None)
        assert got.shape == (*view.shape[:-1], 40)
        check(got.reshape(-1, 40), view.reshape(-1, 64), weight, None)
    assert (quant_gemm.linear(x[5:6], packed, None) == 0).all()


def test_the_quantizers_weights_go_through_and_rounding_the_inputs_changes_the_product() -> None:
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(96, 256, generator=gen)
    x = torch.randn(5, 256, generator=gen)
    for method in ("int8", "int4"):
        quantized = QuantizeSpec(method).apply(w)
        got = quant_gemm.linear(x, quant_gemm.pack(quantized, CPU, "cpu-int8-dot"), None)
        check(got, x, quantized, None)
        float_inputs = quant_gemm.linear(x, quant_gemm.pack(quantized, CPU, "cpu"), None)
        # The inputs really are rounded: the product moves by about 1/254 of its terms' size.
        assert (got - float_inputs).abs().max() > 1e-3


def test_weights_outside_whole_blocks_or_with_int8_minus_128_keep_float_inputs() -> None:
    odd_width = weight_for_int8_inputs(8, 48, 4, 16, True, seed=7)
    full_range = random_weight(8, 64, 8, 64, False, seed=8)
    full_range.q[3, 5] = -128
    ops = CpuKernelOps(CPU, "cpu", packed_matmul="quiver", quantized_activations="int8")
    for weight in (odd_width, full_range):
        assert not quant_gemm.int8_dot_fits(weight)
        with pytest.raises(ValueError, match="whole blocks of 32"):
            quant_gemm.pack(weight, CPU, "cpu-int8-dot")
        assert ops.pack_quantized(weight).kernel == "cpu"
    assert ops.pack_quantized(weight_for_int8_inputs(8, 64, 8, 64, False, seed=9)).kernel == "cpu-int8-dot"


def test_int8_activations_are_refused_without_the_cpu_kernels() -> None:
    with pytest.raises(ValueError, match="C\\+\\+ CPU kernels only"):
        select_ops(torch.device("cuda"), "int8")
    with pytest.raises(ValueError, match="int4"):
        select_ops(CPU, "int4")
    with pytest.raises(ValueError, match="needs quantized projections"):
        quant_gemm.check_int8_activations([quant_gemm.pack(weight_for_int8_inputs(8, 48, 4, 16, True, 1), CPU, "cpu")])
