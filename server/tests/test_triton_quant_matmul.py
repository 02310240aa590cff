"""The Triton quantized projections (`kernels/quant_gemm.triton_linear` over the dot kernel
`quant_matmul_triton.py` and the multiply-add kernel `quant_gemv_triton.py`) against float64
matmuls of the dequantized weight, re-derived here from q, scales and offsets (w = q * scale +
offset per group), within an a-priori rounding bound: 8 and 4 bits, with and without offsets, every scale path
(groups of 16: per half-block; 32 and 128: per block; the whole row: per channel; groups that are
no multiple of 16: per element), 0 to 130 rows (decode and prefill tiles), N and K that are not
multiples of the blocks, float32/bfloat16/float16 activations, bias, split-K (and its counters
left at zero), strided and batched x; and the packed layout unpacked back into q.

Triton runs compiled on a GPU when there is one, else in Triton's CPU interpreter
(TRITON_INTERPRET=1, set by conftest.py before anything imports triton): tiny shapes.
"""

from __future__ import annotations

import os

import pytest
import torch
from float_error import FLOAT32_UNIT_ROUNDOFF, UNIT_ROUNDOFF, gamma

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # running this file alone, without conftest

from quiver_server.kernels import quant_gemm  # noqa: E402
from quiver_server.kernels import quant_gemv_triton  # noqa: E402
from quiver_server.kernels.quant_gemm import triton_linear  # noqa: E402
from quiver_server.kernels.quant_gemv_triton import GemvConfig  # noqa: E402
from quiver_server.kernels.quant_matmul_triton import LaunchConfig, launch_plan  # noqa: E402
from quiver_server.kernels.quant_triton_layout import TritonQuantWeight, pack_for_triton  # noqa: E402
from quiver_server.quant.weights import QuantizedWeight  # noqa: E402
from quant_cases import random_weight

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BITS_OFFSETS = [(8, False), (8, True), (4, True), (4, False)]
# (group, K): groups of 16 (Q6_K), 32 (GGUF's Q8_0/Q4_*), 128 (AWQ/GPTQ/--quantize int4) and the
# whole row (--quantize int8), K past the 128-value padding in each.
GROUPS = [(16, 144), (32, 96), (128, 256), (80, 80)]


def dequantized(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, |q * scale| + |offset|) [N, K] in float64, from the definition."""
    group = weight.group_size
    product = weight.q.double() * weight.scales.double().repeat_interleave(group, dim=1)
    offset = torch.zeros_like(product)
    if weight.offsets is not None:
        offset = weight.offsets.double().repeat_interleave(group, dim=1)
    return product + offset, product.abs() + offset.abs()


def check(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None,
          packed: TritonQuantWeight, config: LaunchConfig | GemvConfig | None = None) -> None:
    """The bound, for any evaluation order: every term of y (x_k q_k s_g, x_k o_g, the bias) meets
    at most two roundings of a product (x * q, unless exact, then the scale; or sum(x) times the
    offset; or the per-element w = q * s + o and x * w) and fewer than 2K additions, so
    |error| <= gamma(2K + 2) * sum |terms| (Higham, Lemma 3.1). The unit is float32's for float32
    x (IEEE dots) and twice that for 16-bit x (tensor cores may truncate their sums). Where the
    plan rounds each weight to x's dtype (16-bit prefill tiles), that adds a whole ulp of it per
    term. 16-bit y adds its own rounding, a whole ulp too (the interpreter truncates), and the
    spacing of the dtype's subnormals."""
    w, magnitude_w = dequantized(weight)
    x64 = x.double().cpu()
    exact = x64 @ w.T
    magnitude = x64.abs() @ magnitude_w.T
    if bias is not None:
        exact = exact + bias.double().cpu()
        magnitude = magnitude + bias.double().cpu().abs()
    unit = FLOAT32_UNIT_ROUNDOFF * (1 if x.dtype == torch.float32 else 2)
    bound = gamma(2 * weight.in_features + 2, unit) * magnitude
    if x.dtype != torch.float32:
        u_out = UNIT_ROUNDOFF[x.dtype]
        dot_config = LaunchConfig() if config is None else config
        plan = None
        if x.shape[0] and isinstance(dot_config, LaunchConfig):
            plan = launch_plan(x.shape[0], packed, x.dtype, DEVICE, dot_config)
        if plan is not None and plan.weights_in_x:
            bound = bound + 2 * u_out * magnitude
        bound = bound + 2 * u_out * (exact.abs() + bound) + torch.finfo(x.dtype).tiny * 2 * u_out
    assert got.shape == exact.shape and got.dtype == x.dtype
    error = (got.double().cpu() - exact).abs()
    assert (error <= bound).all(), f"max error over bound {(error / bound).max():.3g}"


