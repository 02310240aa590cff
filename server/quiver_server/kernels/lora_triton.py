"""Triton kernels for batched LoRA: `FusedLora` (every part of a fused projection, rows grouped
by adapter: what the serving path runs), and BGMV (decode rows) and SGMV (prefill segments) for
one part (`add_lora_triton`; the baselines `bench/kernels/lora.py` and `bench/kernels/lora_compile_report.py`
measure).

`FusedLora` runs q|k|v or gate|up in one launch: grid (segments, row programs, column splits of
all parts); a program selects its part from its split index, reads the slot's rank in that part
(0: returns) and computes the SGMV tile below for BLOCK_M rows of one segment. Decode segments
are the batch's adapters (rows sorted by slot on the host, `LoraBatchMeta.adapter_groups`,
gathered and scattered through that row list), so an adapter's A and B tiles are read once per
16 rows instead of once per row as in BGMV. See the class for its contract.

All of them compute, in ONE launch per call, exactly `lora_reference.add_lora_reference`:

    for every token t with s = slot(t) >= 0:
        y[t, out_slice] += scaling[s] * (lora_b[s] @ (lora_a[s] @ x[t]))      (float32 accumulate)

Shrink and expand are fused: a program computes its rows' rank-R intermediate h = A[s] @ x in
registers and immediately expands it into its own range of output columns, so h never touches
device memory and there is no second launch, no scratch buffer and no Python loop over adapters
(the adapter of a program is read from the batch metadata on the device).

The price of fusion: when the output columns of one row block are split over several programs
(`splits`, grid axis 1 / 2), each of them recomputes the shrink. That is R*in multiply-adds and
one read of the block's x and A[s] per split; A[s] and x are re-read from L2, not DRAM, because
the splits of a row run side by side. Splits are only used when rows alone cannot fill the GPU
(decode with few requests, short prefills); `_splits_and_cols` aims at ~2 programs per SM and
at most 8 splits. Chosen over a two-launch shrink/expand with a [T, R] scratch because decode
steps are launch-bound (one launch per target-module part instead of two) and the recomputed
shrink is cheap next to reading B and y at the ranks LoRA uses.

- BGMV (`bgmv`): grid (T, splits). One program per token row: its slot from token_slots
  (-1 -> return at once), shrink as a [BLOCK_R, BLOCK_K] multiply-reduce over `in` (a GEMV:
  decode is memory-bound, matrix units would idle), h scaled and rounded to the weights' dtype
  as in SGMV, then expand BLOCK_N columns at a time.
- SGMV (`sgmv`): grid (segments, row blocks of the longest segment, splits). A program takes
  BLOCK_M consecutive tokens of one segment, so all of them share A[s] and B[s]: shrink with
  tl.dot over `in` (x tile [BLOCK_M, BLOCK_K] @ A^T tile [BLOCK_K, BLOCK_R]), h scaled and cast
  to the weights' dtype (what PEFT does between its two Linear layers), expand with tl.dot per
  [BLOCK_R, BLOCK_N] tile of B^T. Programs past their segment's end return at once.

Ranks: the slot buffers are zero-padded to R = lora_a.shape[1]; BLOCK_R = next power of two
>= max(R, 16) (tl.dot needs every dimension >= 16), extra lanes are masked loads of zero.
float32 inputs use exact ("ieee") dots, so float32 serving matches the reference to rounding.
On CUDA, 16-bit inputs use native tensor-core dots (wgmma on sm_90). Under the CPU interpreter
(tests) bfloat16 dot operands are upcast first (`UPCAST`, see `sgmv`): the only line that differs,
and float16 runs the native path in the interpreter too.

Launch plans (`plan_bgmv`, `plan_sgmv`) are pure functions of the shapes; they depend on host
ints only (T, segments, max_seg_len), so a launch never syncs and can be captured in a CUDA
graph with static metadata buffers. `bench/kernels/lora_compile_report.py` compiles the plans for sm_90a
without a GPU (registers, spills, wgmma); `bench/kernels/lora.py` times them on one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quiver_server.kernels import cuda_device
from quiver_server.kernels.lora_meta import LoraBatchMeta


@triton.jit
def _bgmv_kernel(
    y_ptr, x_ptr, a_ptr, b_ptr, scaling_ptr, slots_ptr,
    K, N, R, cols_per_split,
    stride_xt, stride_xk,
    stride_as, stride_ar, stride_ak,
    stride_bs, stride_bn, stride_br,
    stride_yt, stride_yn,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    # 64-bit scalar bases, 32-bit offsets inside the tiles: half the registers of 64-bit tiles.
    x_row = x_ptr + row.to(tl.int64) * stride_xt
    y_row = y_ptr + row.to(tl.int64) * stride_yt
    a_slot = a_ptr + slot.to(tl.int64) * stride_as
    b_slot = b_ptr + slot.to(tl.int64) * stride_bs
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = offs_r < R

    # Shrink: h[r] = sum_k A[slot, r, k] * x[row, k]. Partial products stay 2-D until the end,
    # so the loop body is plain FMAs and the cross-lane reduction happens once.
    a_rows = a_slot + offs_r[:, None] * stride_ar
    partial = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        xv = tl.load(x_row + k * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
        av = tl.load(a_rows + k[None, :] * stride_ak, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        partial += av.to(tl.float32) * xv[None, :]
    h = tl.sum(partial, axis=1) * tl.load(scaling_ptr + slot)
    # Rounded to the weights' dtype like SGMV's (and PEFT's) intermediate, so a token gets the
    # same delta whichever kernel its batch runs (a no-op for float32).
    h = h.to(b_ptr.dtype.element_ty).to(tl.float32)

    # Expand into this program's columns [n_start, n_end).
    n_start = split * cols_per_split
    n_end = tl.minimum(n_start + cols_per_split, N)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(n_start, n_end, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < n_end
        bv = tl.load(
            b_slot + n[:, None] * stride_bn + offs_r[None, :] * stride_br,
            mask=n_mask[:, None] & r_mask[None, :], other=0.0,
        )
        delta = tl.sum(bv.to(tl.float32) * h[None, :], axis=1)
        yv = tl.load(y_row + n * stride_yn, mask=n_mask, other=0.0)
        tl.store(y_row + n * stride_yn, (yv.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _part_rows(
    y_ptr, x_ptr, rows_ptr, a_slot, b_slot, scale, rank, width, column, split,
    seg_start, seg_end, row_block, K, cols_per_split,
    stride_xt, stride_xk, stride_yt, stride_yn, stride_ar, stride_ak, stride_bn, stride_br,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One part's delta for row block `row_block` of one segment (rows past its end: nothing)
    and the part's columns [split * cols_per_split, ...). One block per program: a loop over
    several costs ~25% more registers on sm_90 (compile report)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    r_mask = offs_r < rank  # the slot's own rank in this part: its padding is never read
    a_cols = a_slot + offs_r[None, :] * stride_ar
    b_rows = b_slot + offs_r[:, None] * stride_br
    n_start = split * cols_per_split
    n_end = tl.minimum(n_start + cols_per_split, width)
    m0 = seg_start + row_block * BLOCK_M
    if m0 < seg_end:
        position = m0 + offs_m
        m_mask = position < seg_end
        if HAS_ROWS:
            rows = tl.load(rows_ptr + position, mask=m_mask, other=0).to(tl.int64)
            x_rows = x_ptr + rows[:, None] * stride_xt
            y_rows = y_ptr + rows[:, None] * stride_yt
        else:
            # 64-bit scalar bases, 32-bit offsets inside the tiles: half the registers.
            x_rows = x_ptr + m0.to(tl.int64) * stride_xt + offs_m[:, None] * stride_xt
            y_rows = y_ptr + m0.to(tl.int64) * stride_yt + offs_m[:, None] * stride_yt

        # Shrink: h[BLOCK_M, BLOCK_R] = x[rows, :] @ A[slot]^T, accumulated in float32.
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_mask = k < K
            xv = tl.load(x_rows + k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_cols + k[:, None] * stride_ak, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            if UPCAST:
                xv = xv.to(tl.float32)
                at = at.to(tl.float32)
            acc = tl.dot(xv, at, acc, input_precision=DOT_PRECISION)
        # Rounded to the weights' dtype between the two products, as PEFT and `sgmv` do.
        h = (acc * scale).to(b_slot.dtype.element_ty)
        if UPCAST:
            h = h.to(tl.float32)

        # Expand into this program's columns: y[rows, column + n] += h @ B[slot][n, :]^T.
        for n0 in range(n_start, n_end, BLOCK_N):
            n = n0 + offs_n
            n_mask = n < n_end
            bt = tl.load(b_rows + n[None, :] * stride_bn, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            if UPCAST:
                bt = bt.to(tl.float32)
            delta = tl.dot(h, bt, input_precision=DOT_PRECISION)
            y_tile = y_rows + (column + n)[None, :] * stride_yn
            y_mask = m_mask[:, None] & n_mask[None, :]
            yv = tl.load(y_tile, mask=y_mask, other=0.0)
            tl.store(y_tile, (yv.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _sgmv_kernel(
    y_ptr, x_ptr, a_ptr, b_ptr, scaling_ptr, seg_indptr_ptr, seg_slots_ptr,
    K, N, R, cols_per_split,
    stride_xt, stride_xk,
    stride_as, stride_ar, stride_ak,
    stride_bs, stride_bn, stride_br,
    stride_yt, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    seg = tl.program_id(0)
    slot = tl.load(seg_slots_ptr + seg)
    if slot < 0:
        return
    # The row-block body `FusedLora` runs too, for one part at column 0 of the y view.
    _part_rows(
        y_ptr, x_ptr, seg_indptr_ptr, a_ptr + slot.to(tl.int64) * stride_as, b_ptr + slot.to(tl.int64) * stride_bs,
        tl.load(scaling_ptr + slot), R, N, 0, tl.program_id(2), tl.load(seg_indptr_ptr + seg),
        tl.load(seg_indptr_ptr + seg + 1), tl.program_id(1), K, cols_per_split,
        stride_xt, stride_xk, stride_yt, stride_yn, stride_ar, stride_ak, stride_bn, stride_br,
        BLOCK_M, BLOCK_K, BLOCK_N, BLOCK_R, False, DOT_PRECISION, UPCAST,
    )


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and column splits of one launch; None = the heuristic's choice."""

    block_m: int | None = None  # SGMV rows per program
    block_k: int | None = None
    block_n: int | None = None
    splits: int | None = None
    num_warps: int = 4


