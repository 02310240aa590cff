"""The float8 KV cache's C++ conversions (`kernels/cpu/kv_float8.cpp`) against torch's own casts:
rounding to the cache's grid (saturated, to nearest with ties to even) for values across the
whole range, the subnormals and the ties included, and widening every finite byte pattern."""

from __future__ import annotations

import pytest
import torch

from quiver_server.kernels import cpu_ops

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]
MODEL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True, scope="module")
def _built() -> None:
    assert cpu_ops.available()  # builds (or loads) the kernels


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns, where equality tells -0 from 0."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _finite_patterns(cache: torch.dtype) -> torch.Tensor:
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(cache)
    return patterns[torch.isfinite(patterns.float())]


def _values(cache: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """Random values at every scale, past the range, and every midpoint between neighbouring
    grid values (the ties, which go to the even neighbour)."""
    gen = torch.Generator().manual_seed(7)
    scales = (1e-6, 1e-4, 1e-2, 1.0, 100.0, 1e4, 1e5)
    grid = _finite_patterns(cache).float().unique()
    ties = (grid[1:] + grid[:-1]) / 2
    limit = torch.finfo(cache).max
    values = torch.cat([torch.randn(20000, generator=gen) * s for s in scales]
                       + [ties, -ties, torch.tensor([0.0, -0.0, -1e-30, 2 * limit, -2 * limit, limit, -limit])])
    if dtype == torch.float16:
        values = values.clamp(-60000, 60000)  # float16's own range
    return values.to(dtype)


@pytest.mark.parametrize("cache", FLOAT8)
@pytest.mark.parametrize("dtype", MODEL_DTYPES)
def test_rounding_to_the_grid_is_torchs_saturating_cast(cache, dtype) -> None:
    x = _values(cache, dtype)
    limit = torch.finfo(cache).max
    want = x.clamp(-limit, limit).to(cache).to(dtype)
    got = cpu_ops.as_stored(x, cache)
    assert got.dtype == dtype and torch.equal(_bits(got), _bits(want))  # -0 included
    assert torch.equal(x, _values(cache, dtype))  # a new tensor: x itself is left as it was
    even = x.numel() // 2 * 2
    strided = x[:even].view(-1, 2)[:, 0]  # any layout
    assert torch.equal(_bits(cpu_ops.as_stored(strided, cache)), _bits(want[:even].view(-1, 2)[:, 0]))


@pytest.mark.parametrize("cache", FLOAT8)
@pytest.mark.parametrize("dtype", MODEL_DTYPES)
def test_widening_gives_every_finite_pattern_its_value(cache, dtype) -> None:
    patterns = _finite_patterns(cache)
    stored = patterns.repeat(3)[:-5]  # a tail shorter than a vector
    got = cpu_ops.widen(stored, dtype)
    assert got.dtype == dtype and torch.equal(_bits(got), _bits(stored.to(dtype)))
