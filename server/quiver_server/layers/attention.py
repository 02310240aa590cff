"""Attention over the paged KV cache: prefill in plain torch (SDPA, CPU and CUDA), decode through
the shard's `KernelOps.decode_attention` (the C++ kernel on CPU, `kernels.attention_torch`
elsewhere).

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
