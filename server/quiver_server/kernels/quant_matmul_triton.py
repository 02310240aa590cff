"""The dot kernel of the Triton quantized projections: y = x @ dequant(W)^T + bias on tensor cores,
over the packed layout of `quant_triton_layout` (`TritonQuantWeight`: the weight layout, its scale
modes and the split-K protocol are described there). `quant_gemm.triton_linear` runs it for the row
counts where the multiply-add kernel (`quant_gemv_triton`) does not win.

Scales are applied after the dot, not to each weight: a tile's partial sum p = x @ q (q is a small
integer, exact in every dtype; 16-bit x times q is exact in float32) becomes p * scale + sum(x) *
offset per group, so the products carry no rounding of a dequantized weight to the activation
dtype, and the inner loop converts q without multiplying it. By the weight's scale mode:
per-channel scales once at the end, per block one scale FMA per block, per half one per half;
per element dequantizes every element in float32 and runs float32 dots: correct, not fast.

One kernel, grid (output tiles, K splits), tiles of BLOCK_M rows x BLOCK_N features (`_plan`):
- decode (<= 32 rows): 16- or 32-row tiles of 128 features, mma.sync dots; when the output tiles
  cannot fill the SMs, K is split (split-K, the layout module's `finish_tile`).
- prefill: 128 x 128 tiles, 8 warps, wgmma dots, grouped tile order (GROUP_M row tiles share a
  weight column strip while it is in L2). There a block scale FMA on the whole [128, 128]
  accumulator per 2 * TILE_K of K costs as much as the MMA when TILE_K is 16 or 32 (groups of
  32 or 64), so those tiles dequantize each weight (float32 q * scale + offset) into x's dtype
  and accumulate in place (`Plan.weights_in_x`: the one place a weight is rounded to x's dtype,
  as a 16-bit checkpoint's weights are). Measured on an H100 (bench: 2048 x 4096 x 4096,
  bfloat16): groups of 32 went from 80 to 167 TFLOP/s; groups of 128 keep the exact path (228
  against 171 dequantized); per-channel int8 runs at 365.
At 1 to 4 rows this kernel pads the rows to a 16-row MMA tile and converts every weight into the
MMA operand layout, which cost more than the weight's bytes on an H100 (4096 x 4096, one row:
11.5 us per-channel int8, 21 us 4-bit groups of 32, against 10.9 us for bfloat16 `F.linear`):
`quant_gemm.triton_linear` sends the row counts where that loses to the multiply-add kernel
(`quant_gemv_triton`, same layout).

Under Triton's CPU interpreter (tests), bfloat16 dot operands go through float32 (the
interpreter multiplies bfloat16 as raw bits, see lora_triton.py): the same exact products.
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
    PER_ELEMENT,
    PER_HALF,
    TritonQuantWeight,
    finish_tile,
    group_vector,
    padded_k,
)

ITER_K = 128  # K values per loop iteration: UNROLL blocks of 2 * TILE_K (K_ALIGN is a multiple)


@triton.jit
def _scaled_half(acc, x, q, k, group_size, num_groups, n_pad, offs_n, scales_ptr, offsets_ptr,
                 HAS_OFFSETS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + (x @ q) * scale + sum(x) * offset for one TILE_K half inside group k // group_size."""
    group = k // group_size
    part = tl.dot(x, q.to(x.dtype), input_precision=DOT_PRECISION)
    acc += part * group_vector(scales_ptr, group, num_groups, n_pad, offs_n)[None, :]
    if HAS_OFFSETS:
        xsum = tl.sum(x.to(tl.float32), axis=1)
        acc += xsum[:, None] * group_vector(offsets_ptr, group, num_groups, n_pad, offs_n)[None, :]
    return acc


