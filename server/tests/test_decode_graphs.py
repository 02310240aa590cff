"""The decode graphs' padded batches, run eagerly (no CUDA here; the Triton ops in Triton's CPU
interpreter, as on a GPU): rows padded up to a bucket never change the real rows, whose logits
equal an unpadded step's and transformers'/peft's, with adapters switching by slot inside one
batch; the padded rows write only the scratch block. On a GPU the check's kernels phase captures
and replays the real graphs; this test's name keeps it out of the device's shard tests."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tiny_adapters import build_adapter, peft_reference
from tiny_models import build_tiny_model

from quiver_server.adapters.manager import AdapterManager
from quiver_server.engine.decode_graphs import MAX_CAPTURED_BATCH, DecodeGraphs, bucket_sizes
from quiver_server.engine.forward_batch import build_decode, build_lora_meta, build_prefill
from quiver_server.kernels.ops import TritonKernelOps
from quiver_server.engine.kv_cache import BLOCK_SIZE, KVCacheSpec, PagedKVCache
from quiver_server.models import load_model
from quiver_server.weights import load_config

CPU = torch.device("cpu")
MAX_RANK = 8


def test_buckets_hold_every_batch_size_with_little_padding() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(5) == [1, 2, 4, 8]
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert bucket_sizes(10_000)[-1] == MAX_CAPTURED_BATCH
    for max_batch in (3, 17, 100, 256):
        sizes = bucket_sizes(max_batch)
        assert sizes == sorted(set(sizes)) and sizes[-1] >= max_batch
        for rows in range(1, max_batch + 1):
            padded = next(size for size in sizes if size >= rows)
            assert padded - rows < max(8, rows)  # under 8 rows past 8, under 2x below


# Rank classes: slot 1, the adapter's, is then the one slot of a class of MAX_RANK (row 0 of its
# own buffers) beside a slot of twice that.
@pytest.mark.parametrize("slot_ranks", [(), (2 * MAX_RANK, MAX_RANK)], ids=["one-class", "rank-classes"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@torch.inference_mode()
def test_padded_rows_never_change_real_rows_in_the_cpu_interpreter(arch: str, slot_ranks: tuple[int, ...],
                                                                   tmp_path: Path) -> None:
    base = build_tiny_model(tmp_path / "base", arch, seed=3)
    adapter = build_adapter(base, tmp_path / "adapter", seed=4, r=4, lora_alpha=8, target_modules="all-linear")
    config = load_config(base)
    ops = TritonKernelOps(CPU, "torch", None)
    model = load_model(base, config, torch.float32, CPU, ops)
    lora = AdapterManager(model, config, torch.float32, ops, max_cpu_adapters=2)
    lora.allocate_slots(2, max(slot_ranks, default=MAX_RANK), slot_ranks)
    assert lora.ranks is not None
    lora.load("a", "local", str(adapter), "")
    lora.activate("a", 1, {})

    cfg = model.config
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, BLOCK_SIZE)
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (4, 19, 33)]
    slots = [1, -1, 1]
    blocks_each = spec.blocks_for_tokens(40)
    num_blocks = blocks_each * len(prompts)
    cache = PagedKVCache(spec, num_blocks + 1, CPU)  # block num_blocks: the scratch
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(2)).view(len(prompts), blocks_each)
    lens = [len(p) for p in prompts]
    prefill = build_prefill(lens, table, BLOCK_SIZE, CPU, slots, lora.ranks)
    model(torch.tensor([t for p in prompts for t in p]), prefill, cache)

    graphs = DecodeGraphs(model, cache, num_blocks, max_batch_size=8, max_blocks_per_sequence=blocks_each,
                          block_size=BLOCK_SIZE, lora_ranks=lora.ranks, device=CPU)
    eager_cache = PagedKVCache(spec, num_blocks + 1, CPU)
    for layer in range(cfg.num_layers):
        eager_cache.k[layer].copy_(cache.k[layer])
        eager_cache.v[layer].copy_(cache.v[layer])
    fed = torch.tensor([7, 8, 9])
    lengths = list(lens)
    assert graphs.bucket(3) == 4  # one padded row
    before = [(k.clone(), v.clone()) for k, v in zip(cache.k, cache.v, strict=True)]
    ours = graphs.run(fed, lengths, table, slots).clone()
    eager_batch = build_decode(lengths, table, BLOCK_SIZE, CPU, build_lora_meta(slots, [1, 1, 1], lora.ranks, CPU))
    eager = model(fed, eager_batch, eager_cache)
    torch.testing.assert_close(ours, eager, atol=1e-5, rtol=0)

    # Against transformers/peft: the adapter rows with the adapter, the base row without.
    references = {1: peft_reference(base, adapter), -1: peft_reference(base, None)}
    for row, (prompt, slot) in enumerate(zip(prompts, slots, strict=True)):
        sequence = torch.tensor([[*prompt, int(fed[row])]])
        torch.testing.assert_close(ours[row], references[slot](sequence).logits[0, -1], atol=1e-4, rtol=0)

    # Only the real rows' new slots and the scratch block changed in the cache.
    new_slots = {int(table[row, n // BLOCK_SIZE]) * BLOCK_SIZE + n % BLOCK_SIZE for row, n in enumerate(lengths)}
    for (k_before, v_before), k_after, v_after in zip(before, cache.k, cache.v, strict=True):
        for old, new in ((k_before, k_after), (v_before, v_after)):
            changed = (old != new).flatten(2).any(-1).flatten()  # per slot
            changed_slots = set(changed.nonzero()[:, 0].tolist())
            assert changed_slots - new_slots <= set(range(num_blocks * BLOCK_SIZE, (num_blocks + 1) * BLOCK_SIZE))

    # A smaller step reuses the buffers: stale rows from the larger one must not leak in.
    one = graphs.run(torch.tensor([5]), [lengths[1] + 1], table[1:2], None)
    sequence = torch.tensor([[*prompts[1], int(fed[1]), 5]])
    torch.testing.assert_close(one[0], references[-1](sequence).logits[0, -1], atol=1e-4, rtol=0)
