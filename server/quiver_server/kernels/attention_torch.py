"""Decode attention over the paged KV cache in plain torch: the path on CUDA and without the
C++ kernels, and the reference `cpu_ops.paged_decode_attention` is tested against. The semantics
are written in `layers/attention.py`'s docstring. `sdpa` is the attention every torch path calls:
SDPA itself, or with logit soft-capping (Gemma 2), the same steps written out."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # forward_batch imports kernels (lora_meta): a runtime import would be a cycle
    from quiver_server.engine.forward_batch import ForwardBatch

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
    softcap: float | None = None,
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
        out = _attend_gathered(qg, k_cache, v_cache, batch.block_tables, mask, scale, softcap)
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
            softcap,
        )
    return out.view(num_seqs, heads, head_dim)


def _attend_gathered(
    qg: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """qg [n, kv_heads, g, d] over the K/V of `block_tables` [n, nb] -> [n, kv_heads, g, d]."""
    num_seqs, kv_heads, _, head_dim = qg.shape
    flat_blocks = block_tables.reshape(-1)
    # A narrower cache (`--kv-cache-dtype`) widens to q's dtype, exactly, after the gather.
    k = k_cache.index_select(0, flat_blocks).view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2).to(qg.dtype)
    v = v_cache.index_select(0, flat_blocks).view(num_seqs, -1, kv_heads, head_dim).transpose(1, 2).to(qg.dtype)
    return sdpa(qg, k, v, mask, scale, softcap)


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """SDPA over q [..., heads, L, d], k/v [..., kv_heads, S, d] (query head j reads KV head
    j // (heads // kv_heads)); `mask` True where a query may attend. With `softcap` the scores
    are capped as softcap * tanh(scores / softcap) before masking, which SDPA cannot do: then
    the steps are written out, softmax in float32 as transformers' eager attention does."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal,
                                              enable_gqa=q.shape[-3] != k.shape[-3])
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        length, span = q.shape[-2], k.shape[-2]
        mask = torch.ones(length, span, dtype=torch.bool, device=q.device).tril(span - length)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)
