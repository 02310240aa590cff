"""Several parts of one fused projection (q|k|v, gate|up) with their slot buffers, and the
per-part reference they are held to: shared by the CPU and Triton multi-part LoRA tests."""

from __future__ import annotations

import random

import torch
from float_error import lora_error_bound

from quiver_server.kernels.lora_meta import LoraBatchMeta
from quiver_server.kernels.lora_reference import add_lora_reference


def fused_parts(dtype: torch.dtype, rank_major_b: bool, num_rows: int, seed: int):
    """Three parts of widths 48, 24, 24 over one x, slot buffers of different max ranks holding
    adapters of smaller ranks (slot 4 does not target the middle part: rank 0 there); rows mix
    slots and base rows. Each part is (lora_a, lora_b, scaling, out_slice, slot_ranks)."""
    gen = torch.Generator().manual_seed(seed)
    num_slots, in_features = 5, 64
    scaling = torch.rand(num_slots, generator=gen) * 2 + 0.25
    parts, start = [], 3
    for index, (width, max_rank) in enumerate(((48, 16), (24, 8), (24, 16))):
        a = torch.zeros(num_slots, max_rank, in_features)
        b = torch.zeros(num_slots, width, max_rank)
        ranks = torch.zeros(num_slots, dtype=torch.int32)
        for slot in range(num_slots):
            rank = 0 if (index, slot) == (1, 4) else 1 + (slot * 5 + max_rank) % max_rank
            a[slot, :rank] = torch.randn(rank, in_features, generator=gen) / in_features**0.5
            b[slot, :, :rank] = torch.randn(width, rank, generator=gen) / max(rank, 1)**0.5
            ranks[slot] = rank
        b = b.to(dtype)
        if rank_major_b:
            b = b.transpose(1, 2).contiguous().transpose(1, 2)
        parts.append((a.to(dtype), b, scaling, slice(start, start + width), ranks))
        start += width
    y = torch.randn(num_rows, start + 5, generator=gen).to(dtype)
    x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
    slots = [int(s) for s in torch.randint(-1, num_slots, (num_rows,), generator=gen)]
    slots[:2] = [2, 4]  # at least one adapter row, and one of the slot with an untargeted part
    meta = LoraBatchMeta.build(slots, [1] * num_rows, 16, "cpu")
    return y, x, parts, meta


def assert_within_parts_bound(actual, expected, y, x, parts, meta) -> None:
    """actual and the float32 reference each within the rounding bound of the exact value, part by
    part (float_error.lora_error_bound), so within twice it of each other."""
    for lora_a, lora_b, scaling, out_slice, _ in parts:
        bound = 2 * lora_error_bound(y, x, lora_a, lora_b, scaling, meta.token_slots, out_slice)
        error = (actual[:, out_slice].double() - expected[:, out_slice].double()).abs()
        assert (error <= bound).all(), f"max error over bound {(error / bound.clamp_min(1e-300)).max():.3g}"


def reference_per_part(y, x, parts, meta):
    expected = y.clone()
    for lora_a, lora_b, scaling, out_slice, _ in parts:
        add_lora_reference(expected, x, lora_a, lora_b, scaling, meta, out_slice)
    return expected


def random_batch(rng: random.Random, num_requests: int, max_tokens: int, num_slots: int) -> tuple[list[int], list[int]]:
    tokens = [rng.randint(1, max_tokens) for _ in range(num_requests)]
    slots = [rng.randrange(-1, num_slots) for _ in range(num_requests)]
    return tokens, slots
