"""Triton kernels for batched LoRA: BGMV (decode rows) and SGMV (prefill segments).

Both compute, in ONE launch per call, exactly `lora_reference.add_lora_reference`:

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
graph with static metadata buffers. `bench/lora_compile_report.py` compiles the plans for sm_90a
without a GPU (registers, spills, wgmma); `bench/lora_kernels.py` times them on one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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
    block = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(seg_slots_ptr + seg)
    if slot < 0:
        return
    m0 = tl.load(seg_indptr_ptr + seg) + block * BLOCK_M
    rows_left = tl.load(seg_indptr_ptr + seg + 1) - m0
    if rows_left <= 0:
        return
    # 64-bit scalar bases, 32-bit offsets inside the tiles: half the registers of 64-bit tiles.
    x_blk = x_ptr + m0.to(tl.int64) * stride_xt
    y_blk = y_ptr + m0.to(tl.int64) * stride_yt
    a_slot = a_ptr + slot.to(tl.int64) * stride_as
    b_slot = b_ptr + slot.to(tl.int64) * stride_bs
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < rows_left
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = offs_r < R

    # Shrink: h[BLOCK_M, BLOCK_R] = x[rows, :] @ A[slot]^T, accumulated in float32.
    x_rows = x_blk + offs_m[:, None] * stride_xt
    a_cols = a_slot + offs_r[None, :] * stride_ar
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
    h = (acc * tl.load(scaling_ptr + slot)).to(b_ptr.dtype.element_ty)
    if UPCAST:
        h = h.to(tl.float32)

    # Expand into this program's columns [n_start, n_end): y[rows, n] += h @ B[slot][n, :]^T.
    n_start = split * cols_per_split
    n_end = tl.minimum(n_start + cols_per_split, N)
    offs_n = tl.arange(0, BLOCK_N)
    b_rows = b_slot + offs_r[:, None] * stride_br
    y_rows = y_blk + offs_m[:, None] * stride_yt
    for n0 in range(n_start, n_end, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < n_end
        bt = tl.load(b_rows + n[None, :] * stride_bn, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            bt = bt.to(tl.float32)
        delta = tl.dot(h, bt, input_precision=DOT_PRECISION)
        y_mask = m_mask[:, None] & n_mask[None, :]
        yv = tl.load(y_rows + n[None, :] * stride_yn, mask=y_mask, other=0.0)
        tl.store(
            y_rows + n[None, :] * stride_yn,
            (yv.to(tl.float32) + delta).to(y_ptr.dtype.element_ty),
            mask=y_mask,
        )


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and column splits of one launch; None = the heuristic's choice."""

    block_m: int | None = None  # SGMV rows per program
    block_k: int | None = None
    block_n: int | None = None
    splits: int | None = None
    num_warps: int = 4


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter on CPU: any small number keeps tests quick
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class Plan:
    """One launch: grid, columns per split and the kernel's compile-time block sizes. Pure
    function of the shapes, so `bench/lora_compile_report.py` compiles exactly what runs."""

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
    plan = plan_bgmv(num_rows, k, n, rank, _sm_count(x.device), config)
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
                     _sm_count(x.device), config)
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
    """`add_lora` on Triton: BGMV when every request has one token, SGMV otherwise."""
    y_part = y[:, out_slice]
    if meta.is_decode:
        bgmv(y_part, x, lora_a, lora_b, scaling, meta.token_slots, config)
    else:
        sgmv(y_part, x, lora_a, lora_b, scaling, meta.seg_indptr, meta.seg_slots, meta.max_seg_len, config)
