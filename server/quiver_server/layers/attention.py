"""Attention over the paged KV cache, in plain torch (runs on CPU and CUDA).

Cache layout per layer: K and V of shape [num_blocks, block_size, num_kv_heads, head_dim].
Query head j reads KV head j // (num_heads // num_kv_heads), as transformers' `repeat_kv` does.

Reference semantics (what any faster kernel must reproduce), for sequence s with n cached tokens
and query at position p (keys at positions 0..p, all of them written to the cache first):
    out[p, j] = softmax_{i in window(p)}(q[p, j] . k[i, j // g] * scale) @ v[i, j // g]
where window(p) = {i <= p} and, with a sliding window w, additionally {i > p - w}.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quiver_server.forward_batch import ForwardBatch
from quiver_server.kernels import cpu_ops


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Stores k, v [T, kv_heads, head_dim] at the flat slots `slot_mapping` [T]."""
    _, _, kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Causal attention of each prompt over itself. q [T, heads, d], k/v [T, kv_heads, d] are the
    flattened prompts (no padding); the prompts are new, so their K/V are exactly k/v."""
    out = torch.empty_like(q)
    start = 0
    for length in batch.seq_lens_host:
        end = start + length
        # [1, heads, L, d] views of this sequence; SDPA broadcasts KV heads over query groups.
        qs = q[start:end].transpose(0, 1)[None]
        ks = k[start:end].transpose(0, 1)[None]
        vs = v[start:end].transpose(0, 1)[None]
        if sliding_window is not None and length > sliding_window:
            pos = torch.arange(length, device=q.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - sliding_window)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
        start = end
    return out


# On CPU, decode attention gathers the K/V of a few sequences at a time so the gathered copy
# stays in cache instead of making a round trip through memory (decode is memory-bound there).
CPU_GATHER_BYTES = 4 << 20


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One new token per sequence: q [B, heads, d] attends to its sequence's cached K/V (the
    new token's own K/V already written). On CPU the C++ kernel reads the cache in place;
    elsewhere, or without it, `decode_attention_torch`."""
    assert batch.block_tables is not None and batch.seq_lens is not None
    if q.device.type == "cpu" and cpu_ops.available():
        return cpu_ops.paged_decode_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                                              scale, sliding_window)
    return decode_attention_torch(q, k_cache, v_cache, batch, scale, sliding_window)


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One new token per sequence: q [B, heads, d] attends to its sequence's cached K/V
    (the new token's own K/V already written). Keys are gathered block-wise, per group of
    sequences padded to the group's longest one; the padding is masked out."""
    assert batch.block_tables is not None
    num_seqs, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    # The g query heads sharing a KV head become g query rows against that head: no KV repeat.
    qg = q.view(num_seqs, kv_heads, heads // kv_heads, head_dim)
    mask = batch.decode_mask(sliding_window)
    group = num_seqs
    if q.device.type == "cpu":
        per_sequence = 2 * batch.kv_span * kv_heads * head_dim * k_cache.element_size()
        group = max(1, CPU_GATHER_BYTES // per_sequence)
    if group >= num_seqs:
        out = _attend_gathered(qg, k_cache, v_cache, batch.block_tables, mask, scale)
        return out.reshape(num_seqs, heads, head_dim)
    out = torch.empty_like(qg)
    for start in range(0, num_seqs, group):
        end = min(start + group, num_seqs)
        blocks = -(-max(batch.seq_lens_host[start:end]) // block_size)
        out[start:end] = _attend_gathered(
            qg[start:end],
            k_cache,
            v_cache,
            batch.block_tables[start:end, :blocks],
            mask[start:end, :, :, : blocks * block_size],
            scale,
        )
    return out.view(num_seqs, heads, head_dim)


def _attend_gathered(
    qg: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """qg [n, kv_heads, g, d] over the K/V of `block_tables` [n, nb] -> [n, kv_heads, g, d]."""
    num_seqs, kv_heads, _, head_dim = qg.shape
    flat_blocks = block_tables.reshape(-1)
    k = k_cache.index_select(0, flat_blocks).view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, flat_blocks).view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2)
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
