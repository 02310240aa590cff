"""The packed weight both Triton quantized kernels read (`quant_matmul_triton`: tensor-core dots;
`quant_gemv_triton`: multiply-adds for 1 to 4 rows), and the tile code they share. Semantics of
either: y = x @ dequant(W)^T + bias for a `quant.QuantizedWeight` (w[n, k] = q[n, k] * scale[n, g]
+ offset[n, g], g = k // group_size), x in the model dtype (float32, bfloat16, float16), float32
accumulation, y in x's dtype; `quant_gemm.triton_linear` picks the kernel for the row count.

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

TILE_K follows the group size (`_tiling`), and with it how scales reach the products (the scale
mode): a whole-row group (per-channel int8) scales once at the end; groups that are a multiple of
32 give blocks of 2 * TILE_K inside one group (one scale per block); groups of 16 scale each half;
any other group size (none of the formats has one) dequantizes every element in float32.

Both kernels launch a grid of (output tiles, K splits). When the output tiles cannot fill the SMs,
K is split (split-K, `finish_tile`): each split writes its float32 partial tile to a workspace,
bumps the tile's arrival counter, and the last to arrive sums the partials in split order
(deterministic whatever the arrival order), adds the bias, stores y and resets the counter to 0
for the next launch: one launch, no memset, no spin-wait. Grids and block sizes come from shapes,
never from device values: launches can be captured in CUDA graphs. The counters belong to the
packed weight, so launches of one weight must not overlap (one stream, as the model runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quiver_server.quant.weights import QuantizedWeight

K_ALIGN = 128  # K padding: a multiple of every block (2 * TILE_K <= 128) and of each iteration
N_ALIGN = 128  # N padding: the widest BLOCK_N
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


def padded_k(in_features: int) -> int:
    """K_pad: the K extent of the packed weight (a multiple of K_ALIGN)."""
    return _round_up(in_features, K_ALIGN)


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
    """The kernels' layout of `weight` (the module docstring), built on the host once at load."""
    n, k = weight.out_features, weight.in_features
    tile_k, mode = _tiling(weight.group_size, k)
    k_pad, n_pad = padded_k(k), _round_up(n, N_ALIGN)
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
def group_vector(ptr, group, num_groups, n_pad, offs_n):
    """Row `group` of a [groups, N_pad] scale or offset table as float32 [BLOCK_N]; the K padding
    past the last group reads the last group (its q and x are 0 there)."""
    row = tl.minimum(group, num_groups - 1).to(tl.int64) * n_pad
    return tl.load(ptr + row + offs_n).to(tl.float32)


@triton.jit
def _store_tile(y_ptr, acc, bias_ptr, offs_m, offs_n, M, N, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def finish_tile(acc, y_ptr, bias_ptr, partial_ptr, counter_ptr, tile, num_tiles, split, offs_m, offs_n, M, N,
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
