"""Attention over the paged KV cache: prefill in plain torch (SDPA, CPU and CUDA), decode through
the shard's `KernelOps.decode_attention` (the C++ kernel on CPU, `kernels.attention_torch`
elsewhere).

Cache layout per layer: K and V of shape [num_blocks, block_size, num_kv_heads, head_dim].
Query head j reads KV head j // (num_heads // num_kv_heads), as transformers' `repeat_kv` does.

Reference semantics (what any faster kernel must reproduce), for sequence s with n cached tokens
and query at position p (keys at positions 0..p, all of them written to the cache first; in a
prefill, a sequence's new tokens start at its cached context length, 0 without a prefix):
    out[p, j] = softmax_{i in window(p)}(q[p, j] . k[i, j // g] * scale) @ v[i, j // g]
where window(p) = {i <= p} and, with a sliding window w, additionally {i > p - w}. With logit
soft-capping c (Gemma 2), the scores q . k * scale become c * tanh(scores / c) before the softmax.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quiver_server.engine.forward_batch import ForwardBatch
from quiver_server.kernels.attention_torch import sdpa
from quiver_server.engine.kv_cache_dtype import FLOAT8_DTYPES, as_stored, to_cache


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Stores k, v [T, kv_heads, head_dim] at the flat slots `slot_mapping` [T], rounded to the
    cache's dtype (`kv_cache_dtype.to_cache`)."""
    _, _, kv_heads, head_dim = k_cache.shape
    for cache, x in ((k_cache, k), (v_cache, v)):
        stored = to_cache(x, cache.dtype)
        if cache.dtype in FLOAT8_DTYPES:  # torch has no float8 index_copy_ on CPU: copy the bytes
            cache, stored = cache.view(torch.uint8), stored.view(torch.uint8)
        cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, stored)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    softcap: float | None = None,
    held: Callable[[torch.Tensor, torch.dtype], torch.Tensor] = as_stored,
    widen: Callable[[torch.Tensor, torch.dtype], torch.Tensor] = torch.Tensor.to,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its prefix and themselves. q
    [T, heads, d], k/v [T, kv_heads, d] are the flattened new tokens (no padding). A sequence
    without a cached context attends to exactly k/v; one with a context (`batch.context_of`)
    reads its keys back from k_cache/v_cache, where `write_kv` has just stored the new ones
    beside the prefix (so a prefix that another sequence of this pass writes is there too).
    Every key and value is read as the cache holds it: with a narrower cache (`--kv-cache-dtype`)
    the new tokens' k/v are rounded as stored, so chunking and prefix caching change nothing.
    held(x, cache dtype): x as the cache holds it; widen(cache values, q's dtype): exactly (the
    C++ ops pass faster forms of both for float8)."""
    if k_cache is not None and v_cache is not None:
        k, v = held(k, k_cache.dtype), held(v, v_cache.dtype)
    out = torch.empty_like(q)
    start = 0
    lengths = batch.seq_lens_host
    sequence = 0
    while sequence < len(lengths):
        length = lengths[sequence]
        context = batch.context_of(sequence)
        # Consecutive fresh sequences of one length go through SDPA together, as one
        # [n, heads, L, d] batch: one call instead of n (a bench of equal prompts is one call).
        run = 1
        if context == 0:
            while (sequence + run < len(lengths) and lengths[sequence + run] == length
                   and batch.context_of(sequence + run) == 0):
                run += 1
        end = start + run * length
        qs = q[start:end].unflatten(0, (run, length)).transpose(1, 2)
        if context > 0:
            assert k_cache is not None and v_cache is not None and batch.block_tables is not None
            o = _attend_with_context(qs, k_cache, v_cache, batch.block_tables[sequence], context, scale,
                                     sliding_window, softcap, widen)
        else:
            ks = k[start:end].unflatten(0, (run, length)).transpose(1, 2)
            vs = v[start:end].unflatten(0, (run, length)).transpose(1, 2)
            if sliding_window is not None and length > sliding_window:
                pos = torch.arange(length, device=q.device)
                mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - sliding_window)
                o = sdpa(qs, ks, vs, mask, scale, softcap)
            else:
                o = sdpa(qs, ks, vs, None, scale, softcap, is_causal=True)
        out[start:end] = o.transpose(1, 2).flatten(0, 1)
        start = end
        sequence += run
    return out


def _attend_with_context(
    qs: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    widen: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
) -> torch.Tensor:
    """qs [1, heads, L, d]: the queries at positions context .. context + L - 1 over the keys a
    query there may see, gathered block-wise from the cache in one index_select each for K and V
    (with a window, only from the first position the earliest query sees)."""
    length, block_size = qs.shape[2], k_cache.shape[1]
    end = context + length
    begin = max(0, context - sliding_window + 1) if sliding_window is not None else 0
    first_block = begin // block_size
    blocks = block_table[first_block : -(-end // block_size)]
    skip = begin - first_block * block_size
    ks = widen(k_cache.index_select(0, blocks).flatten(0, 1)[skip : skip + end - begin], qs.dtype)
    vs = widen(v_cache.index_select(0, blocks).flatten(0, 1)[skip : skip + end - begin], qs.dtype)
    # SDPA's is_causal aligns the diagonal top-left when L < S; the queries sit at the end.
    q_pos = torch.arange(context, end, device=qs.device)[:, None]
    k_pos = torch.arange(begin, end, device=qs.device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return sdpa(qs, ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], mask, scale, softcap)
