"""Vectorised torch LoRA for CPU serving: `lora_reference` semantics without a loop per token.

All arithmetic is float32 (16-bit inputs are upcast), the delta is added to y with one rounding.
Three strategies, all exact to the reference up to float32 summation order:

- `gather_rows`: per active row, gather A[slot] and B[slot] ([T, R, in] and [T, out, R] copies)
  and run two batched mat-vecs. No Python loop at all, but it copies R*(in+out) weights per row.
- `group_by_slot`: sort active rows by slot, then one (rows @ A^T) @ B^T pair per distinct
  adapter on its contiguous run of sorted rows. A Python loop over distinct adapters (<= slots),
  never over tokens; weights are read in place.
- `by_segment`: prefill only: one matmul pair per segment, straight on the token slice of x and
  y (segments are contiguous, so nothing is gathered or scattered).

`add_lora_torch` uses `group_by_slot` for decode and for prefills of many short prompts (mean
segment < SHORT_SEGMENT_TOKENS tokens), `by_segment` otherwise. `gather_rows` is kept as the
measured alternative (and is tested), not used.

Measured 2026-11-21 on the 2-core x86 dev VM (torch 2.15, float32, 1 torch thread: with 2
threads the shared VM's other load made medians swing 5-10x; their minima ranked the strategies
the same except where noted). Minimum of 15 runs, microseconds. 32 slots; requests cycle over
`a` adapters; in x out, rank r. Reproduce: `python -m bench.kernels.lora --device cpu`.

    decode  batch  a   in x out    r   group_by_slot  gather_rows  per-token reference
              8    8   512x512    16        136           138          166
             32    1   512x1408   16         74           781          751
             32    8   512x1408   16        213           787          764
             32   32   512x1408   16        619           813          795   (2 threads: 594 vs gather 461)
            128   32   512x1408   16        814          3246         3184
             32   32  4096x4096   16       1375          3721         1458
             32   32   512x512   128       1008          3343         1195

    prefill reqs x len  a   in x out    r   by_segment  group_by_slot
             4 x 128    4   512x512    16        261          772
            32 x 64     8   512x1408   16       2331         4431
           128 x 16     8   512x1408   16       4448         4320
           256 x 8     32   512x512    16       5412         2955
            32 x 64     8  4096x4096   16      12990        58174
             4 x 512    4  4096x4096   64      25432        58414

gather_rows copies R*(in+out) weights per row and loses wherever rows outnumber adapters or the
layers are wide; small decode batches are bound by the count of torch ops (~10 us each here), so
group_by_slot spends two matmuls per adapter and folds scaling, gather and scatter into one op
each over all rows. For prefill, gathering/scattering T rows costs more than a matmul pair per
segment until segments get short (crossover ~16 tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quiver_server.kernels import cpu_ops
from quiver_server.kernels.lora_meta import LoraBatchMeta

# Below this mean segment length, gathering rows by adapter beats a matmul pair per segment.
SHORT_SEGMENT_TOKENS = 16


def _add_rows(y: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor) -> None:
    """y[rows] += delta (float32) with one rounding to y's dtype."""
    if y.dtype == torch.float32:
        y.index_add_(0, rows, delta)
    else:
        y[rows] = (y[rows].float() + delta).to(y.dtype)


def gather_rows(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scaling: torch.Tensor, token_slots: torch.Tensor,
) -> None:
    rows = torch.nonzero(token_slots >= 0).squeeze(1)
    if rows.numel() == 0:
        return
    slots = token_slots[rows].long()
    h = torch.bmm(lora_a[slots].float(), x[rows].float().unsqueeze(2))  # [n, R, 1]
    h.mul_(scaling[slots].view(-1, 1, 1))
    delta = torch.bmm(lora_b[slots].float(), h).squeeze(2)  # [n, out]
    _add_rows(y, rows, delta)


