"""Weight-only quantized projections on CUDA in Triton: y = x @ dequant(W)^T + bias for a
`quant.QuantizedWeight` (w[n, k] = q[n, k] * scale[n, g] + offset[n, g], g = k // group_size),
x in the model dtype (float32, bfloat16, float16), float32 accumulation, y in x's dtype.

`pack_for_triton` rewrites the weight once at load into `TritonQuantWeight`:

- q transposed to [K_pad, N_pad] (8 bits, int8) or [K_pad / 2, N_pad] (4 bits, uint8, two values
  a byte): output features are the contiguous axis, so a program's [TILE_K, BLOCK_N] weight tile
  is TILE_K rows of BLOCK_N consecutive bytes (coalesced, vectorised) and its scales for one
  group are one contiguous [BLOCK_N] vector (the [N, groups] source layout would fetch one float
  per 32-byte sector). K is padded to a multiple of 128 and N to one of 128 with q = 0 and zero
  scales, so no weight or scale load needs a mask (x's loads are masked instead, and padded
  weights meet x = 0).
- 4-bit pairs: K is cut in blocks of 2 * TILE_K; byte row b * TILE_K + j holds q at k = 2 * TILE_K
  * b + j in its low nibble and k = 2 * TILE_K * b + TILE_K + j in its high nibble. Unpacking is
  `& 15` and `>> 4`, and each nibble plane is already a [TILE_K, BLOCK_N] dot operand for x's
  columns [start, start + TILE_K) and [start + TILE_K, start + 2 TILE_K): no interleave, join or
  reshape in registers. 8-bit weights keep one int8 per element and run the same two-half block.
- scales and offsets transposed to [groups, N_pad], stored in float16 or bfloat16 where every
  value survives the round trip exactly (Q8_0, Q4_0, Q4_1: 16-bit scales and their multiples by
  8), else float32 (Q4_K and Q6_K's d * sub-scale, AWQ/GPTQ's -scale * zero, --quantize): half the
  bytes where that is free, never a changed weight.

Scales are applied after the dot, not to each weight: a tile's partial sum p = x @ q (q is a small
integer, exact in every dtype; 16-bit x times q is exact in float32) becomes p * scale + sum(x) *
offset per group, so the products carry no rounding of a dequantized weight to the activation
dtype, and the inner loop converts q without multiplying it. TILE_K follows the group size
(`_tiling`): a whole-row group (per-channel int8) scales once at the end; groups that are a
multiple of 32 give blocks of 2 * TILE_K inside one group (one scale FMA per block); groups of 16
scale each half; any other group size (none of the formats has one) dequantizes every element in
float32 and runs float32 dots: correct, not fast.

One kernel, grid (output tiles, K splits), tiles of BLOCK_M rows x BLOCK_N features (`_plan`):
- decode (<= 32 rows): 16- or 32-row tiles of 128 features, mma.sync dots; when the output tiles
  cannot fill the SMs, K is split (split-K): each split writes its float32 partial tile to a
  workspace, bumps the tile's arrival counter, and the last to arrive sums the partials in split
  order (deterministic whatever the arrival order), adds the bias, stores y and resets the
  counter to 0 for the next launch: one launch, no memset, no spin-wait.
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
`quant_linear` sends the row counts where that loses to the multiply-add kernel
(`quant_gemv_triton`, same layout).
Grids and block sizes come from shapes, never from device values: launches can be captured in
CUDA graphs. The counters belong to the packed weight, so launches of one weight must not
overlap (one stream, as the model runs).

Under Triton's CPU interpreter (tests), bfloat16 dot operands go through float32 (the
interpreter multiplies bfloat16 as raw bits, see lora_triton.py): the same exact products.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from quiver_server.kernels.lora_triton import _sm_count
from quiver_server.quant.weights import QuantizedWeight

if TYPE_CHECKING:
    from quiver_server.kernels.quant_gemv_triton import GemvConfig

K_ALIGN = 128  # K padding: a multiple of every block (2 * TILE_K <= 128) and of each iteration
N_ALIGN = 128  # N padding: the widest BLOCK_N
ITER_K = 128  # K values per loop iteration: UNROLL blocks of 2 * TILE_K
COUNTERS = 512  # split-K arrival counters per weight: split-K is only planned for fewer tiles

# How scales reach the products (constexpr SCALES).
PER_CHANNEL, PER_BLOCK, PER_HALF, PER_ELEMENT = 0, 1, 2, 3


@dataclass(frozen=True)
class TritonQuantWeight:
    bits: int
    out_features: int  # N
    in_features: int  # K
    group_size: int
    tile_k: int  # TILE_K: K values of one dot; a block is two of them (two nibble planes)
    scale_mode: int  # PER_CHANNEL, PER_BLOCK, PER_HALF or PER_ELEMENT
    q: torch.Tensor  # int8 [K_pad, N_pad] or uint8 [K_pad / 2, N_pad] (see the module docstring)
    scales: torch.Tensor  # float16/bfloat16/float32 [groups, N_pad], zero past N
    offsets: torch.Tensor | None  # like scales; None: symmetric
    counters: torch.Tensor  # int32 [COUNTERS], zero between launches

    @property
    def num_groups(self) -> int:
        return int(self.scales.shape[0])


def _tiling(group_size: int, in_features: int) -> tuple[int, int]:
    """(TILE_K, scale mode) for a group size: the largest dot that never straddles a group."""
    if group_size == in_features:
        return 64, PER_CHANNEL
    power_of_two = group_size & -group_size
    if power_of_two >= 32:
        return min(64, power_of_two // 2), PER_BLOCK  # both halves of a block in one group
    if power_of_two == 16:
        return 16, PER_HALF
    return 16, PER_ELEMENT  # tl.dot needs K >= 16


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _narrowest_exact(t: torch.Tensor) -> torch.Tensor:
    """t in float16 or bfloat16 if every value comes back unchanged, else t (float32)."""
    for dtype in (torch.float16, torch.bfloat16):
        narrow = t.to(dtype)
        if torch.equal(narrow.to(torch.float32), t):
            return narrow
    return t


def _transpose_padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """t [N, R] -> [rows, cols] holding t.T, zero elsewhere."""
    out = t.new_zeros(rows, cols)
    out[: t.shape[1], : t.shape[0]] = t.T
    return out


def pack_for_triton(weight: QuantizedWeight, device: torch.device | str) -> TritonQuantWeight:
    """The kernel's layout of `weight` (the module docstring), built on the host once at load."""
    n, k = weight.out_features, weight.in_features
    tile_k, mode = _tiling(weight.group_size, k)
    k_pad, n_pad = _round_up(k, K_ALIGN), _round_up(n, N_ALIGN)
    q = _transpose_padded(weight.q.cpu(), k_pad, n_pad)
    if weight.bits == 4:
        blocks = q.view(k_pad // (2 * tile_k), 2, tile_k, n_pad)  # [block, half, j, n]
        q = (blocks[:, 0] | (blocks[:, 1] << 4)).reshape(k_pad // 2, n_pad)
    groups = weight.scales.shape[1]
    scales = _narrowest_exact(_transpose_padded(weight.scales.cpu(), groups, n_pad))
    offsets = None
    if weight.offsets is not None:
        offsets = _narrowest_exact(_transpose_padded(weight.offsets.cpu(), groups, n_pad)).to(device)
    return TritonQuantWeight(
        weight.bits, n, k, weight.group_size, tile_k, mode, q.contiguous().to(device), scales.to(device), offsets,
        torch.zeros(COUNTERS, dtype=torch.int32, device=device),
    )


@triton.jit
def _group_vector(ptr, group, num_groups, n_pad, offs_n):
    """Row `group` of a [groups, N_pad] scale or offset table as float32 [BLOCK_N]; the K padding
    past the last group reads the last group (its q and x are 0 there)."""
    row = tl.minimum(group, num_groups - 1).to(tl.int64) * n_pad
    return tl.load(ptr + row + offs_n).to(tl.float32)


@triton.jit
def _scaled_half(acc, x, q, k, group_size, num_groups, n_pad, offs_n, scales_ptr, offsets_ptr,
                 HAS_OFFSETS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + (x @ q) * scale + sum(x) * offset for one TILE_K half inside group k // group_size."""
    group = k // group_size
    part = tl.dot(x, q.to(x.dtype), input_precision=DOT_PRECISION)
    acc += part * _group_vector(scales_ptr, group, num_groups, n_pad, offs_n)[None, :]
    if HAS_OFFSETS:
        xsum = tl.sum(x.to(tl.float32), axis=1)
        acc += xsum[:, None] * _group_vector(offsets_ptr, group, num_groups, n_pad, offs_n)[None, :]
    return acc


@triton.jit
def _weights_dot(acc, x, q, k, group_size, num_groups, n_pad, offs_n, scales_ptr, offsets_ptr, y_ptr,
                 HAS_OFFSETS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + x @ w, w = q * scale + offset of group k // group_size in float32, rounded to the
    activation dtype (y's): the prefill path, where the dots accumulate in place."""
    group = k // group_size
    w = q.to(tl.float32) * _group_vector(scales_ptr, group, num_groups, n_pad, offs_n)[None, :]
    if HAS_OFFSETS:
        w += _group_vector(offsets_ptr, group, num_groups, n_pad, offs_n)[None, :]
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
def _store_tile(y_ptr, acc, bias_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _finish_tile(acc, y_ptr, bias_ptr, partial_ptr, counter_ptr, tile, num_tiles, split, offs_m, offs_n, M, N,
                 stride_ym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 SPLIT_K: tl.constexpr):
    """Stores output tile `tile` of this split's float32 `acc`. Split-K: partial tiles
    [split, tile, BLOCK_M, BLOCK_N] in the workspace; the last split to arrive sums them in split
    order (the same sum whoever arrives last), stores y and resets the tile's counter."""
    if SPLIT_K == 1:
        _store_tile(y_ptr, acc, bias_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS)
    else:
        local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_size = BLOCK_M * BLOCK_N
        tl.store(partial_ptr + (split * num_tiles + tile).to(tl.int64) * tile_size + local, acc)
        tl.debug_barrier()  # every thread's partial is written before the (releasing) arrival
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                part_ptr = partial_ptr + (s * num_tiles + tile).to(tl.int64) * tile_size + local
                total += tl.load(part_ptr, cache_modifier=".cg")  # from L2: other SMs wrote it
            _store_tile(y_ptr, total, bias_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + tile, 0)


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
                acc += part * _group_vector(scales_ptr, k // group_size, num_groups, n_pad, offs_n)[None, :]
                if HAS_OFFSETS:
                    block_sum = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
                    offset = _group_vector(offsets_ptr, k // group_size, num_groups, n_pad, offs_n)
                    acc += block_sum[:, None] * offset[None, :]
            else:  # PER_HALF
                acc = _scaled_half(acc, x_lo, q_lo, k, group_size, num_groups, n_pad, offs_n, scales_ptr,
                                   offsets_ptr, HAS_OFFSETS, DOT_PRECISION)
                acc = _scaled_half(acc, x_hi, q_hi, k + TILE_K, group_size, num_groups, n_pad, offs_n, scales_ptr,
                                   offsets_ptr, HAS_OFFSETS, DOT_PRECISION)
    if SCALES == 0:
        acc = acc * _group_vector(scales_ptr, 0, num_groups, n_pad, offs_n)[None, :]
        if HAS_OFFSETS:
            acc += xsum[:, None] * _group_vector(offsets_ptr, 0, num_groups, n_pad, offs_n)[None, :]

    _finish_tile(acc, y_ptr, bias_ptr, partial_ptr, counter_ptr, tile, tiles_m * tiles_n, split, offs_m, offs_n,
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
    num_iters = _round_up(k, K_ALIGN) // ITER_K
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
    """The launch `quant_linear` makes for m rows of `dtype` on `device`."""
    return _plan(m, packed.out_features, packed.in_features, dtype, packed.scale_mode, packed.tile_k,
                 _sm_count(device), config)


def quant_linear(x: torch.Tensor, packed: TritonQuantWeight, bias: torch.Tensor | None = None,
                 config: LaunchConfig | GemvConfig | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(W)^T + bias -> [..., N] in x's dtype, float32 accumulation. Exact
    products (the dequantized weight in float32) except on prefill tiles of 16-bit x, where each
    weight is rounded to x's dtype once (`Plan.weights_in_x`), as a 16-bit model's weights are.
    A few rows run the multiply-add kernel (`quant_gemv_triton.preferred`: 1 to 4 by the weight's
    scales); a `LaunchConfig` pins the dot kernel, a `GemvConfig` the multiply-add one."""
    from quiver_server.kernels import quant_gemv_triton  # it imports this module's pieces

    k, n = packed.in_features, packed.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"activations must be float32, bfloat16 or float16, not {x.dtype}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape ({n},)")
    rows = x.reshape(-1, k)  # a view where the strides allow: the kernel takes any strides
    m = rows.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    bias_arg = None if bias is None else bias.contiguous()
    if isinstance(config, quant_gemv_triton.GemvConfig) or (
            config is None and quant_gemv_triton.preferred(packed, m)):
        quant_gemv_triton.quant_gemv(rows, packed, bias_arg, y, config or quant_gemv_triton.GemvConfig())
        return y.reshape(*x.shape[:-1], n)
    config = config or LaunchConfig()
    n_pad = int(packed.q.shape[1])
    num_iters = _round_up(k, K_ALIGN) // ITER_K
    plan = launch_plan(m, packed, x.dtype, x.device, config)
    grid = plan.grid(m, n)
    partial = y  # unused unless split: any tensor keeps the signature
    if plan.split_k > 1:
        partial = torch.empty(plan.split_k * grid[0] * plan.block_m * plan.block_n, dtype=torch.float32,
                              device=x.device)
    # The interpreter multiplies bfloat16 dot operands as raw bits: float32 operands there.
    upcast = x.device.type != "cuda" and x.dtype == torch.bfloat16
    precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"  # 16-bit dots ignore it
    _quant_matmul_kernel[grid](
        y, rows, packed.q, packed.scales, packed.offsets, bias_arg, partial, packed.counters,
        m, n, k, n_pad, packed.group_size, packed.num_groups, plan.iters_per_split, num_iters,
        rows.stride(0), rows.stride(1), y.stride(0),
        BITS=packed.bits, TILE_K=packed.tile_k, SCALES=packed.scale_mode, HAS_OFFSETS=packed.offsets is not None,
        HAS_BIAS=bias is not None, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, GROUP_M=8,
        SPLIT_K=plan.split_k, UNROLL=ITER_K // (2 * packed.tile_k),
        WEIGHTS_IN_X=plan.weights_in_x, UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    return y.reshape(*x.shape[:-1], n)
