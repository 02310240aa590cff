"""The quantized projection for 1 to 4 rows on CUDA (a single stream's decode step, or a few):
multiply-adds on the CUDA cores instead of tensor-core dots, over the packed layout of
`quant_triton_layout` (`TritonQuantWeight`, read as it is). `quant_gemm.triton_linear` runs it
for the row counts `preferred` names, the dot kernel (`quant_matmul_triton`) for the others.

Why a second kernel: at one row the dot kernel pads the row to a 16-row MMA tile and converts
every weight into the MMA operand layout; on an H100 that cost more than the weight's bytes
(4096 x 4096, one row: 11.5 us per-channel int8 and 21 us 4-bit groups of 32, against 10.9 us for
bfloat16 `F.linear`, which reads 2 to 3.5 times the bytes). Here each program owns BLOCK_N
output features and a range of K blocks (split-K as in the dot kernel, the same counters and
ordered sum), keeps one [BLOCK_R, BLOCK_N] float32 accumulator of x * w terms per row in
registers (up to 4, unrolled), and reduces them over K once at the end: the inner loop is loads,
an integer-to-float conversion and fused multiply-adds, all elementwise.

Weights become float32 either by a plain conversion or (MAGIC) by adding the integer to the bit
pattern of 2^23 (+ 128 for signed 8-bit values) and subtracting that float: exact for these
ranges, and integer adds run at full rate where conversions run at a quarter. A block's scale
and offset are applied to its sums (SCALE_AFTER, the plan's choice: x * q summed over the
block, times s, plus sum(x) * o) or to each weight (w = q * s + o); per-channel scales are
applied once after the loop. Groups of 16 (per-half scales) and groups that are no multiple of
16 stay on the dot kernel (`preferred` never picks this one for them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quiver_server.kernels import cuda_device
from quiver_server.kernels.quant_triton_layout import (
    COUNTERS,
    N_ALIGN,
    PER_BLOCK,
    PER_CHANNEL,
    TritonQuantWeight,
    finish_tile,
    group_vector,
    padded_k,
)

MAX_ROWS = 4  # what the kernel takes (one accumulator set per row, unrolled)


def preferred(packed: TritonQuantWeight, rows: int) -> bool:
    """Whether `quant_gemm.triton_linear` picks it over the dot kernel, from an H100 sweep
    (docs/quantization.md): per-channel 8 bits at 1 row; groups of 128 or more up to 2 rows;
    smaller groups, whose block scales slow the dot kernel's small tiles, up to 4."""
    if packed.scale_mode == PER_CHANNEL:
        return rows == 1
    if packed.scale_mode == PER_BLOCK:
        return 0 < rows <= (2 if packed.tile_k >= 64 else MAX_ROWS)
    return False


