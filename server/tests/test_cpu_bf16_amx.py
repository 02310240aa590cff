"""bfloat16 weights packed for AMX (`cpu_gemm.amx_tiles`, `cpu/linear_bf16_amx.cpp`) against
float64 matmuls of the same bfloat16 values, within the rounding a float32 sum allows: inputs
that are and are not multiples of the tiles' 32, outputs in partial tiles and panels, every row
path (up to 16 rows, 17-32, blocks of 32 past that, several row items over the threads), bias or
not; and the layout itself, bit for bit, with unit rows that pick single weights.

Where the build or the CPU has no AMX-BF16 (`make test`'s QUIVER_CPU_ISA=avx2 run, an AVX2-only
CPU), bfloat16 weights are not packed and `Linear` serves them with `F.linear`: every case then
runs that path against the same bound, so none is skipped, and
`test_bf16_weights_pack_exactly_where_amx_is` holds the choice to what the build and CPU say."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from float_error import UNIT_ROUNDOFF, gamma
from test_cpu_quant_amx import amx_expected

from quiver_server.kernels import cpu_gemm, cpu_ops
from quiver_server.kernels.ops import select_ops
from quiver_server.layers.linear import Linear

CPU = torch.device("cpu")


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What a bfloat16 `Linear` computes on this build: the packed AMX op, else F.linear."""
    layer = Linear(weight.shape[1], {"proj": weight.shape[0]}, bias is not None, select_ops(CPU)).to(torch.bfloat16)
    layer.load_part("proj", "weight", weight)
    if bias is not None:
        layer.load_part("proj", "bias", bias)
    assert layer.pack_weight() == amx_expected()
    return layer(x, None)  # type: ignore[arg-type]


def check(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    want = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        want = want + bias.double()
        magnitude = magnitude + bias.double().abs()
    # bf16 x bf16 products are exact in float32; their sum and the bias (in + 1 terms) are
    # rounded in float32 in any order (float_error.py), then the result to bf16.
    u = UNIT_ROUNDOFF[torch.bfloat16]
    bound = gamma(weight.shape[1] + 1) * magnitude + u * want.abs()
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() - bound).max()


def test_bf16_weights_pack_exactly_where_amx_is() -> None:
    assert cpu_ops.available()
    weight = torch.randn(50, 96).to(torch.bfloat16)
    assert cpu_gemm.amx_bf16_available() == cpu_gemm.available(weight) == amx_expected()
    if not amx_expected():  # neither the packing nor the op computes anything
        with pytest.raises(RuntimeError, match="AMX"):
            cpu_gemm.pack(weight)
        with pytest.raises(RuntimeError, match="unavailable"):
            torch.ops.quiver_cpu.linear_bf16_amx(torch.zeros(4, 96, dtype=torch.bfloat16),
                                                 torch.zeros(2, 3, 3, 16, 32, dtype=torch.bfloat16), None, 50)


# Inputs: 80 (a partial step of 32), 576 (the demo model's), 608 (2 chunks of 256 and a partial
# one). Rows: 1 and 3 (tiles of that many rows), 16, 17 and 32 (two row tiles), 33, 100, 300
# (blocks of 32, the last partial). Outputs: a part of one tile, 2 panels and a part, 21 panels.
@pytest.mark.parametrize("inp", [80, 576, 608])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 33, 100, 300])
@pytest.mark.parametrize("out", [5, 100, 1000])
def test_products_equal_float64_of_the_same_bf16_values(inp, rows, out) -> None:
    gen = torch.Generator().manual_seed(rows * out + inp)
    weight = torch.randn(out, inp, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, inp, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out, generator=gen).to(torch.bfloat16) if rows % 2 else None
    check(product(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("rows", [40, 600])
def test_rows_and_panels_split_over_threads(rows) -> None:
    weight = torch.randn(1000, 320).to(torch.bfloat16)
    x = torch.randn(rows, 320).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        for count in {1, 2, threads}:
            torch.set_num_threads(count)
            check(product(x, weight, None), x, weight, None)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("out,inp", [(70, 80), (100, 96)])
def test_the_layout_puts_every_weight_in_its_place(out, inp) -> None:
    # Unit rows pick single weights: the outputs are the weights, bit for bit (one term per sum).
    weight = torch.randn(out, inp).to(torch.bfloat16)
    for rows in (torch.eye(inp), torch.eye(inp)[:16], torch.eye(inp)[5:6]):
        x = rows.to(torch.bfloat16)
        assert torch.equal(product(x, weight, None), x.float().mm(weight.float().T).to(torch.bfloat16))


def test_no_rows_strided_rows_and_leading_dims() -> None:
    weight = torch.randn(50, 64).to(torch.bfloat16)
    assert product(torch.zeros(0, 64, dtype=torch.bfloat16), weight, None).shape == (0, 50)
    x = torch.randn(20, 128).to(torch.bfloat16)[:, :64]  # rows 128 apart
    check(product(x, weight, None), x, weight, None)
    got = product(x.reshape(4, 5, 64), weight, None)
    assert got.shape == (4, 5, 50) and torch.equal(got.reshape(20, 50), product(x, weight, None))


def test_float16_and_disabled_packing_stay_plain(monkeypatch) -> None:
    assert not cpu_gemm.available(torch.randn(8, 8).to(torch.float16))
    monkeypatch.setenv("QUIVER_CPU_PACKED_WEIGHTS", "0")
    weight = torch.randn(8, 32).to(torch.bfloat16)
    assert not cpu_gemm.available(weight)
    x = torch.randn(3, 32).to(torch.bfloat16)
    layer = Linear(32, {"proj": 8}, False, select_ops(CPU)).to(torch.bfloat16)
    layer.load_part("proj", "weight", weight)
    assert not layer.pack_weight()
    assert torch.equal(layer(x, None), F.linear(x, weight))  # type: ignore[arg-type]
