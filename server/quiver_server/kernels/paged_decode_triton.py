"""Paged decode attention in Triton: K/V read in place through the block tables, no gather copy.

Semantics (those of `layers/attention.py` and `attention_torch.decode_attention`), one new token
per sequence, its K/V already in the cache, g = heads // kv_heads:

    for s in sequences, j in query heads:
        keys = positions [first, n) with n = seq_lens[s], first = max(0, n - window) (0 without)
        score[i] = scale * q[s, j] . K[s, i, j // g]                 (float32 whatever the dtype)
        score[i] = softcap * tanh(score[i] / softcap)                (only with a soft cap)
        out[s, j] = softmax_i(score) @ V[s, i, j // g]               (stored in q's dtype)
    where K[s, i, h] = k_cache[block_tables[s, i // block_size], i % block_size, h].
    A sequence with n = 0 (a padding row of a CUDA-graph batch) reads nothing and gets zeros.

Kernel 1 (`_attend_split_kernel`), grid (B, kv_heads, splits). A program takes one sequence,
one KV head and all g query heads reading it, as the rows of a [BLOCK_G, BLOCK_D] tile, so each
key and value is read once per KV head, not once per query head. It walks its range of key
positions BLOCK_N at a time: the block id of each position comes from the block table (a
position's block is looked up per key, so tiles need not align with cache blocks and any block
size works), the scores are one tl.dot of the query tile with the transposed key tile, and an
online softmax keeps a running max m, normaliser l and unnormalised output acc per row. Only the
positions [first, n) are ever loaded: blocks outside the sliding window and table entries past
the sequence's end are not touched.

Split-K: a sequence's positions [first, n) are cut into `splits` equal ranges (whole tiles), one
per program of grid axis 2, so a batch with few sequences still fills the GPU at long contexts.
With splits > 1 each program writes its (m, l, acc) in float32 to a workspace and kernel 2
(`_combine_splits_kernel`, grid (B, heads)) merges them:
    M = max_k m_k,  out = sum_k exp(m_k - M) acc_k / sum_k exp(m_k - M) l_k.
With one split, kernel 1 normalises and stores the output itself (one launch). Ranges are cut
per sequence on the device, so short sequences in a long batch just get small ranges (empty
ones write m = -inf, l = 0 and drop out of the merge).

Precision: scores accumulate in float32 (16-bit operands multiply exactly into float32 on
tensor cores; float32 uses "ieee" dots, never tf32), and the probabilities stay float32 for the
product with V (V converted to float32, an "ieee" dot): rounding p to 16 bits for a tensor-core
dot would cost 2^-8 relative per weight, far from float32 arithmetic. Under Triton's CPU
interpreter 16-bit dot operands are converted to float32 first (`UPCAST`): its bfloat16 dot
multiplies raw bits (3.9.0), and the products are exact in float32 either way.

No host synchronisation: lengths and tables stay on the device; the grid and the split count
are host ints from shapes and the `max_seq_len` bound (default: block_tables' width times the
block size), so a launch can be captured in a CUDA graph with static input buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quiver_server.kernels import cuda_device
from quiver_server.kernels.triton_math import tanh
from quiver_server.engine.kv_cache_dtype import cache_fits

# A window so wide that max(0, n - window) is always 0: "no sliding window" without a branch.
NO_WINDOW = 2**31 - 1
# Splitting gives each program at least this many keys: below it the merge costs more than the
# extra parallelism gains.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 32


@triton.jit
def _attend_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, max_ws_ptr, sumax_ws_ptr, acc_ws_ptr,
    scale, softcap, window, group, heads, head_dim, num_splits,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ts, stride_tb,
    stride_os, stride_oh, stride_od,
    PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, SOFTCAP: tl.constexpr, QK_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(lens_ptr + seq).to(tl.int64)
    first = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    rows = tl.arange(0, BLOCK_G)
    row_mask = rows < group
    q_heads = kv_head * group + rows
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(
        q_ptr + seq * stride_qs + q_heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    table = tables_ptr + seq * stride_ts
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    row_max = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        key_mask = pos < hi
        block = tl.load(table + (pos // PAGE) * stride_tb, mask=key_mask, other=0).to(tl.int64)
        slot = pos % PAGE
        kt = tl.load(
            k_head + (block * stride_kb + slot * stride_kt)[None, :] + offs_d[:, None] * stride_kd,
            mask=d_mask[:, None] & key_mask[None, :], other=0.0,
        )
        if UPCAST:
            kt = kt.to(tl.float32)
        else:
            kt = kt.to(q.dtype)  # a narrower cache (`--kv-cache-dtype`) widens exactly to q's dtype
        scores = tl.dot(q, kt, input_precision=QK_PRECISION) * scale
        if SOFTCAP:
            scores = softcap * tanh(scores / softcap)
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        alpha = tl.exp(row_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_head + (block * stride_vb + slot * stride_vt)[:, None] + offs_d[None, :] * stride_vd,
            mask=key_mask[:, None] & d_mask[None, :], other=0.0,
        )
        acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
        row_max = new_max

    store_mask = row_mask[:, None] & d_mask[None, :]
    if SPLIT:
        item = (seq * heads + q_heads) * num_splits + split
        tl.store(max_ws_ptr + item, row_max, mask=row_mask)
        tl.store(sumax_ws_ptr + item, row_sum, mask=row_mask)
        tl.store(acc_ws_ptr + item[:, None] * head_dim + offs_d[None, :], acc, mask=store_mask)
    else:
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]  # 0 only for an empty sequence: zeros
        tl.store(
            out_ptr + seq * stride_os + q_heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty), mask=store_mask,
        )


@triton.jit
def _combine_splits_kernel(
    out_ptr, max_ws_ptr, sumax_ws_ptr, acc_ws_ptr,
    heads, head_dim, num_splits,
    stride_os, stride_oh, stride_od,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    items = (seq * heads + head) * num_splits + offs_s
    maxima = tl.load(max_ws_ptr + items, mask=s_mask, other=float("-inf"))
    sums = tl.load(sumax_ws_ptr + items, mask=s_mask, other=0.0)
    acc = tl.load(acc_ws_ptr + items[:, None] * head_dim + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    top = tl.max(maxima, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: zeros, not NaN
    weights = tl.exp(maxima - top)
    total = tl.sum(weights * sums, axis=0)
    out = tl.sum(acc * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(num_seqs: int, kv_heads: int, max_seq_len: int, sm_count: int) -> int:
    """Splits along the KV length: enough programs for about two per SM when B * kv_heads alone
    cannot provide them, each with at least MIN_KEYS_PER_SPLIT keys, at most MAX_SPLITS."""
    programs = max(1, num_seqs * kv_heads)
    wanted = triton.cdiv(2 * sm_count, programs)
    return max(1, min(wanted, triton.cdiv(max(max_seq_len, 1), MIN_KEYS_PER_SPLIT), MAX_SPLITS))


def workspace_numel(num_seqs: int, heads: int, head_dim: int, num_splits: int) -> int:
    """float32 elements of the split-K workspace: (m, l, acc[head_dim]) per (seq, head, split);
    0 when there is one split (no workspace is used)."""
    return 0 if num_splits <= 1 else num_seqs * heads * num_splits * (head_dim + 2)


@dataclass(frozen=True)
class DecodePlan:
    """The host-side shape of one launch: pure function of shapes and host ints."""

    num_splits: int
    block_g: int
    block_d: int
    block_n: int
    num_warps: int


def plan_decode(
    num_seqs: int, heads: int, kv_heads: int, head_dim: int, max_seq_len: int, sm_count: int,
    num_splits: int | None = None, block_n: int | None = None,
) -> DecodePlan:
    group = heads // kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dimension >= 16
    block_g = max(16, triton.next_power_of_2(group))
    # Keep a key tile, and the matching value tile, near 8K elements.
    block_n = block_n or max(16, min(64, 8192 // block_d))
    splits = num_splits if num_splits is not None else choose_num_splits(num_seqs, kv_heads, max_seq_len, sm_count)
    return DecodePlan(max(1, splits), block_g, block_d, block_n, num_warps=4)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of q [B, heads, d] over the paged cache (see the module docstring).

    k_cache, v_cache [num_blocks, block_size, kv_heads, d] in q's dtype (float32, bfloat16 or
    float16) or a narrower one (`kv_cache_dtype.NARROW_DTYPES`: bfloat16, float8), widened as
    read; block_tables [B, >= blocks needed] and seq_lens [B] (lengths with the new token)
    int32 or int64 on q's device; any strides. Returns a new contiguous [B, heads, d] tensor.
    max_seq_len: host bound on seq_lens that only steers the split count (default: table width
    times block size; results never depend on it); num_splits forces the split count, block_n
    the keys per tile; workspace: a float32 tensor of at least
    `workspace_numel(...)` elements to use instead of allocating one (CUDA graphs)."""
    num_seqs, heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or cache_dim != head_dim:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if heads % kv_heads != 0:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not cache_fits(q.dtype, k_cache, v_cache):
        raise ValueError(f"q must be float32/bfloat16/float16 and the caches in its dtype, bfloat16 or float8, got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"do not match {num_seqs} sequences")
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    plan = plan_decode(num_seqs, heads, kv_heads, head_dim, max_seq_len, cuda_device.sm_count(q.device), num_splits,
                       block_n)
    out = torch.empty((num_seqs, heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    split = plan.num_splits > 1
    max_ws = sum_ws = acc_ws = out  # unused without splits
    if split:
        needed = workspace_numel(num_seqs, heads, head_dim, plan.num_splits)
        if workspace is None:
            workspace = torch.empty(needed, dtype=torch.float32, device=q.device)
        elif workspace.dtype != torch.float32 or workspace.numel() < needed or not workspace.is_contiguous():
            raise ValueError(f"workspace must be a contiguous float32 tensor of >= {needed} elements")
        items = num_seqs * heads * plan.num_splits
        max_ws, sum_ws, acc_ws = workspace[:items], workspace[items : 2 * items], workspace[2 * items : needed]
    upcast = q.device.type != "cuda" and q.dtype != torch.float32
    _attend_split_kernel[(num_seqs, kv_heads, plan.num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, max_ws, sum_ws, acc_ws,
        scale, 1.0 if softcap is None else softcap, NO_WINDOW if sliding_window is None else sliding_window,
        heads // kv_heads, heads, head_dim, plan.num_splits,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        PAGE=block_size, BLOCK_G=plan.block_g, BLOCK_D=plan.block_d, BLOCK_N=plan.block_n,
        SPLIT=split, SOFTCAP=softcap is not None,
        QK_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
        num_warps=plan.num_warps,
    )
    if split:
        _combine_splits_kernel[(num_seqs, heads)](
            out, max_ws, sum_ws, acc_ws, heads, head_dim, plan.num_splits, *out.stride(),
            BLOCK_S=triton.next_power_of_2(plan.num_splits), BLOCK_D=plan.block_d, num_warps=4,
        )
    return out