@triton.jit
def _weights_as_float(q, BITS: tl.constexpr, MAGIC: tl.constexpr):
    """q's integer value in float32: signed int8 (8 bits) or 0..15 (4 bits, already unpacked)."""
    if MAGIC:
        if BITS == 8:  # 2^23 + 128 + q, with 128 + q in 0..255: inside the mantissa
            return (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        return (q.to(tl.int32) + 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return q.to(tl.float32)


@triton.jit
def _row_terms(acc, xsum, x_ptr, row, M, K, k_lo, k_hi, stride_xm, stride_xk, w_lo, w_hi, XSUM: tl.constexpr):
    """acc + x[row] * w over one step's [BLOCK_R] low and high K values (x = 0 past M and K)."""
    x_row = x_ptr + row * stride_xm
    k_end = tl.where(M > row, K, 0)  # a padding row reads nothing
    x_lo = tl.load(x_row + k_lo * stride_xk, mask=k_lo < k_end, other=0.0).to(tl.float32)
    x_hi = tl.load(x_row + k_hi * stride_xk, mask=k_hi < k_end, other=0.0).to(tl.float32)
    acc += x_lo[:, None] * w_lo
    acc += x_hi[:, None] * w_hi
    if XSUM:
        xsum += x_lo + x_hi
    return acc, xsum


@triton.jit
def _scaled_block(acc, blk, bxs, scale, offset, HAS_OFFSETS: tl.constexpr):
    """acc + a block's sums x * q times its scales, plus its sums of x times its offsets."""
    acc += blk * scale[None, :]
    if HAS_OFFSETS:
        acc += bxs[:, None] * offset[None, :]
    return acc


@triton.jit
def _row_out(out, acc, xsum, row, offs_m, scale, offset, PER_CHANNEL_SCALE: tl.constexpr, XSUM: tl.constexpr):
    """out [BLOCK_M, BLOCK_N] with row `row` set to acc summed over K, times the per-channel
    scale, plus sum(x) * the per-channel offset, where the weight has them."""
    part = tl.sum(acc, axis=0)
    if PER_CHANNEL_SCALE:
        part *= scale
    if XSUM:
        part += tl.sum(xsum, axis=0) * offset
    return tl.where(offs_m[:, None] == row, part[None, :], out)


@triton.jit
def _quant_gemv_kernel(
    y_ptr, x_ptr, q_ptr, scales_ptr, offsets_ptr, bias_ptr, partial_ptr, counter_ptr,
    M, N, K, n_pad, group_size, num_groups, blocks_per_split, num_blocks,
    stride_xm, stride_xk, stride_ym,
    BITS: tl.constexpr, TILE_K: tl.constexpr, SCALES: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr, MAGIC: tl.constexpr, SCALE_AFTER: tl.constexpr,
):
    # One [BLOCK_R, BLOCK_N] accumulator per row (up to 4, unrolled by BLOCK_M): the weight tile
    # is loaded, converted and multiplied in one register layout, with no shared-memory shuffle
    # into a 3-D [rows, BLOCK_R, BLOCK_N] layout.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    q_cols = q_ptr + offs_r[:, None] * n_pad + offs_n[None, :]
    XSUM: tl.constexpr = SCALES == 0 and HAS_OFFSETS  # per-channel offsets: sum(x) * offset at the end
    acc0 = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    xsum0 = tl.zeros((BLOCK_R,), dtype=tl.float32)
    xsum1 = tl.zeros((BLOCK_R,), dtype=tl.float32)
    xsum2 = tl.zeros((BLOCK_R,), dtype=tl.float32)
    xsum3 = tl.zeros((BLOCK_R,), dtype=tl.float32)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, num_blocks)
    # Block scales on each weight (w = q * s + o, then x * w) or, SCALE_AFTER, on the block's
    # sums (x * q summed over the block, times s, plus sum(x) * o): one multiply-add per weight
    # instead of three.
    PER_WEIGHT: tl.constexpr = SCALES == 1 and not SCALE_AFTER
    PER_SUM: tl.constexpr = SCALES == 1 and SCALE_AFTER
    for block in range(first, last):
        k = block * (2 * TILE_K)  # a block: TILE_K low values and TILE_K high ones (the layout)
        if SCALES == 1:  # PER_BLOCK: one group holds the whole block
            scale = group_vector(scales_ptr, k // group_size, num_groups, n_pad, offs_n)
            if HAS_OFFSETS:
                offset = group_vector(offsets_ptr, k // group_size, num_groups, n_pad, offs_n)
            else:
                offset = scale  # never read: no offsets
        if PER_SUM:
            blk0 = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
            blk1 = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
            blk2 = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
            blk3 = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
            bxs0 = tl.zeros((BLOCK_R,), dtype=tl.float32)
            bxs1 = tl.zeros((BLOCK_R,), dtype=tl.float32)
            bxs2 = tl.zeros((BLOCK_R,), dtype=tl.float32)
            bxs3 = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for r in tl.static_range(0, TILE_K, BLOCK_R):
            k_lo = k + r + offs_r
            k_hi = k_lo + TILE_K
            if BITS == 4:
                packed = tl.load(q_cols + (k // 2 + r).to(tl.int64) * n_pad)
                w_lo = _weights_as_float(packed & 15, BITS, MAGIC)
                w_hi = _weights_as_float(packed >> 4, BITS, MAGIC)
            else:
                w_lo = _weights_as_float(tl.load(q_cols + (k + r).to(tl.int64) * n_pad), BITS, MAGIC)
                w_hi = _weights_as_float(tl.load(q_cols + (k + TILE_K + r).to(tl.int64) * n_pad), BITS, MAGIC)
            if PER_WEIGHT:
                w_lo = w_lo * scale[None, :]
                w_hi = w_hi * scale[None, :]
                if HAS_OFFSETS:
                    w_lo += offset[None, :]
                    w_hi += offset[None, :]
            if PER_SUM:
                blk0, bxs0 = _row_terms(blk0, bxs0, x_ptr, 0, M, K, k_lo, k_hi, stride_xm, stride_xk, w_lo, w_hi,
                                        HAS_OFFSETS)
                if BLOCK_M > 1:
                    blk1, bxs1 = _row_terms(blk1, bxs1, x_ptr, 1, M, K, k_lo, k_hi, stride_xm, stride_xk, w_lo, w_hi,
                                            HAS_OFFSETS)
                if BLOCK_M > 2:
                    blk2, bxs2 = _row_terms(blk2, bxs2, x_ptr, 2, M, K, k_lo, k_hi, stride_xm, stride_xk, w_lo, w_hi,
                                            HAS_OFFSETS)
                    blk3, bxs3 = _row_terms(blk3, bxs3, x_ptr, 3, M, K, k_lo, k_hi, stride_xm, stride_xk, w_lo, w_hi,
                                            HAS_OFFSETS)
            else:
                acc0, xsum0 = _row_terms(acc0, xsum0, x_ptr, 0, M, K, k_lo, k_hi, stride_xm, stride_xk, w_lo, w_hi,
                                         XSUM)
                if BLOCK_M > 1:
                    acc1, xsum1 = _row_terms(acc1, xsum1, x_ptr, 1, M, K, k_lo, k_hi, stride_xm, stride_xk, w_lo,
                                             w_hi, XSUM)
                if BLOCK_M > 2:
                    acc2, xsum2 = _row_terms(acc2, xsum2, x_ptr, 2, M, K, k_lo, k_hi, stride_xm, stride_xk, w_lo,
                                             w_hi, XSUM)
                    acc3, xsum3 = _row_terms(acc3, xsum3, x_ptr, 3, M, K, k_lo, k_hi, stride_xm, stride_xk, w_lo,
                                             w_hi, XSUM)
        if PER_SUM:
            acc0 = _scaled_block(acc0, blk0, bxs0, scale, offset, HAS_OFFSETS)
            if BLOCK_M > 1:
                acc1 = _scaled_block(acc1, blk1, bxs1, scale, offset, HAS_OFFSETS)
            if BLOCK_M > 2:
                acc2 = _scaled_block(acc2, blk2, bxs2, scale, offset, HAS_OFFSETS)
                acc3 = _scaled_block(acc3, blk3, bxs3, scale, offset, HAS_OFFSETS)
    offs_m = tl.arange(0, BLOCK_M)
    scale0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    offset0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if SCALES == 0:
        scale0 = group_vector(scales_ptr, 0, num_groups, n_pad, offs_n)
    if XSUM:
        offset0 = group_vector(offsets_ptr, 0, num_groups, n_pad, offs_n)
    PER_CHANNEL_SCALE: tl.constexpr = SCALES == 0
    out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    out = _row_out(out, acc0, xsum0, 0, offs_m, scale0, offset0, PER_CHANNEL_SCALE, XSUM)
    if BLOCK_M > 1:
        out = _row_out(out, acc1, xsum1, 1, offs_m, scale0, offset0, PER_CHANNEL_SCALE, XSUM)
    if BLOCK_M > 2:
        out = _row_out(out, acc2, xsum2, 2, offs_m, scale0, offset0, PER_CHANNEL_SCALE, XSUM)
        out = _row_out(out, acc3, xsum3, 3, offs_m, scale0, offset0, PER_CHANNEL_SCALE, XSUM)
    finish_tile(out, y_ptr, bias_ptr, partial_ptr, counter_ptr, pid_n, tl.cdiv(N, BLOCK_N), split, offs_m, offs_n,
                M, N, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_K)


@dataclass(frozen=True)
class GemvConfig:
    """Overrides of the plan's choices (tests, benchmarks); None: the heuristic's."""

    block_r: int | None = None
    block_n: int | None = None
    split_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    magic: bool | None = None
    scale_after: bool | None = None


@dataclass(frozen=True)
class GemvPlan:
    block_m: int
    block_r: int
    block_n: int
    split_k: int
    blocks_per_split: int
    num_warps: int
    num_stages: int
    magic: bool
    scale_after: bool


@functools.lru_cache(maxsize=4096)
def _plan(m: int, n: int, k: int, bits: int, tile_k: int, sm_count: int, config: GemvConfig) -> GemvPlan:
    """Rows padded to a power of two (1, 2 or 4 accumulator sets); steps of 16 x BLOCK_N
    weights, BLOCK_N 128 for one row of 8-bit weights (16-byte loads) and 64 otherwise (twice
    the programs, fewer registers a row); block scales on the block sums; K split until about 16
    programs per SM, each keeping at least 2 blocks. Chosen from a sweep on an H100 of the 8B
    shapes' o (4096 x 4096) and gate/up (28672 x 4096) projections at 1, 2 and 4 rows."""
    block_m = triton.next_power_of_2(m)
    block_n = config.block_n or (128 if bits == 8 and m == 1 else 64)
    block_r = config.block_r or min(tile_k, 16)
    if N_ALIGN % block_n or block_r > tile_k or tile_k % block_r:
        raise ValueError(f"BLOCK_N must divide {N_ALIGN} and BLOCK_R divide TILE_K ({tile_k})")
    num_blocks = padded_k(k) // (2 * tile_k)
    tiles = triton.cdiv(n, block_n)
    split_k = config.split_k
    if split_k is None:
        wanted = 16 * sm_count
        split_k = 1 if tiles >= wanted or tiles > COUNTERS else min(triton.cdiv(wanted, tiles), num_blocks // 2, 32)
    split_k = max(1, min(split_k, num_blocks))
    if split_k > 1 and tiles > COUNTERS:
        raise ValueError(f"split-K needs at most {COUNTERS} output tiles, got {tiles}")
    blocks_per_split = triton.cdiv(num_blocks, split_k)
    magic = True if config.magic is None else config.magic
    scale_after = True if config.scale_after is None else config.scale_after
    return GemvPlan(block_m, block_r, block_n, triton.cdiv(num_blocks, blocks_per_split), blocks_per_split,
                    config.num_warps or 4, config.num_stages or 2, magic, scale_after)


def gemv_plan(m: int, packed: TritonQuantWeight, device: torch.device, config: GemvConfig = GemvConfig()) -> GemvPlan:
    return _plan(m, packed.out_features, packed.in_features, packed.bits, packed.tile_k, cuda_device.sm_count(device),
                 config)


def quant_gemv(rows: torch.Tensor, packed: TritonQuantWeight, bias: torch.Tensor | None, y: torch.Tensor,
               config: GemvConfig = GemvConfig()) -> None:
    """y [m, N] = rows [m, K] @ dequant(W)^T + bias for 1 <= m <= MAX_ROWS, of per-channel or per-block scales
    (what `preferred` picks it for; a `GemvConfig` forces it)."""
    m, k = rows.shape
    n = packed.out_features
    plan = gemv_plan(m, packed, rows.device, config)
    num_blocks = padded_k(k) // (2 * packed.tile_k)
    tiles = triton.cdiv(n, plan.block_n)
    partial = y  # unused unless split
    if plan.split_k > 1:
        partial = torch.empty(plan.split_k * tiles * plan.block_m * plan.block_n, dtype=torch.float32,
                              device=rows.device)
    _quant_gemv_kernel[(tiles, plan.split_k)](
        y, rows, packed.q, packed.scales, packed.offsets, bias, partial, packed.counters,
        m, n, k, int(packed.q.shape[1]), packed.group_size, packed.num_groups, plan.blocks_per_split, num_blocks,
        rows.stride(0), rows.stride(1), y.stride(0),
        BITS=packed.bits, TILE_K=packed.tile_k, SCALES=packed.scale_mode, HAS_OFFSETS=packed.offsets is not None,
        HAS_BIAS=bias is not None, BLOCK_M=plan.block_m, BLOCK_R=plan.block_r, BLOCK_N=plan.block_n,
        SPLIT_K=plan.split_k, MAGIC=plan.magic, SCALE_AFTER=plan.scale_after,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
