"""Variable-length prefill attention over the paged KV cache in Triton: one launch for a whole
flattened batch of fresh, prefix-cached and chunked prompts alike.

Semantics (`layers/attention.py`'s reference formula): sequence s has n_s new tokens at rows
r0_s .. r0_s + n_s - 1 of q, at positions c_s .. c_s + n_s - 1 (c_s: tokens cached before this
pass), and every key it sees, prefix and new tokens alike, is already in the cache (the caller ran
`write_kv` first). With g = heads // kv_heads:

    for every row r = r0_s + i of sequence s, query head j, p = c_s + i:
        keys(p)  = {t : t <= p and (no window or t > p - window)}
        score(t) = scale * q[r, j] . K[s, t, j // g]        K[s, t] = k_cache[table[s, t // bs], t % bs]
        score(t) = softcap * tanh(score(t) / softcap)       (with a soft cap)
        out[r, j] = sum_t softmax_t(score)(t) * V[s, t, j // g]      over t in keys(p)

Design (FlashAttention-2 with the cache read in place, as vLLM's unified Triton attention does):
- A program owns one query tile of one sequence and one KV head: BLOCK_Q consecutive new tokens
  times the g query heads of that KV head (padded to a power of two), BLOCK_M = BLOCK_Q * g_pad
  rows. K/V of the head are read once for all its query heads.
- Grid (tiles, kv_heads). The tiles come from `PrefillTiles`, built on the host from the batch's
  host lists (`seq_lens_host`, `context_lens_host`): one int32 row (sequence, first q row, first
  position, rows) per tile, ordered heaviest first (most keys), so the grid's tail is short
  tiles. So a program finds its sequence with one load (no search over cu_seqlens) and the
  launch needs no device array beyond the block tables, no device sync and no `max` read back.
  Build it once per forward and hand it to every layer (one small host-to-device copy per pass).
- Keys are visited BLOCK_N positions at a time; each key's cache block comes from the block
  table (`t // bs`), so the KV step is independent of the cache block size. Only the span a tile
  can see is visited: [max(0, p_first - window + 1), p_last] — blocks wholly before a window are
  never read, nor anything past the tile's last position (so never a block outside the table).
  The span is cut into a masked head (keys some row's window excludes), an unmasked middle (keys
  every row sees: <= p_first and > p_last - window) and a masked tail (the causal diagonal).
- Online softmax in float32 with exp2; P is rounded to q's dtype for the P @ V dot (tensor cores
  for 16-bit models), accumulation in float32, output in q's dtype. A cache narrower than q
  (`--kv-cache-dtype`: bfloat16 under float32, float8) is widened to q's dtype as it is read,
  which is exact. Rows whose keys in a step are
  all masked keep their state: the running max starts at a large finite negative, not -inf.
- head_dim that is not a power of two is padded to one with masked (zero) lanes.

Under Triton's CPU interpreter (tests without a GPU) bfloat16 dot operands are upcast to float32
first (`UPCAST`): the interpreter multiplies bfloat16 dot operands as raw bits (3.9.0, see
`lora_triton.sgmv`). The P rounding to bfloat16 is kept, so the results are the ones a GPU gives
up to summation order.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quiver_server.engine.kv_cache_dtype import cache_fits


@triton.jit
def _soft_cap(scores, softcap):
    """softcap * tanh(scores / softcap), from exp2 of a non-positive argument (no overflow)."""
    x = scores / softcap
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return softcap * tl.where(x < 0, -t, t)


@triton.jit
def _attend_keys(
    acc, m_i, l_i, q, q_pos,
    k_ptr, v_ptr, table_row, kv_head_off_k, kv_head_off_v,
    start, end, key_limit, scale, softcap, window,
    stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, MODEL_DTYPE: tl.constexpr,
):
    """Online-softmax update of one tile's rows with keys start, start + BLOCK_N, ... < end.
    MASKED: per-row causal/window masks and keys >= key_limit neither read nor counted;
    unmasked steps must lie wholly inside every row's window. MODEL_DTYPE: q's dtype, which a
    narrower cache's K and V widen to exactly and P is rounded to for the P @ V dot."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for key0 in range(start, end, BLOCK_N):
        keys = key0 + offs_n
        if MASKED:
            key_ok = keys < key_limit
            block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        else:
            block = tl.load(table_row + keys // BLOCK_SIZE).to(tl.int64)
        within = (keys % BLOCK_SIZE).to(tl.int64)
        k_rows = k_ptr + kv_head_off_k + block * stride_kb + within * stride_ks
        v_rows = v_ptr + kv_head_off_v + block * stride_vb + within * stride_vs
        k_ptrs = k_rows[None, :] + offs_d[:, None] * stride_kd  # [BLOCK_D, BLOCK_N]: K^T
        v_ptrs = v_rows[:, None] + offs_d[None, :] * stride_vd  # [BLOCK_N, BLOCK_D]
        if MASKED:
            kt = tl.load(k_ptrs, mask=d_ok[:, None] & key_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        elif HEAD_DIM != BLOCK_D:
            kt = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            kt = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if UPCAST:
            kt = kt.to(tl.float32)
        else:
            kt = kt.to(MODEL_DTYPE)
        scores = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale
        if USE_SOFTCAP:
            scores = _soft_cap(scores, softcap)
        scores = scores * 1.4426950408889634
        if MASKED:
            visible = (keys[None, :] <= q_pos[:, None]) & key_ok[None, :]
            if USE_WINDOW:
                visible = visible & (keys[None, :] > q_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p_v = p.to(MODEL_DTYPE)
        if UPCAST:
            p_v = p_v.to(tl.float32)
            v = v.to(tl.float32)
        else:
            v = v.to(MODEL_DTYPE)
        acc = tl.dot(p_v, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_prefill_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, block_tables_ptr, tiles_ptr,
    scale, softcap, window,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tiles_ptr + tile * 4)
    row0 = tl.load(tiles_ptr + tile * 4 + 1)
    pos0 = tl.load(tiles_ptr + tile * 4 + 2)
    rows = tl.load(tiles_ptr + tile * 4 + 3)

    # Row m of the tile: query token m // GROUP_PAD, query head kv_head * GROUP + m % GROUP_PAD.
    offs_m = tl.arange(0, BLOCK_M)
    token = offs_m // GROUP_PAD
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_ok = (token < rows) & (offs_m % GROUP_PAD < GROUP)
    q_pos = pos0 + token
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_offsets = (row0 + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offsets + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # The keys this tile sees: [lo, hi). Every row sees [full_lo, full_hi); steps wholly inside
    # it need no mask. Masked head [lo, mid_start), unmasked [mid_start, mid_end), masked tail.
    pos_last = pos0 + rows - 1
    hi = pos_last + 1
    if USE_WINDOW:
        lo = tl.maximum(pos0 - window + 1, 0)
        full_lo = tl.maximum(pos_last - window + 1, lo)
    else:
        lo = 0
        full_lo = 0
    full_hi = pos0 + 1
    mid_start = tl.minimum(lo + (full_lo - lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N, hi)
    mid_end = mid_start + tl.maximum(full_hi - mid_start, 0) // BLOCK_N * BLOCK_N

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_off_k = kv_head.to(tl.int64) * stride_kh
    kv_off_v = kv_head.to(tl.int64) * stride_vh
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, table_row, kv_off_k, kv_off_v,
        lo, mid_start, hi, scale, softcap, window,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
        HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_SIZE, True, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION, UPCAST,
        q_ptr.dtype.element_ty,
    )
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, table_row, kv_off_k, kv_off_v,
        mid_start, mid_end, hi, scale, softcap, window,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
        HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_SIZE, False, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION, UPCAST,
        q_ptr.dtype.element_ty,
    )
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, table_row, kv_off_k, kv_off_v,
        mid_end, hi, hi, scale, softcap, window,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
        HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_SIZE, True, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION, UPCAST,
        q_ptr.dtype.element_ty,
    )

    # Every real row sees at least its own position, so l > 0 there; padding rows are not stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offsets = (row0 + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(out_ptr + o_offsets + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes of one launch; None = the heuristic's choice (tests force small tiles)."""

    block_m: int | None = None  # rows per program: query tokens x padded query heads of a KV head
    block_n: int | None = None  # keys per inner step
    num_warps: int | None = None
    num_stages: int | None = None


@dataclass(frozen=True)
class PrefillPlan:
    """Compile-time shape of one launch: a pure function of the attention shape and the batch's
    longest new-token count, so it can be compiled ahead (see `bench/kernels/lora_compile_report.py`)."""

    block_m: int
    block_n: int
    block_d: int
    group: int
    group_pad: int
    num_warps: int
    num_stages: int

    @property
    def block_q(self) -> int:
        """New tokens per tile."""
        return self.block_m // self.group_pad


@functools.lru_cache(maxsize=256)
def plan_prefill(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, max_new_tokens: int, on_gpu: bool,
    config: LaunchConfig = LaunchConfig(),
) -> PrefillPlan:
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    if on_gpu:
        # 16-bit: wgmma tiles of 128 x 64 (sm_90a: ~210 registers, no spills at d = 128); heads
        # wider than 128 halve them. float32 ("ieee") dots run on FMA units with the tiles in
        # registers: the smallest tiles, and still ~1.4 KB of spills at d = 128 (a debugging
        # dtype on CUDA, where the server serves 16-bit).
        if dtype == torch.float32:
            block_m, block_n = 32, 32
        else:
            block_m, block_n = (128, 64) if block_d <= 128 else (64, 32)
    else:
        block_m, block_n = 64, 32  # the interpreter: fewer, larger numpy steps than tiny tiles
    # No tile taller than the longest sequence needs (short prompts would be mostly padding),
    # and tl.dot wants every dimension >= 16.
    block_m = config.block_m or max(16, min(block_m, triton.next_power_of_2(max(max_new_tokens, 1) * group_pad)))
    block_m = max(block_m, group_pad)
    block_n = config.block_n or block_n
    num_warps = config.num_warps or (8 if block_m >= 128 else 4)
    num_stages = config.num_stages or 2
    return PrefillPlan(block_m, block_n, block_d, group, group_pad, num_warps, num_stages)


@dataclass(frozen=True)
class PrefillTiles:
    """The query tiles of one prefill batch for one attention shape: build once per forward
    pass (host lists only) and pass to every layer's `paged_prefill_attention`."""

    plan: PrefillPlan
    table: torch.Tensor  # [num_tiles, 4] int32 on the device: sequence, first q row, first position, rows
    num_rows: int  # T, the new tokens of the whole batch

    @staticmethod
    def build(
        seq_lens_host: Sequence[int], context_lens_host: Sequence[int], heads: int, kv_heads: int,
        head_dim: int, dtype: torch.dtype, device: torch.device, config: LaunchConfig = LaunchConfig(),
    ) -> PrefillTiles:
        """seq_lens_host: new tokens per sequence (>= 0 each); context_lens_host: tokens cached
        before them per sequence, or empty when all are 0 (ForwardBatch's convention)."""
        if context_lens_host and len(context_lens_host) != len(seq_lens_host):
            raise ValueError(f"{len(context_lens_host)} context lengths for {len(seq_lens_host)} sequences")
        plan = plan_prefill(heads, kv_heads, head_dim, dtype, max(seq_lens_host, default=0),
                            device.type == "cuda", config)
        block_q = plan.block_q
        tiles: list[tuple[int, int, int, int]] = []
        row = 0
        for seq, length in enumerate(seq_lens_host):
            context = context_lens_host[seq] if context_lens_host else 0
            for first in range(0, length, block_q):
                tiles.append((seq, row + first, context + first, min(block_q, length - first)))
            row += length
        # Heaviest first: a tile's work is the keys up to its last position.
        tiles.sort(key=lambda t: -(t[2] + t[3]))
        table = torch.tensor(tiles, dtype=torch.int32).view(-1, 4)
        if device.type == "cuda":
            table = table.pin_memory()
        return PrefillTiles(plan, table.to(device, non_blocking=True), row)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens_host: Sequence[int],
    context_lens_host: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    tiles: PrefillTiles | None = None,
    config: LaunchConfig = LaunchConfig(),
) -> torch.Tensor:
    """Causal attention of every sequence's new tokens over its cached keys, in one launch.

    q [T, heads, d]: the new tokens of all sequences concatenated (any strides; a view of a fused
    qkv output is fine). k_cache / v_cache [num_blocks, block_size, kv_heads, d]: the new tokens'
    K/V already written (`write_kv`). block_tables [B, nb] (int32 or int64): sequence s's keys at
    positions 0 .. context + len - 1 live in its first blocks; nothing past them is read.
    seq_lens_host / context_lens_host: host ints as in ForwardBatch (context empty = all 0).
    sliding_window: keys t > p - window only; softcap: scores capped before the softmax.
    tiles: the batch's `PrefillTiles` (built here when None; build once per pass instead).
    Returns a new contiguous [T, heads, d] tensor in q's dtype. No device sync."""
    num_rows, heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if tiles is None:
        tiles = PrefillTiles.build(seq_lens_host, context_lens_host, heads, kv_heads, head_dim, q.dtype,
                                   q.device, config)
    _check(q, k_cache, v_cache, block_tables, seq_lens_host, tiles)
    out = torch.empty((num_rows, heads, head_dim), dtype=q.dtype, device=q.device)
    num_tiles = tiles.table.shape[0]
    if num_tiles == 0:
        return out
    plan = tiles.plan
    upcast = q.device.type != "cuda" and q.dtype == torch.bfloat16
    _paged_prefill_kernel[(num_tiles, kv_heads)](
        out, q, k_cache, v_cache, block_tables, tiles.table,
        scale, softcap if softcap is not None else 1.0, sliding_window if sliding_window is not None else 0,
        q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0),
        HEAD_DIM=head_dim, GROUP=plan.group, GROUP_PAD=plan.group_pad,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d, BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    return out


def _check(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens_host: Sequence[int], tiles: PrefillTiles,
) -> None:
    """Shape and dtype checks on host metadata only (no device sync)."""
    num_rows, heads, head_dim = q.shape
    problems = []
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        problems.append(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ or are not 4-D")
    elif k_cache.shape[3] != head_dim or heads != tiles.plan.group * k_cache.shape[2]:
        problems.append(f"q {tuple(q.shape)} does not fit the cache's {tuple(k_cache.shape)} (or the tiles' plan)")
    if not cache_fits(q.dtype, k_cache, v_cache):
        problems.append(f"k_cache and v_cache must be in q's dtype, bfloat16 or float8: {q.dtype}, {k_cache.dtype}, "
                        f"{v_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] < len(seq_lens_host):
        problems.append(f"block_tables {tuple(block_tables.shape)} for {len(seq_lens_host)} sequences")
    if block_tables.dtype not in (torch.int32, torch.int64):
        problems.append(f"block_tables must be int32 or int64, not {block_tables.dtype}")
    if sum(seq_lens_host) != num_rows or tiles.num_rows != num_rows:
        problems.append(f"q has {num_rows} rows, seq_lens_host sum to {sum(seq_lens_host)}, tiles to {tiles.num_rows}")
    if problems:
        raise ValueError("paged_prefill_attention: " + "; ".join(problems))