def unpack(packed: TritonQuantWeight) -> torch.Tensor:
    """q [N, K] back from the documented layout, checking that the padding holds zeros."""
    n, k, tile = packed.out_features, packed.in_features, packed.tile_k
    table = packed.q.cpu()
    if packed.bits == 4:
        blocks = table.view(-1, tile, table.shape[1])  # [block, j, n]: k = 2 tile block + j (+ tile)
        table = torch.stack([blocks & 15, blocks >> 4], dim=1).reshape(-1, table.shape[1])
    assert not table[k:].any() and not table[:, n:].any(), "padding must be zero"
    return table[:k, :n].T


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 3, 17, 64])
@pytest.mark.parametrize("group,inp", GROUPS)
@pytest.mark.parametrize("bits,offsets", BITS_OFFSETS)
def test_triton_linear_equals_float64_of_the_dequantized_weight(bits, offsets, group, inp, rows, dtype) -> None:
    out = 130  # 3 tiles of 64 columns, 2 of 128: the last one partial
    weight = random_weight(out, inp, bits, group, offsets, seed=rows + inp + bits)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, inp, generator=gen).to(dtype)
    bias = torch.randn(out, generator=gen).to(dtype) if rows % 2 else None
    packed = pack_for_triton(weight, DEVICE)
    got = triton_linear(x.to(DEVICE), packed, None if bias is None else bias.to(DEVICE))
    check(got, x, weight, bias, packed)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_tiles_of_128_rows(bits, dtype) -> None:
    weight = random_weight(200, 128, bits, 32, True, seed=11)
    x = torch.randn(130, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    packed = pack_for_triton(weight, DEVICE)
    check(triton_linear(x.to(DEVICE), packed, None), x, weight, None, packed)


@pytest.mark.parametrize("bits,offsets", BITS_OFFSETS)
@pytest.mark.parametrize("group", [16, 32, 128, 384])
@pytest.mark.parametrize("rows,splits", [(1, 2), (5, 3), (17, 3)])
def test_split_k_sums_every_split_and_resets_its_counters(bits, offsets, group, rows, splits) -> None:
    inp = 384  # three iterations of 128: splits of 2 + 1 or 1 + 1 + 1
    weight = random_weight(70, inp, bits, group, offsets, seed=group + rows)
    gen = torch.Generator().manual_seed(splits)
    x = torch.randn(rows, inp, generator=gen).to(torch.bfloat16 if rows == 5 else torch.float32)
    bias = torch.randn(70, generator=gen).to(x.dtype)
    packed = pack_for_triton(weight, DEVICE)
    config = LaunchConfig(split_k=splits)
    got = triton_linear(x.to(DEVICE), packed, bias.to(DEVICE), config)
    check(got, x, weight, bias, packed, config)
    assert not packed.counters.any(), "the last split of each tile resets its counter"
    again = triton_linear(x.to(DEVICE), packed, bias.to(DEVICE), config)
    assert torch.equal(got, again), "partials are summed in split order whatever the arrival order"


GEMV_CONFIGS = [
    GemvConfig(),
    GemvConfig(magic=False),
    GemvConfig(split_k=3),  # K of 384 in blocks of 32 to 128 values: uneven splits
    GemvConfig(block_n=32, block_r=8, num_warps=8, num_stages=3),
    GemvConfig(scale_after=True, split_k=2),  # block scales on the block's sums
]


@pytest.mark.parametrize("config", GEMV_CONFIGS, ids=["plan", "plain-convert", "split3", "narrow", "scale-after"])
@pytest.mark.parametrize("group", [32, 128, 384])
@pytest.mark.parametrize("bits,offsets", BITS_OFFSETS)
def test_gemv_for_one_to_four_rows(bits, offsets, group, config) -> None:
    """The multiply-add kernel (`quant_gemv_triton`): every row count it takes, each dtype, bias,
    N past the last tile, K split into uneven parts (the counters reset), both conversions."""
    inp, out = 384, 70
    weight = random_weight(out, inp, bits, group, offsets, seed=group + bits)
    packed = pack_for_triton(weight, DEVICE)
    gen = torch.Generator().manual_seed(group)
    for rows in range(1, quant_gemv_triton.MAX_ROWS + 1):
        dtype = DTYPES[rows % len(DTYPES)]
        x = torch.randn(rows, inp, generator=gen).to(dtype)
        bias = torch.randn(out, generator=gen).to(dtype) if rows % 2 else None
        got = triton_linear(x.to(DEVICE), packed, None if bias is None else bias.to(DEVICE), config)
        check(got, x, weight, bias, packed, config)
    assert not packed.counters.any(), "the last split of each tile resets its counter"


def test_a_few_rows_take_the_gemv_where_it_is_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-channel int8 at 1 row, groups of 128 up to 2 rows, groups of 32 up to 4; groups of 16
    (per-half scales) never: the dot kernel serves the rest."""
    calls = []
    real = quant_gemv_triton.quant_gemv
    monkeypatch.setattr(quant_gemv_triton, "quant_gemv", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    weights = {name: pack_for_triton(random_weight(20, 256, bits, group, True, seed=9), DEVICE)
               for name, bits, group in [("channel", 8, 256), ("g128", 4, 128), ("g32", 4, 32), ("g16", 4, 16)]}
    taken = {}
    for name, packed in weights.items():
        calls.clear()
        for rows in (1, 2, 3, 4, 5):
            triton_linear(torch.randn(rows, 256, device=DEVICE), packed)
        taken[name] = list(calls)
    assert taken == {"channel": [1], "g128": [1, 2], "g32": [1, 2, 3, 4], "g16": []}


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group,inp", [(8, 24), (40, 120)])
def test_groups_that_are_no_multiple_of_16_dequantize_per_element(bits, group, inp) -> None:
    weight = random_weight(33, inp, bits, group, True, seed=group)
    packed = pack_for_triton(weight, DEVICE)
    assert packed.scale_mode == 3  # PER_ELEMENT
    for dtype in DTYPES:
        x = torch.randn(5, inp, generator=torch.Generator().manual_seed(group)).to(dtype)
        check(triton_linear(x.to(DEVICE), packed, None), x, weight, None, packed)


def test_odd_in_features_with_a_whole_row_group() -> None:
    weight = random_weight(9, 45, 8, 45, False, seed=3)
    x = torch.randn(2, 45, generator=torch.Generator().manual_seed(3))
    packed = pack_for_triton(weight, DEVICE)
    check(triton_linear(x.to(DEVICE), packed, None), x, weight, None, packed)


def test_views_and_leading_dimensions() -> None:
    weight = random_weight(40, 64, 4, 32, True, seed=4)
    packed = pack_for_triton(weight, DEVICE)
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    for view in (x[::2, :64], x[:, ::2], x[torch.tensor([3, 7, 19]), 64:], x[:, :64].reshape(4, 5, 64)):
        got = triton_linear(view, packed, None)
        assert got.shape == (*view.shape[:-1], 40)
        check(got.reshape(-1, 40), view.reshape(-1, 64), weight, None, packed)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group,inp", GROUPS + [(8, 24)])
def test_packed_layout_round_trips(bits, group, inp) -> None:
    weight = random_weight(70, inp, bits, group, True, seed=inp)
    packed = pack_for_triton(weight, DEVICE)
    assert packed.q.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert packed.q.shape[0] == (1 if bits == 8 else 0.5) * -(-inp // 128) * 128
    assert torch.equal(unpack(packed), weight.q)
    assert packed.offsets is not None and weight.offsets is not None
    assert torch.equal(packed.scales.cpu().float()[:, :70].T, weight.scales)
    assert torch.equal(packed.offsets.cpu().float()[:, :70].T, weight.offsets)


def test_scales_are_stored_16_bit_only_where_that_is_exact() -> None:
    weight = random_weight(70, 64, 4, 32, True, seed=5)
    exact16 = weight.scales.half().float()  # Q4_1: float16 d, and m = -8 d (exact too)
    as_gguf = QuantizedWeight(4, weight.q, exact16, -8 * exact16, 32)
    packed = pack_for_triton(as_gguf, DEVICE)
    assert packed.scales.dtype == torch.float16 and packed.offsets is not None
    assert packed.offsets.dtype == torch.float16
    assert packed.scales.nbytes < pack_for_triton(weight, DEVICE).scales.nbytes
    assert pack_for_triton(weight, DEVICE).scales.dtype == torch.float32  # random float32 scales
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    check(triton_linear(x.to(DEVICE), packed, None), x, as_gguf, None, packed)


def test_quant_gemm_dispatches_to_triton() -> None:
    weight = random_weight(24, 64, 8, 64, False, seed=6)
    packed = quant_gemm.pack(weight, DEVICE, "triton")
    assert isinstance(packed.data, TritonQuantWeight)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(6))
    check(quant_gemm.linear(x.to(DEVICE), packed, None), x, weight, None, packed.data)


def test_bad_input_raises() -> None:
    packed = pack_for_triton(random_weight(8, 32, 8, 32, False, seed=7), DEVICE)
    with pytest.raises(ValueError, match="input features"):
        triton_linear(torch.randn(2, 16, device=DEVICE), packed)
    with pytest.raises(ValueError, match="activations"):
        triton_linear(torch.randn(2, 32, device=DEVICE).double(), packed)
    with pytest.raises(ValueError, match="bias"):
        triton_linear(torch.randn(2, 32, device=DEVICE), packed, torch.randn(7, device=DEVICE))


def test_no_launch_reads_a_device_value_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Grids and blocks come from shapes: the launch can be captured in a CUDA graph. On a GPU,
    CUDA's sync debug mode errors on a synchronising call; on CPU, reading a value fails here."""
    packed = pack_for_triton(random_weight(40, 256, 4, 32, True, seed=8), DEVICE)
    x = torch.randn(3, 256, device=DEVICE)

    def launch_all() -> None:
        triton_linear(x, packed, None)
        triton_linear(x, packed, None, LaunchConfig(split_k=2))

    if DEVICE.type == "cuda":
        launch_all()  # compile first: the first launch of a kernel may synchronise
        torch.cuda.set_sync_debug_mode("error")
        try:
            launch_all()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return

    def host_read(*args: object, **kwargs: object) -> None:
        raise AssertionError("a launch read a tensor's value on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    launch_all()
