"""Every part of a fused projection in one Triton launch (`lora_triton.FusedLora`), rows grouped by
adapter, against the per-part reference.

The reference (`lora_reference`) is the per-token loop of the docstring semantics; it is itself
checked against an independent float64 computation of y + scaling * B @ (A @ x) per token. Every
case draws fresh random inputs; y starts as random data (never zeros), and columns outside
out_slice must come back bit-identical, so a kernel writing the wrong columns or rows fails.

Triton runs compiled on a GPU when there is one, else on CPU tensors in Triton's interpreter
(TRITON_INTERPRET=1, set by conftest.py before anything imports triton). Interpreter cases are
small: each launch runs the kernel in numpy, program by program.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # running this file alone, without conftest

from quiver_server.kernels.lora_meta import LoraBatchMeta  # noqa: E402
from quiver_server.kernels.lora_projection import LoraProjection  # noqa: E402
from quiver_server.kernels import lora_triton  # noqa: E402
from quiver_server.kernels.lora_reference import add_lora_reference  # noqa: E402
from lora_parts_cases import assert_within_parts_bound, fused_parts, random_batch, reference_per_part  # noqa: E402

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DEFAULT_LAUNCH = lora_triton.LaunchConfig()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---------------------------------------------------------------------------------------------
# Triton: every part of a fused projection in one launch, rows grouped by adapter
# (`lora_triton.FusedLora`, what `LoraProjection` runs on the triton backend).


def test_meta_groups_decode_rows_by_adapter() -> None:
    # Decode rows in batch order, adapters repeated and interleaved with base rows: the groups
    # list each adapter's rows once, in slot order, and leave base rows out.
    meta = LoraBatchMeta.build([2, -1, 0, 2, 1, 0, 2], [1] * 7, max_rank=8, device="cpu")
    groups = meta.adapter_groups
    assert groups is not None and meta.segments is groups
    assert groups.rows is not None and groups.rows.tolist() == [2, 5, 4, 0, 3, 6]
    assert groups.indptr.tolist() == [0, 2, 3, 6] and groups.slots.tolist() == [0, 1, 2]
    assert groups.max_len == 3 and groups.rows.dtype == groups.indptr.dtype == groups.slots.dtype == torch.int32
    assert meta.token_slots.tolist() == [2, -1, 0, 2, 1, 0, 2]  # the batch-order views are unchanged
    # Prefill keeps its batch-order segments; an all-base decode batch has nothing to group.
    prefill = LoraBatchMeta.build([2, 2, -1, 0], [3, 1, 2, 4], max_rank=8, device="cpu")
    assert prefill.adapter_groups is None and prefill.segments.rows is None
    assert prefill.segments.indptr.tolist() == [0, 4, 6, 10] and prefill.segments.max_len == 4
    assert LoraBatchMeta.build([-1, -1], [1, 1], max_rank=8, device="cpu").adapter_groups is None
    # Rows built on the device: one segment per row, nothing known on the host.
    rows = LoraBatchMeta.for_rows(torch.tensor([3, -1, 3], dtype=torch.int32), max_rank=8)
    assert rows.adapter_groups is None and rows.segments.indptr.tolist() == [0, 1, 2, 3]
    assert rows.segments.max_len == 1


class _Launches:
    """Stands in for `lora_triton._parts_kernel`, recording each launch's grid."""

    def __init__(self, kernel) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def _fused_triton(y, x, parts, meta_on_device, monkeypatch, config=DEFAULT_LAUNCH):
    """FusedLora(parts).add on TRITON_DEVICE with meta_on_device(device); returns (y on CPU,
    the launch grids)."""
    device = torch.device(TRITON_DEVICE)
    moved = [(a.to(device), b.to(device), s.to(device), sl, None if r is None else r.to(device))
             for a, b, s, sl, r in parts]
    launches = _Launches(lora_triton._parts_kernel)
    out = y.to(device, copy=True)
    with monkeypatch.context() as patch:
        patch.setattr(lora_triton, "_parts_kernel", launches)
        lora_triton.FusedLora(moved).add(out, x.to(device), meta_on_device(device), config)
    return out.cpu(), launches.grids


PREFILL_LENGTHS, PREFILL_SLOTS = [40, 1, 20, 3, 30, 2], [2, 4, -1, 2, 0, 4]


