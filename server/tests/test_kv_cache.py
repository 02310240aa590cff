"""The paged KV cache and the attention that reads it, against a naive per-position reference
(the semantics written in layers/attention.py's docstring): decode attention both in plain torch
and as the shard's ops run it here (the C++ kernel where it is built)."""

from __future__ import annotations

import math

import pytest
import torch

from quiver_server.engine.forward_batch import build_decode, build_prefill
from quiver_server.engine.kv_cache import KVCacheSpec, PagedKVCache
from quiver_server.kernels import attention_torch
from quiver_server.kernels.ops import KernelOps, select_ops
from quiver_server.layers.attention import prefill_attention, write_kv

CPU = torch.device("cpu")
BLOCK = 4  # small blocks so short sequences cross several block boundaries
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
SCALE = HEAD_DIM**-0.5


def _reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None) -> torch.Tensor:
    """q [heads, d] at position len(keys)-1 attending over keys/values [n, kv_heads, d]."""
    position = keys.shape[0] - 1
    group = HEADS // KV_HEADS
    out = torch.empty_like(q)
    for head in range(HEADS):
        visible = [i for i in range(position + 1) if window is None or i > position - window]
        scores = torch.stack([q[head] @ keys[i, head // group] * SCALE for i in visible])
        weights = torch.softmax(scores, dim=0)
        out[head] = sum(w * values[i, head // group] for w, i in zip(weights, visible, strict=True))
    return out


def test_spec_sizes() -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=16)
    assert spec.bytes_per_block() == 2 * 3 * 16 * 2 * 8 * 2
    assert [spec.blocks_for_tokens(n) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]
    cache = PagedKVCache(spec, num_blocks=5, device=CPU)
    assert len(cache.k) == len(cache.v) == 3
    assert cache.k[0].shape == (5, 16, 2, 8) and cache.k[0].dtype == torch.bfloat16


def test_prefill_slots_follow_block_tables() -> None:
    table = torch.tensor([[7, 2, 9], [0, 5, 1]])
    batch = build_prefill([6, 10], table, BLOCK, CPU)
    expected = [int(table[s, p // BLOCK]) * BLOCK + p % BLOCK for s, n in enumerate([6, 10]) for p in range(n)]
    assert batch.slot_mapping.tolist() == expected
    assert batch.positions.tolist() == list(range(6)) + list(range(10))
    assert batch.logits_indices.tolist() == [5, 15]


def test_write_kv_stores_each_token_in_its_block() -> None:
    spec = KVCacheSpec(1, KV_HEADS, HEAD_DIM, torch.float32, BLOCK)
    cache = PagedKVCache(spec, num_blocks=10, device=CPU)
    table = torch.tensor([[7, 2, 9]])
    k = torch.randn(9, KV_HEADS, HEAD_DIM)
    v = torch.randn(9, KV_HEADS, HEAD_DIM)
    write_kv(cache.k[0], cache.v[0], k, v, build_prefill([9], table, BLOCK, CPU).slot_mapping)
    for p in range(9):
        block, offset = int(table[0, p // BLOCK]), p % BLOCK
        assert torch.equal(cache.k[0][block, offset], k[p]) and torch.equal(cache.v[0][block, offset], v[p])


@pytest.mark.parametrize(
    "ops,gather_bytes",
    [("torch", 1 << 30), ("torch", 1), ("selected", 1 << 30)],
    ids=["torch-one-group", "torch-one-sequence-per-group", "selected"],
)
@pytest.mark.parametrize("window", [None, 3])
def test_decode_attention_matches_reference(
    window: int | None, ops: str, gather_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention_torch, "CPU_GATHER_BYTES", gather_bytes)
    kernel_ops = select_ops(CPU) if ops == "selected" else KernelOps(CPU, "torch", None)
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 6, 13]  # cached tokens before the new one
    spec = KVCacheSpec(1, KV_HEADS, HEAD_DIM, torch.float32, BLOCK)
    cache = PagedKVCache(spec, num_blocks=16, device=CPU)
    cache.k[0].normal_(generator=generator)
    cache.v[0].normal_(generator=generator)
    # Ragged tables padded with block 0; the padding must be masked out.
    tables = [[3], [11, 4], [8, 1, 14, 6]]
    table = torch.tensor([t + [0] * (4 - len(t)) for t in tables])
    batch = build_decode(lengths, table, BLOCK, CPU)
    q = torch.randn(3, HEADS, HEAD_DIM, generator=generator)
    out = kernel_ops.decode_attention(q, cache.k[0], cache.v[0], batch, SCALE, window)
    for s, n in enumerate(lengths):
        slots = [(tables[s][p // BLOCK], p % BLOCK) for p in range(n + 1)]
        keys = torch.stack([cache.k[0][b, o] for b, o in slots])
        values = torch.stack([cache.v[0][b, o] for b, o in slots])
        torch.testing.assert_close(out[s], _reference_attention(q[s], keys, values, window))


@pytest.mark.parametrize("window", [None, 4])
def test_prefill_attention_matches_reference(window: int | None) -> None:
    generator = torch.Generator().manual_seed(1)
    lens = [3, 9, 1]
    total = sum(lens)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=generator)
    table = torch.arange(3 * math.ceil(max(lens) / BLOCK)).view(3, -1)
    out = prefill_attention(q, k, v, build_prefill(lens, table, BLOCK, CPU), SCALE, window)
    start = 0
    for n in lens:
        for p in range(n):
            expected = _reference_attention(q[start + p], k[start : start + p + 1], v[start : start + p + 1], window)
            torch.testing.assert_close(out[start + p], expected)
        start += n