def group_by_slot(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scaling: torch.Tensor, token_slots: torch.Tensor, slot_ranks: torch.Tensor | None = None,
) -> None:
    # Per distinct adapter only two matmuls on a slice of the sorted rows; everything per row
    # (gather, scaling, scatter) is one op over all rows. Small decode batches are bound by the
    # number of torch ops, so every op saved per adapter shows.
    sorted_slots, order = torch.sort(token_slots, stable=True)
    slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    slots, counts = slots.tolist(), counts.tolist()
    first = counts[0] if slots[0] < 0 else 0  # base-model rows (-1) sort first
    if first:
        slots, counts = slots[1:], counts[1:]
    if not slots:
        return
    rows = order[first:]
    xs = x[rows].float()
    # scaling * B @ (A @ x) == B @ (A @ (scaling * x)): scale the rows once, not per adapter.
    xs.mul_(scaling[sorted_slots[first:]].unsqueeze(1) if len(slots) > 1 else scaling[slots[0]])
    ranks = slot_ranks.tolist() if slot_ranks is not None else None
    deltas = []
    start = 0
    for slot, count in zip(slots, counts, strict=True):
        rank = ranks[slot] if ranks is not None else lora_a.shape[1]  # rows past it are zero
        h = F.linear(xs[start:start + count], lora_a[slot, :rank].float())
        deltas.append(F.linear(h, lora_b[slot, :, :rank].float()))
        start += count
    _add_rows(y, rows, torch.cat(deltas) if len(deltas) > 1 else deltas[0])


def by_segment(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scaling: torch.Tensor, seg_indptr: torch.Tensor, seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor | None = None,
) -> None:
    """slot_ranks (int32 [S], optional): each slot's own rank; the matmuls use only those rank
    rows (the rest are zero), and a slot of rank 0 is skipped."""
    bounds = seg_indptr.tolist()
    scales = scaling.tolist()
    ranks = slot_ranks.tolist() if slot_ranks is not None else None
    for i, slot in enumerate(seg_slots.tolist()):
        if slot < 0:
            continue
        rank = ranks[slot] if ranks is not None else lora_a.shape[1]
        if rank == 0:
            continue
        rows = slice(bounds[i], bounds[i + 1])
        h = F.linear(x[rows].float(), lora_a[slot, :rank].float())
        lora_b_slot = lora_b[slot, :, :rank]
        if y.dtype == torch.float32:
            # Expand and add in one GEMM into y's rows (no [n, out] delta written and re-read).
            y[rows].addmm_(h, lora_b_slot.t(), alpha=scales[slot])
        else:
            # In-place add of a float32 operand (times alpha) computes in float32, rounds once.
            y[rows].add_(F.linear(h, lora_b_slot.float()), alpha=scales[slot])


def add_lora_torch(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scaling: torch.Tensor, meta: LoraBatchMeta, out_slice: slice, slot_ranks: torch.Tensor | None = None,
) -> None:
    y_part = y[:, out_slice]
    if meta.num_tokens < SHORT_SEGMENT_TOKENS * meta.num_segments:  # decode, or many short prompts
        group_by_slot(y_part, x, lora_a, lora_b, scaling, meta.token_slots, slot_ranks)
    else:
        by_segment(y_part, x, lora_a, lora_b, scaling, meta.seg_indptr, meta.seg_slots, slot_ranks)


def add_lora_cpu(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scaling: torch.Tensor, meta: LoraBatchMeta, out_slice: slice, slot_ranks: torch.Tensor | None = None,
) -> None:
    """`add_lora_torch` with the C++ kernels: BGMV (`cpu_ops.lora_bgmv`) for decode rows, one pass
    over the rows instead of a matmul pair per distinct adapter; SGMV (`cpu_ops.lora_sgmv_parts`)
    for prefill segments when lora_b is in the CPU slots' rank-major layout, in tiles of rows that
    share their adapter's weights. Other prefills: BGMV where rows are few per segment, else
    `by_segment`, whose matmuls use the weights better than a mat-vec per row."""
    y_part = y[:, out_slice]
    if not meta.is_decode and cpu_ops.rank_major(lora_b):
        cpu_ops.lora_sgmv_parts(y_part, x, [lora_a], [lora_b], [] if slot_ranks is None else [slot_ranks], [0],
                                scaling, meta.seg_indptr, meta.seg_slots)
        return
    # Decode rows always: with the slots' rank-major lora_B the kernel beats a matmul pair even
    # when every row shares one adapter (32 rows, one adapter: 45 against 49 ms a step).
    if meta.is_decode or meta.num_tokens < SHORT_SEGMENT_TOKENS * meta.num_segments:
        cpu_ops.lora_bgmv(y_part, x, lora_a, lora_b, scaling, meta.token_slots)
    else:
        by_segment(y_part, x, lora_a, lora_b, scaling, meta.seg_indptr, meta.seg_slots, slot_ranks)