@dataclass(frozen=True)
class Plan:
    """One launch: grid, columns per split and the kernel's compile-time block sizes. Pure
    function of the shapes, so `bench/kernels/lora_compile_report.py` compiles exactly what runs."""

    grid: tuple[int, ...]
    cols_per_split: int
    blocks: dict[str, int]
    num_warps: int


def _splits_and_cols(requested: int | None, row_programs: int, n: int, block_n: int, sm_count: int) -> tuple[int, int]:
    column_tiles = triton.cdiv(n, block_n)
    if requested is None:
        # Enough programs for ~2 waves of SMs, but never more than 8 recomputations of the shrink.
        requested = min(triton.cdiv(2 * sm_count, max(row_programs, 1)), 8)
    splits = max(1, min(requested, column_tiles))
    cols = triton.cdiv(column_tiles, splits) * block_n
    return triton.cdiv(n, cols), cols


@functools.lru_cache(maxsize=4096)  # called per target module and layer: same shapes every step
def plan_bgmv(num_rows: int, k: int, n: int, rank: int, sm_count: int, config: LaunchConfig) -> Plan:
    block_r = max(16, triton.next_power_of_2(rank))
    block_n = config.block_n or 64
    # Keep the shrink's partial products at <= 8K float32 per program (64 registers a thread).
    block_k = config.block_k or max(16, min(256, 8192 // block_r, triton.next_power_of_2(k)))
    splits, cols = _splits_and_cols(config.splits, num_rows, n, block_n, sm_count)
    return Plan((num_rows, splits), cols, {"BLOCK_K": block_k, "BLOCK_N": block_n, "BLOCK_R": block_r},
                config.num_warps)


@functools.lru_cache(maxsize=4096)
def plan_sgmv(
    num_rows: int, num_segments: int, max_seg_len: int, k: int, n: int, rank: int,
    dtype: torch.dtype, sm_count: int, config: LaunchConfig,
) -> Plan:
    max_seg_len = max_seg_len if max_seg_len > 0 else num_rows
    block_r = max(16, triton.next_power_of_2(rank))
    block_m = config.block_m or max(16, min(64, triton.next_power_of_2(max_seg_len)))
    if dtype == torch.float32 and config.block_m is None:
        # float32 dots run on FMA units with the tiles in registers: big tiles spill.
        block_m = min(block_m, max(16, 1024 // block_r))
    block_k = config.block_k or (32 if block_r >= 128 else 64)
    block_n = config.block_n or (64 if block_r >= 128 else 128)
    busy_programs = triton.cdiv(num_rows, block_m) + num_segments
    splits, cols = _splits_and_cols(config.splits, busy_programs, n, block_n, sm_count)
    grid = (num_segments, triton.cdiv(max_seg_len, block_m), splits)
    blocks = {"BLOCK_M": block_m, "BLOCK_K": block_k, "BLOCK_N": block_n, "BLOCK_R": block_r}
    return Plan(grid, cols, blocks, config.num_warps)


def _strides(x, lora_a, lora_b, y) -> tuple[int, ...]:
    return (
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
    )


def bgmv(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scaling: torch.Tensor, token_slots: torch.Tensor, config: LaunchConfig = LaunchConfig(),
) -> None:
    """y [T, N] (a column view is fine) += per-row LoRA delta of the row's slot (-1: none)."""
    (num_rows, k), n, rank = x.shape, lora_b.shape[1], lora_a.shape[1]
    plan = plan_bgmv(num_rows, k, n, rank, cuda_device.sm_count(x.device), config)
    _bgmv_kernel[plan.grid](
        y, x, lora_a, lora_b, scaling, token_slots, k, n, rank, plan.cols_per_split,
        *_strides(x, lora_a, lora_b, y), **plan.blocks, num_warps=plan.num_warps,
    )


def sgmv(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scaling: torch.Tensor, seg_indptr: torch.Tensor, seg_slots: torch.Tensor, max_seg_len: int,
    config: LaunchConfig = LaunchConfig(),
) -> None:
    """y [T, N] += per-segment LoRA delta; segment i = rows [seg_indptr[i], seg_indptr[i+1])
    with slot seg_slots[i] (-1: none). max_seg_len bounds the row blocks of the grid (0 = T)."""
    (num_rows, k), n, rank = x.shape, lora_b.shape[1], lora_a.shape[1]
    plan = plan_sgmv(num_rows, int(seg_slots.shape[0]), max_seg_len, k, n, rank, x.dtype,
                     cuda_device.sm_count(x.device), config)
    # Triton's CPU interpreter multiplies bfloat16 dot operands as their raw uint16 bits (3.9.0),
    # so off CUDA the operands go through float32: exact for 16-bit floats, same products.
    upcast = x.device.type != "cuda" and x.dtype == torch.bfloat16
    _sgmv_kernel[plan.grid](
        y, x, lora_a, lora_b, scaling, seg_indptr, seg_slots, k, n, rank, plan.cols_per_split,
        *_strides(x, lora_a, lora_b, y), **plan.blocks,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
        num_warps=plan.num_warps,
    )


def add_lora_triton(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scaling: torch.Tensor, meta: LoraBatchMeta, out_slice: slice,
    config: LaunchConfig = LaunchConfig(),
) -> None:
    """One part's delta (`lora_reference.add_lora_reference`) on Triton: BGMV when every request
    has one token, SGMV otherwise."""
    y_part = y[:, out_slice]
    if meta.is_decode:
        bgmv(y_part, x, lora_a, lora_b, scaling, meta.token_slots, config)
    else:
        sgmv(y_part, x, lora_a, lora_b, scaling, meta.seg_indptr, meta.seg_slots, meta.max_seg_len, config)


# ---------------------------------------------------------------------------------------------
# Every part of one fused projection in one launch, over row segments grouped by adapter.


@triton.jit
def _parts_kernel(
    y_ptr, x_ptr, rows_ptr, indptr_ptr, slots_ptr,
    a_ptrs, b_ptrs, scaling_ptrs, ranks_ptrs,  # one per part
    widths, columns, split_starts,  # one per part; split_starts has one more (the total)
    stride_as, stride_ar, stride_ak, stride_bs, stride_bn, stride_br,  # one per part
    K, cols_per_split,
    stride_xt, stride_xk, stride_yt, stride_yn,
    NUM_PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, HAS_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    seg = tl.program_id(0)
    split = tl.program_id(2)  # over the column splits of all parts, part 0's first
    slot = tl.load(slots_ptr + seg)
    if slot < 0:
        return
    # This program's part: the last whose first split is <= split. Its arguments are selected,
    # not branched on, so the kernel body exists once whatever the number of parts.
    a_slot = a_ptrs[0] + slot.to(tl.int64) * stride_as[0]
    b_slot = b_ptrs[0] + slot.to(tl.int64) * stride_bs[0]
    scaling_ptr = scaling_ptrs[0]
    ranks_ptr = ranks_ptrs[0]
    width = widths[0]
    column = columns[0]
    first_split = split_starts[0]
    ar, ak, bn, br = stride_ar[0], stride_ak[0], stride_bn[0], stride_br[0]
    for p in tl.static_range(1, NUM_PARTS):
        here = split >= split_starts[p]
        a_slot = tl.where(here, a_ptrs[p] + slot.to(tl.int64) * stride_as[p], a_slot)
        b_slot = tl.where(here, b_ptrs[p] + slot.to(tl.int64) * stride_bs[p], b_slot)
        scaling_ptr = tl.where(here, scaling_ptrs[p], scaling_ptr)
        ranks_ptr = tl.where(here, ranks_ptrs[p], ranks_ptr)
        width = tl.where(here, widths[p], width)
        column = tl.where(here, columns[p], column)
        first_split = tl.where(here, split_starts[p], first_split)
        ar = tl.where(here, stride_ar[p], ar)
        ak = tl.where(here, stride_ak[p], ak)
        bn = tl.where(here, stride_bn[p], bn)
        br = tl.where(here, stride_br[p], br)
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:  # the slot's adapter does not target this part
        return
    _part_rows(
        y_ptr, x_ptr, rows_ptr, a_slot, b_slot, tl.load(scaling_ptr + slot), rank, width, column,
        split - first_split, tl.load(indptr_ptr + seg), tl.load(indptr_ptr + seg + 1), tl.program_id(1),
        K, cols_per_split, stride_xt, stride_xk, stride_yt, stride_yn, ar, ak, bn, br,
        BLOCK_M, BLOCK_K, BLOCK_N, BLOCK_R, HAS_ROWS, DOT_PRECISION, UPCAST,
    )


@dataclass(frozen=True)
class PartsPlan:
    """One launch of `_parts_kernel`: grid (segments, row programs, column splits of all parts),
    where each part's splits start, and the compile-time block sizes."""

    grid: tuple[int, int, int]
    cols_per_split: int
    split_starts: tuple[int, ...]
    blocks: dict[str, int]
    num_warps: int


@functools.lru_cache(maxsize=4096)  # called per fused projection and layer: same shapes every step
def plan_parts(
    num_rows: int, num_segments: int, max_seg_len: int, k: int, widths: tuple[int, ...], rank: int,
    dtype: torch.dtype, sm_count: int, config: LaunchConfig,
) -> PartsPlan:
    """Pure function of host ints. Rows: grid axis 1 has one program per BLOCK_M-row block of the
    longest segment. Columns: one split width for every part, each part at least one split."""
    max_seg_len = max_seg_len if max_seg_len > 0 else num_rows
    block_r = max(16, triton.next_power_of_2(rank))
    block_m = config.block_m or max(16, min(64, triton.next_power_of_2(max_seg_len)))
    if dtype == torch.float32 and config.block_m is None:
        # float32 dots run on FMA units with the tiles in registers: big tiles spill.
        block_m = min(block_m, max(16, 1024 // block_r))
    block_k = config.block_k or (32 if block_r >= 128 else 64)
    # float32 at rank 64 also spills with 128 columns (sm_90 compile report).
    block_n = config.block_n or (64 if block_r >= 128 or (dtype == torch.float32 and block_r >= 64) else 128)
    row_blocks = max(1, triton.cdiv(max_seg_len, block_m))
    tiles = [triton.cdiv(width, block_n) for width in widths]
    requested = config.splits
    if requested is None:
        # ~2 waves of SMs, at most 8 recomputations of the shrink per part.
        busy = triton.cdiv(num_rows, block_m) + num_segments
        requested = min(triton.cdiv(2 * sm_count, max(busy, 1)), 8) * len(widths)
    cols = triton.cdiv(sum(tiles), max(1, min(requested, sum(tiles)))) * block_n
    starts = [0]
    for width in widths:
        starts.append(starts[-1] + triton.cdiv(width, cols))
    blocks = {"BLOCK_M": block_m, "BLOCK_K": block_k, "BLOCK_N": block_n, "BLOCK_R": block_r}
    return PartsPlan((num_segments, row_blocks, starts[-1]), cols, tuple(starts), blocks, config.num_warps)


class FusedLora:
    """The Triton kernel call of one fused projection's parts (q|k|v, gate|up, or one part),
    sharing x: each part (lora_a [S, R_p, in], lora_b [S, out_p, R_p], scaling [S] float32,
    out_slice, slot_ranks int32 [S] or None = R_p). `add` computes, in ONE launch,

        for every segment g of meta.segments with s = slots[g] >= 0, every row t of g, every part p
        with r = slot_ranks_p[s] > 0:
            h = (scaling_p[s] * (lora_a_p[s, :r] @ x[t])).to(dtype)          (float32 accumulate)
            y[t, out_slice_p] += lora_b_p[s, :, :r] @ h

    i.e. `lora_reference.add_lora_reference` per part, with a slot's padded ranks and untargeted parts never read. A
    program takes BLOCK_M rows of one segment, so an adapter's A and B tiles are read once per
    row block, not once per row: a decode batch built by `LoraBatchMeta.build` groups its rows
    by adapter (`adapter_groups`, gathered and scattered through the sorted row list), prefill
    takes its batch-order segments, `LoraBatchMeta.for_rows` one row per segment.

    Parts must write disjoint columns (programs of different parts run concurrently). The
    per-part arguments are fixed here; a call only plans the grid from host ints (rows, segments,
    longest segment) and launches, with no device sync. CUDA graphs: the grid, hence the
    metadata's segment count and longest segment, must be what they were at capture; a graph
    over `for_rows` metadata (segments = rows) qualifies, host-built adapter groups
    (data-dependent counts) run eagerly."""

    def __init__(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, slice,
                                             torch.Tensor | None]]) -> None:
        spans = sorted((out_slice.start, out_slice.start + lora_b.shape[1]) for _, lora_b, _, out_slice, _ in parts)
        if any(end > start for (_, end), (start, _) in zip(spans, spans[1:], strict=False)):
            raise ValueError(f"FusedLora: the parts' columns overlap: {spans}")
        self.dtype = parts[0][0].dtype
        self.in_features = parts[0][0].shape[2]
        self.max_rank = max(lora_a.shape[1] for lora_a, *_ in parts)
        self.widths = tuple(lora_b.shape[1] for _, lora_b, *_ in parts)
        self.end = max(span[1] for span in spans)
        ranks = [r if r is not None else torch.full((a.shape[0],), a.shape[1], dtype=torch.int32, device=a.device)
                 for a, _, _, _, r in parts]
        lora_a = [part[0] for part in parts]
        lora_b = [part[1] for part in parts]
        self._pointers = (tuple(lora_a), tuple(lora_b), tuple(part[2] for part in parts), tuple(ranks))
        self._columns = tuple(out_slice.start for *_, out_slice, _ in parts)
        self._strides = tuple(tuple(t.stride(d) for t in lora_a) for d in range(3)) + tuple(
            tuple(t.stride(d) for t in lora_b) for d in range(3))

    def add(self, y: torch.Tensor, x: torch.Tensor, meta: LoraBatchMeta, config: LaunchConfig = LaunchConfig()) -> None:
        """In place, every part's delta (see the class); x [T, in] and y [T, >= columns' end]
        in the parts' dtype, checked by the caller."""
        segments = meta.segments
        num_rows, k = x.shape
        plan = plan_parts(num_rows, segments.num_segments, segments.max_len, k, self.widths, self.max_rank,
                          x.dtype, cuda_device.sm_count(x.device), config)
        if plan.grid[0] == 0:
            return
        # Triton's interpreter multiplies bfloat16 dot operands as raw bits: see `sgmv`.
        upcast = x.device.type != "cuda" and x.dtype == torch.bfloat16
        rows = segments.rows
        _parts_kernel[plan.grid](
            y, x, rows if rows is not None else segments.indptr, segments.indptr, segments.slots,
            *self._pointers, self.widths, self._columns, plan.split_starts, *self._strides,
            k, plan.cols_per_split, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
            NUM_PARTS=len(self.widths), **plan.blocks, HAS_ROWS=rows is not None,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
            num_warps=plan.num_warps,
        )
