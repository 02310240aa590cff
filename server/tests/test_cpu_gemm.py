"""Prepacked CPU matmuls (`kernels/cpu_gemm.py`, quiver's `cpu/linear.cpp` and oneDNN's): the
same products as `F.linear`, and a CPU float32 model really runs on quiver's (so the parity tests
against transformers cover it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quiver_server.kernels import cpu_gemm, cpu_ops
from quiver_server.layers.linear import Linear
from quiver_server.models import load_model
from quiver_server.weights import load_config
from test_cpu_quant_amx import amx_expected
from float_error import linear_error_bound
from tiny_models import build_tiny_model


KERNELS = ["quiver", "onednn"]


def test_packing_is_available_on_this_torch() -> None:
    # Without this, every test below would quietly compare F.linear with itself.
    assert cpu_gemm.available(torch.empty(4, 4))
    assert cpu_ops.available() and cpu_gemm.pack(torch.empty(4, 4)).kernel == "quiver"


# Rows: every micro-kernel block (AVX-512: 8, 4, 2, 1 rows; AVX2: 6, 4, 2, 1) and the prefill
# chunking (over 256 rows).
# Shapes: whole panels, a last panel of a few columns, a single output, odd inner sizes.
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 7, 11, 15, 32, 33, 300])
@pytest.mark.parametrize("shape", [(96, 80), (100, 37), (1, 5), (530, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(kernel, rows, shape, with_bias) -> None:
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    got = cpu_gemm.linear(x, cpu_gemm.pack(weight, kernel), bias)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # Any float32 summation order stays within the dot products' a-priori bound (float_error.py).
    assert ((got.double() - want).abs() <= linear_error_bound(x, weight, bias)).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_packed_linear_takes_row_subsets_views_and_batches(kernel) -> None:
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 48, generator=gen)
    x = torch.randn(20, 48, generator=gen)
    rows = torch.tensor([3, 7, 19])
    packed = cpu_gemm.pack(weight, kernel)
    for view in (x[rows], x[::2], x[:, :48], x.reshape(4, 5, 48), x[:0]):
        got = cpu_gemm.linear(view, packed, None)
        assert got.shape == (*view.shape[:-1], 64)
        error = (got.double() - F.linear(view.double(), weight.double())).abs()
        assert (error <= linear_error_bound(view, weight)).all()


def test_quiver_packed_linear_refuses_what_does_not_fit() -> None:
    packed = cpu_gemm.pack(torch.randn(64, 48), "quiver")
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.quiver_cpu.linear_packed(torch.randn(3, 40), packed.data, None, 64)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.quiver_cpu.linear_packed(torch.randn(3, 48), packed.data, torch.randn(63), 64)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.quiver_cpu.linear_packed(torch.randn(3, 48, dtype=torch.float64), packed.data, None, 64)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.quiver_cpu.pack_linear_weight(torch.randn(64, 48, dtype=torch.bfloat16))


def _load(tmp_path, dtype=torch.float32, tie=False):
    path = build_tiny_model(tmp_path / "m", "qwen2", tie_word_embeddings=tie)  # qwen2: q/k/v bias
    return load_model(path, load_config(path), dtype, torch.device("cpu"))


@pytest.mark.parametrize("tie", [False, True])
def test_a_cpu_float32_model_serves_on_packed_weights(tmp_path, tie) -> None:
    model = _load(tmp_path, tie=tie)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight is not None and m.weight is None for m in linears)
    assert all(m.packed_weight.kernel == "quiver" for m in linears)
    assert model.lm_head_packed is not None and model.lm_head_packed.kernel == "quiver"
    # A tied head keeps the embedding table the lookup needs; an untied one keeps no plain copy.
    if tie:
        assert model.model.embed_tokens.weight is not None
    else:
        assert model.lm_head.weight is None
    with pytest.raises(RuntimeError, match="packed"):
        linears[0].load_part(next(iter(linears[0].parts)), "weight", torch.zeros(1))


def test_other_dtypes_and_the_switch_keep_plain_weights(tmp_path, monkeypatch) -> None:
    model = _load(tmp_path, dtype=torch.float16)
    assert all(m.packed_weight is None and m.weight is not None
               for m in model.modules() if isinstance(m, Linear))
    # bfloat16 weights pack for the AMX kernel exactly where it runs (test_cpu_bf16_amx.py).
    model = _load(tmp_path / "bf16", dtype=torch.bfloat16)
    assert all((m.packed_weight is not None) == amx_expected() for m in model.modules() if isinstance(m, Linear))
    monkeypatch.setenv("QUIVER_CPU_PACKED_WEIGHTS", "0")
    model = _load(tmp_path / "again")
    assert model.lm_head_packed is None
    assert all(m.packed_weight is None for m in model.modules() if isinstance(m, Linear))