@triton.jit
def _weights_dot(acc, x, q, k, group_size, num_groups, n_pad, offs_n, scales_ptr, offsets_ptr, y_ptr,
                 HAS_OFFSETS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + x @ w, w = q * scale + offset of group k // group_size in float32, rounded to the
    activation dtype (y's): the prefill path, where the dots accumulate in place."""
    group = k // group_size
    w = q.to(tl.float32) * group_vector(scales_ptr, group, num_groups, n_pad, offs_n)[None, :]
    if HAS_OFFSETS:
        w += group_vector(offsets_ptr, group, num_groups, n_pad, offs_n)[None, :]
    return tl.dot(x, w.to(y_ptr.dtype.element_ty).to(x.dtype), acc, input_precision=DOT_PRECISION)


@triton.jit
def _dequantized_half(acc, x, q, k, offs_t, group_size, num_groups, n_pad, offs_n, scales_ptr, offsets_ptr,
                      HAS_OFFSETS: tl.constexpr):
    """acc + x @ w with w dequantized per element in float32 (groups not aligned to TILE_K)."""
    groups = tl.minimum((k + offs_t) // group_size, num_groups - 1).to(tl.int64) * n_pad
    table = groups[:, None] + offs_n[None, :]
    w = q.to(tl.float32) * tl.load(scales_ptr + table).to(tl.float32)
    if HAS_OFFSETS:
        w += tl.load(offsets_ptr + table).to(tl.float32)
    return tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")


@triton.jit
def _quant_matmul_kernel(
    y_ptr, x_ptr, q_ptr, scales_ptr, offsets_ptr, bias_ptr, partial_ptr, counter_ptr,
    M, N, K, n_pad, group_size, num_groups, iters_per_split, num_iters,
    stride_xm, stride_xk, stride_ym,
    BITS: tl.constexpr, TILE_K: tl.constexpr, SCALES: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, UNROLL: tl.constexpr, WEIGHTS_IN_X: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):

    # Grouped tile order: GROUP_M row tiles walk the column tiles together, so a weight strip is
    # read from DRAM once per group of row tiles rather than once per row tile.
    tile = tl.program_id(0)
    split = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    rows_here = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % rows_here
    pid_n = (tile % per_group) // rows_here

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, TILE_K)
    m_mask = offs_m < M
    # 64-bit scalar bases, 32-bit offsets inside the tiles.
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    q_tile = q_ptr + offs_t[:, None] * n_pad + offs_n[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xsum = tl.zeros((BLOCK_M,), dtype=tl.float32)  # PER_CHANNEL with offsets: sum of x over K
    first = split * iters_per_split
    last = tl.minimum(first + iters_per_split, num_iters)
    for it in range(first, last):
        for u in tl.static_range(UNROLL):
            k = (it * UNROLL + u) * (2 * TILE_K)  # this block's first K index
            k_lo = k + offs_t
            k_hi = k_lo + TILE_K
            x_lo = tl.load(x_rows + k_lo[None, :] * stride_xk, mask=m_mask[:, None] & (k_lo < K)[None, :], other=0.0)
            x_hi = tl.load(x_rows + k_hi[None, :] * stride_xk, mask=m_mask[:, None] & (k_hi < K)[None, :], other=0.0)
            if UPCAST:
                x_lo = x_lo.to(tl.float32)
                x_hi = x_hi.to(tl.float32)
            if BITS == 4:
                packed = tl.load(q_tile + (k // 2).to(tl.int64) * n_pad)
                q_lo = packed & 15
                q_hi = packed >> 4
            else:
                q_lo = tl.load(q_tile + k.to(tl.int64) * n_pad)
                q_hi = tl.load(q_tile + (k + TILE_K).to(tl.int64) * n_pad)
            if SCALES == 0:  # PER_CHANNEL: plain dots, scaled once after the loop
                acc = tl.dot(x_lo, q_lo.to(x_lo.dtype), acc, input_precision=DOT_PRECISION)
                acc = tl.dot(x_hi, q_hi.to(x_hi.dtype), acc, input_precision=DOT_PRECISION)
                if HAS_OFFSETS:
                    xsum += tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
            elif SCALES == 3:  # PER_ELEMENT
                acc = _dequantized_half(acc, x_lo, q_lo, k, offs_t, group_size, num_groups, n_pad, offs_n,
                                        scales_ptr, offsets_ptr, HAS_OFFSETS)
                acc = _dequantized_half(acc, x_hi, q_hi, k + TILE_K, offs_t, group_size, num_groups, n_pad, offs_n,
                                        scales_ptr, offsets_ptr, HAS_OFFSETS)
            elif WEIGHTS_IN_X:  # prefill tiles, PER_BLOCK or PER_HALF
                acc = _weights_dot(acc, x_lo, q_lo, k, group_size, num_groups, n_pad, offs_n, scales_ptr,
                                   offsets_ptr, y_ptr, HAS_OFFSETS, DOT_PRECISION)
                acc = _weights_dot(acc, x_hi, q_hi, k + TILE_K, group_size, num_groups, n_pad, offs_n, scales_ptr,
                                   offsets_ptr, y_ptr, HAS_OFFSETS, DOT_PRECISION)
            elif SCALES == 1:  # PER_BLOCK: both halves in group k // group_size
                part = tl.dot(x_lo, q_lo.to(x_lo.dtype), input_precision=DOT_PRECISION)
                part = tl.dot(x_hi, q_hi.to(x_hi.dtype), part, input_precision=DOT_PRECISION)
                acc += part * group_vector(scales_ptr, k // group_size, num_groups, n_pad, offs_n)[None, :]
                if HAS_OFFSETS:
                    block_sum = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
                    offset = group_vector(offsets_ptr, k // group_size, num_groups, n_pad, offs_n)
                    acc += block_sum[:, None] * offset[None, :]
            else:  # PER_HALF
                acc = _scaled_half(acc, x_lo, q_lo, k, group_size, num_groups, n_pad, offs_n, scales_ptr,
                                   offsets_ptr, HAS_OFFSETS, DOT_PRECISION)
                acc = _scaled_half(acc, x_hi, q_hi, k + TILE_K, group_size, num_groups, n_pad, offs_n, scales_ptr,
                                   offsets_ptr, HAS_OFFSETS, DOT_PRECISION)
    if SCALES == 0:
        acc = acc * group_vector(scales_ptr, 0, num_groups, n_pad, offs_n)[None, :]
        if HAS_OFFSETS:
            acc += xsum[:, None] * group_vector(offsets_ptr, 0, num_groups, n_pad, offs_n)[None, :]

    finish_tile(acc, y_ptr, bias_ptr, partial_ptr, counter_ptr, tile, tiles_m * tiles_n, split, offs_m, offs_n,
                M, N, stride_ym, HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_K)


@dataclass(frozen=True)
class LaunchConfig:
    """Overrides of the plan's choices (tests, benchmarks); None: the heuristic's."""

    block_m: int | None = None
    block_n: int | None = None
    split_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


@dataclass(frozen=True)
class Plan:
    block_m: int
    block_n: int
    split_k: int
    iters_per_split: int
    num_warps: int
    num_stages: int
    weights_in_x: bool  # dequantize each weight into x's dtype (prefill) rather than scale sums

    def grid(self, m: int, n: int) -> tuple[int, int]:
        return triton.cdiv(m, self.block_m) * triton.cdiv(n, self.block_n), self.split_k


@functools.lru_cache(maxsize=4096)  # per projection and batch size: the same shapes every step
def _plan(m: int, n: int, k: int, dtype: torch.dtype, scale_mode: int, tile_k: int, sm_count: int,
          config: LaunchConfig) -> Plan:
    """Decode sizes (<= 32 rows): 16- or 32-row tiles of 128 features, 4 warps, 3 stages, and
    split-K up to ~2 programs per SM (best of a sweep of 32/64/128 features, 2/4 warps and split
    factors on an H100, 4096 x 4096 at 1 and 16 rows). Prefill: 128 x 128 tiles, 8 warps, weights
    dequantized into x's dtype where block scales would cost an FMA per accumulator element every
    32 or 64 K values (the module docstring). float32 dots, and per-element scales, run on FMA
    units with the tiles in registers: kept small, and per-element scale tiles 2 stages deep
    (4 overflowed the shared memory)."""
    if m <= 16:
        block_m, block_n, warps, stages = 16, 128, 4, 3
    elif m <= 32:
        block_m, block_n, warps, stages = 32, 128, 4, 3
    elif m <= 64:
        block_m, block_n, warps, stages = 64, 64, 4, 3
    else:
        block_m, block_n, warps, stages = 128, 128, 8, 3
    if dtype == torch.float32 or scale_mode == PER_ELEMENT:
        block_m, block_n, warps = min(block_m, 32), 64, 4
        stages = 2 if scale_mode == PER_ELEMENT else stages
    block_m, block_n = config.block_m or block_m, config.block_n or block_n
    if N_ALIGN % block_n or block_m < 16 or block_n < 16:  # weight loads stay inside the N padding
        raise ValueError(f"BLOCK_N must divide {N_ALIGN} and tiles be >= 16, got {block_m} x {block_n}")
    warps, stages = config.num_warps or warps, config.num_stages or stages
    num_iters = padded_k(k) // ITER_K
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = config.split_k
    if split_k is None:
        # Split only below one wave, and keep >= 4 iterations (512 K values) per split, so that
        # the weight bytes a split reads dwarf the float32 partial tile it writes.
        split_k = 1 if tiles >= sm_count else min(triton.cdiv(2 * sm_count, tiles), num_iters // 4, 16)
    split_k = max(1, min(split_k, num_iters))
    if split_k > 1 and tiles > COUNTERS:
        raise ValueError(f"split-K needs at most {COUNTERS} output tiles, got {tiles}")
    iters_per_split = triton.cdiv(num_iters, split_k)
    per_block_fma = scale_mode == PER_HALF or (scale_mode == PER_BLOCK and tile_k < 64)
    weights_in_x = dtype != torch.float32 and block_m >= 64 and per_block_fma
    return Plan(block_m, block_n, triton.cdiv(num_iters, iters_per_split), iters_per_split, warps, stages,
                weights_in_x)


def launch_plan(m: int, packed: TritonQuantWeight, dtype: torch.dtype, device: torch.device,
                config: LaunchConfig = LaunchConfig()) -> Plan:
    """The launch `quant_matmul` makes for m rows of `dtype` on `device`."""
    return _plan(m, packed.out_features, packed.in_features, dtype, packed.scale_mode, packed.tile_k,
                 cuda_device.sm_count(device), config)


def quant_matmul(rows: torch.Tensor, packed: TritonQuantWeight, bias: torch.Tensor | None, y: torch.Tensor,
                 config: LaunchConfig = LaunchConfig()) -> None:
    """y [m, N] = rows [m, K] @ dequant(W)^T + bias, float32 accumulation, for any m >= 1.
    Exact products (the dequantized weight in float32) except on prefill tiles of 16-bit x, where
    each weight is rounded to x's dtype once (`Plan.weights_in_x`), as a 16-bit model's weights
    are. `quant_gemm.triton_linear` checks the arguments."""
    m, k = rows.shape
    n = packed.out_features
    n_pad = int(packed.q.shape[1])
    num_iters = padded_k(k) // ITER_K
    plan = launch_plan(m, packed, rows.dtype, rows.device, config)
    grid = plan.grid(m, n)
    partial = y  # unused unless split: any tensor keeps the signature
    if plan.split_k > 1:
        partial = torch.empty(plan.split_k * grid[0] * plan.block_m * plan.block_n, dtype=torch.float32,
                              device=rows.device)
    # The interpreter multiplies bfloat16 dot operands as raw bits: float32 operands there.
    upcast = rows.device.type != "cuda" and rows.dtype == torch.bfloat16
    precision = "ieee" if rows.dtype == torch.float32 or upcast else "tf32"  # 16-bit dots ignore it
    _quant_matmul_kernel[grid](
        y, rows, packed.q, packed.scales, packed.offsets, bias, partial, packed.counters,
        m, n, k, n_pad, packed.group_size, packed.num_groups, plan.iters_per_split, num_iters,
        rows.stride(0), rows.stride(1), y.stride(0),
        BITS=packed.bits, TILE_K=packed.tile_k, SCALES=packed.scale_mode, HAS_OFFSETS=packed.offsets is not None,
        HAS_BIAS=bias is not None, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, GROUP_M=8,
        SPLIT_K=plan.split_k, UNROLL=ITER_K // (2 * packed.tile_k),
        WEIGHTS_IN_X=plan.weights_in_x, UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
