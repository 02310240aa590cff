"""The C++ KV write (`kernels/cpu/kv_write.cpp`) against the torch path (`layers.attention.write_kv`:
index_copy_ after torch's own casts), bit for bit: every model dtype into every cache dtype it
may have, k and v as strided views of a fused projection, scattered slots, values past float8's
range and on its ties, and a padding row (slot -1) that writes nothing."""

from __future__ import annotations

import pytest
import torch

from quiver_server.kernels import cpu_ops
from quiver_server.layers.attention import write_kv

BLOCK = 16
PAIRS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float8_e4m3fn),
         (torch.float32, torch.float8_e5m2), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn),
         (torch.float16, torch.float16), (torch.float16, torch.float8_e5m2), (torch.float16, torch.bfloat16)]


@pytest.fixture(autouse=True, scope="module")
def _built() -> None:
    assert cpu_ops.available()  # builds (or loads) the kernels


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns, where equality tells -0 from 0."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype,cache_dtype", PAIRS)
def test_one_call_writes_what_the_torch_path_writes(dtype, cache_dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim = 37, 4, 2, 64
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen) * 200).to(dtype)
    qkv[0, heads, :8] = torch.tensor([448.0, 464.0, -480.0, 0.0, -0.0, 2**-10, 3 * 2**-10, 1e-9]).to(dtype)
    k, v = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    blocks = 6
    slots = torch.randperm(blocks * BLOCK, generator=gen)[:tokens]
    slots[5] = -1
    start = torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen).to(cache_dtype)
    got_k, got_v = start.clone(), start.clone()
    cpu_ops.write_kv(got_k, got_v, k, v, slots)
    want_k, want_v = start.clone(), start.clone()
    real = slots >= 0
    write_kv(want_k, want_v, k[real], v[real], slots[real])
    assert torch.equal(_bits(got_k), _bits(want_k)) and torch.equal(_bits(got_v), _bits(want_v))
    assert not torch.equal(_bits(got_k), _bits(start))


def test_bad_input_raises() -> None:
    k = torch.randn(3, 2, 16)
    cache = torch.zeros(2, BLOCK, 2, 16)
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu_ops.write_kv(cache, cache.clone(), k, k, torch.tensor([0, 1, 2 * BLOCK]))
    with pytest.raises(RuntimeError, match="bfloat16 or float8"):
        cpu_ops.write_kv(cache.half(), cache.half(), k, k, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="fitting the caches"):
        cpu_ops.write_kv(cache, cache.clone(), k[..., :8], k[..., :8], torch.tensor([0, 1, 2]))