@pytest.mark.parametrize("with_ranks", [False, True], ids=["padded", "slot-ranks"])
@pytest.mark.parametrize("step", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_fused_parts_in_one_launch(dtype, step, with_ranks, monkeypatch) -> None:
    # Parts of widths 48/24/24 and max ranks 16/8/16, adapters of smaller ranks, slot 4 not
    # targeting the middle part; decode rows in unsorted adapter order with repeats and base
    # rows, prefill segments with a slot used twice and a one-token segment.
    y, x, parts, meta = fused_parts(dtype, rank_major_b=False, num_rows=29, seed=11)
    slots, tokens = [int(s) for s in meta.token_slots], [1] * 29
    if step == "prefill":
        slots, tokens = PREFILL_SLOTS, PREFILL_LENGTHS
        meta = LoraBatchMeta.build(slots, tokens, 16, "cpu")
        gen = torch.Generator().manual_seed(2)
        y = torch.randn(sum(tokens), y.shape[1], generator=gen).to(dtype)
        x = torch.randn(sum(tokens), x.shape[1], generator=gen).to(dtype)
    assert (meta.adapter_groups is not None) == (step == "decode")
    expected = reference_per_part(y, x, parts, meta)
    if not with_ranks:
        parts = [(*part[:4], None) for part in parts]
    actual, grids = _fused_triton(y, x, parts, lambda d: LoraBatchMeta.build(slots, tokens, 16, d), monkeypatch)
    assert len(grids) == 1  # q|k|v-like parts, shrink and expand: one launch
    assert torch.equal(actual[:, :3], y[:, :3]) and torch.equal(actual[:, -5:], y[:, -5:])
    base_rows = meta.token_slots < 0
    assert torch.equal(actual[base_rows], y[base_rows])
    assert_within_parts_bound(actual, expected, y, x, parts, meta)


@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_triton_fused_parts_read_no_padded_rank(step, monkeypatch) -> None:
    # As test_slot_ranks_bound_what_the_kernel_reads: padding past each slot's rank (and the
    # whole untargeted part of slot 4) holds 1e3; with slot_ranks the result is still the
    # reference on zero padding, without them (the control) it is not.
    y, x, parts, meta = fused_parts(torch.float32, rank_major_b=True, num_rows=17, seed=5)
    slots, tokens = [int(s) for s in meta.token_slots], [1] * 17
    if step == "prefill":
        slots, tokens = PREFILL_SLOTS, PREFILL_LENGTHS
        meta = LoraBatchMeta.build(slots, tokens, 16, "cpu")
        gen = torch.Generator().manual_seed(4)
        y, x = torch.randn(sum(tokens), y.shape[1], generator=gen), torch.randn(sum(tokens), x.shape[1], generator=gen)
    expected = reference_per_part(y, x, parts, meta)
    polluted = []
    for lora_a, lora_b, scaling, out_slice, ranks in parts:
        a, b = lora_a.clone(), lora_b.clone()
        for slot, rank in enumerate(ranks.tolist()):
            a[slot, rank:] = 1e3
            b[slot, :, rank:] = 1e3
        polluted.append((a, b, scaling, out_slice, ranks))
    build = lambda d: LoraBatchMeta.build(slots, tokens, 16, d)  # noqa: E731
    actual, _ = _fused_triton(y, x, polluted, build, monkeypatch)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    control, _ = _fused_triton(y, x, [(*part[:4], None) for part in polluted], build, monkeypatch)
    assert (control - expected).abs().max() > 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fused_parts_for_rows_meta(dtype, monkeypatch) -> None:
    # A sparse MLP's (token, expert) rows: buffers of 3 slots x 4 experts, each row naming its
    # buffer row slot * 4 + expert (-1: base), built on the device by for_rows. The grid depends
    # on the row count only, so a CUDA graph over static row slots replays any slots.
    gen = torch.Generator().manual_seed(8)
    slots, experts, in_features, max_rank = 3, 4, 40, 8
    parts, start = [], 2
    scaling = torch.rand(slots * experts, generator=gen) + 0.5
    for width in (24, 24):  # gate|up
        a = torch.randn(slots * experts, max_rank, in_features, generator=gen) / in_features**0.5
        b = torch.randn(slots * experts, width, max_rank, generator=gen) / max_rank**0.5
        parts.append((a.to(dtype), b.to(dtype), scaling, slice(start, start + width), None))
        start += width
    rows = 19
    row_slots = torch.randint(-1, slots * experts, (rows,), generator=gen, dtype=torch.int32)
    row_slots[:3] = torch.tensor([5, 5, 0], dtype=torch.int32)  # one buffer row twice
    y = torch.randn(rows, start + 3, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    meta = LoraBatchMeta.for_rows(row_slots, max_rank)
    expected = reference_per_part(y, x, parts, meta)
    actual, grids = _fused_triton(y, x, parts, lambda d: LoraBatchMeta.for_rows(row_slots.to(d), max_rank),
                                  monkeypatch)
    assert torch.equal(actual[meta.token_slots < 0], y[meta.token_slots < 0])
    assert_within_parts_bound(actual, expected, y, x, parts, meta)
    _, other_grids = _fused_triton(y, x, parts, lambda d: LoraBatchMeta.for_rows(
        torch.full((rows,), 7, dtype=torch.int32, device=d), max_rank), monkeypatch)
    assert grids == other_grids and grids[0][:2] == (rows, 1)


@pytest.mark.parametrize("seed", range(4))
def test_triton_fused_parts_random_shapes_and_launch_configs(seed, monkeypatch) -> None:
    # Tile sizes and column splits (over 1-3 parts) change which program computes what, never
    # the result.
    rng = random.Random(300 + seed)
    gen = torch.Generator().manual_seed(seed)
    dtype = rng.choice(DTYPES)
    num_slots, in_features = rng.choice([2, 5]), rng.choice([16, 33, 80])
    decode = seed % 2 == 0
    tokens, slots = random_batch(rng, rng.randint(2, 9), 1 if decode else 40, num_slots)
    slots[-1] = max(slots[-1], 0)
    parts, start = [], rng.choice([0, 7])
    scaling = torch.rand(num_slots, generator=gen) + 0.5
    for _ in range(rng.randint(1, 3)):
        width, max_rank = rng.choice([16, 50, 130]), rng.choice([1, 8, 24])
        ranks = torch.tensor([rng.randint(0, max_rank) for _ in range(num_slots)], dtype=torch.int32)
        a = torch.zeros(num_slots, max_rank, in_features)
        b = torch.zeros(num_slots, width, max_rank)
        for slot, rank in enumerate(ranks.tolist()):
            a[slot, :rank] = torch.randn(rank, in_features, generator=gen) / in_features**0.5
            b[slot, :, :rank] = torch.randn(width, rank, generator=gen) / max(rank, 1)**0.5
        parts.append((a.to(dtype), b.to(dtype), scaling, slice(start, start + width), ranks))
        start += width
    y = torch.randn(sum(tokens), start + 2, generator=gen).to(dtype)
    x = torch.randn(sum(tokens), in_features, generator=gen).to(dtype)
    meta = LoraBatchMeta.build(slots, tokens, 24, "cpu")
    config = lora_triton.LaunchConfig(
        block_m=rng.choice([None, 16, 32]), block_k=rng.choice([None, 16, 32]),
        block_n=rng.choice([None, 16, 32]), splits=rng.choice([None, 1, 3, 7]),
    )
    actual, grids = _fused_triton(y, x, parts, lambda d: LoraBatchMeta.build(slots, tokens, 24, d), monkeypatch, config)
    assert len(grids) == 1
    assert_within_parts_bound(actual, reference_per_part(y, x, parts, meta), y, x, parts, meta)


def test_triton_projection_runs_fused_parts_and_overlapping_parts_per_part(monkeypatch) -> None:
    # LoraProjection on the triton backend binds FusedLora; parts whose columns overlap (never a
    # real fused projection) cannot share a launch and go one launch per part, in order.
    y, x, parts, meta = fused_parts(torch.float32, rank_major_b=False, num_rows=6, seed=2)
    device = torch.device(TRITON_DEVICE)
    moved = [(a.to(device), b.to(device), s.to(device), sl, r.to(device)) for a, b, s, sl, r in parts]
    meta_d = LoraBatchMeta.build([int(s) for s in meta.token_slots], [1] * 6, 16, device)
    launches = _Launches(lora_triton._parts_kernel)
    monkeypatch.setattr(lora_triton, "_parts_kernel", launches)
    projection = LoraProjection(moved, backend="triton")
    out = y.to(device, copy=True)
    projection.add(out, x.to(device), meta_d)
    assert len(launches.grids) == 1
    assert_within_parts_bound(out.cpu(), reference_per_part(y, x, parts, meta), y, x, parts, meta)
    with pytest.raises(ValueError, match="do not fit parts"):
        projection.add(out[:, :40], x.to(device), meta_d)
    overlapping = [moved[1], (*moved[2][:3], moved[1][3], moved[2][4])]  # both on the middle columns
    out = y.to(device, copy=True)
    LoraProjection(overlapping, backend="triton").add(out, x.to(device), meta_d)
    expected = y.clone()
    for a, b, s, sl, _ in overlapping:
        add_lora_reference(expected, x, a.cpu(), b.cpu(), s.cpu(), meta, sl)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
