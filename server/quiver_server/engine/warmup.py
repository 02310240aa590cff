"""Warm-up: a dry run of the costliest steps, the KV cache sized from what memory it left, and
the decode graphs captured over that cache.

On the CPU the cache takes `cpu_kv_cache_gib`; on a GPU it takes what the dry run's peak, the
decode gathers and the graphs' pool leave of `gpu_memory_fraction` of the device.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from typing import Protocol

import torch

from quiver_server.adapters.manager import AdapterManager
from quiver_server.engine import logprobs, sampling
from quiver_server.engine.batch_types import SamplingParams
from quiver_server.engine.decode_graphs import DecodeGraphs, bucket_sizes
from quiver_server.engine.forward_batch import build_decode, build_lora_meta, build_prefill
from quiver_server.engine.kv_cache import BLOCK_SIZE, KVCacheSpec, PagedKVCache
from quiver_server.engine.sampling import SamplingBatch
from quiver_server.kernels.ops import KernelOps
from quiver_server.models.family import ModelFamily

log = logging.getLogger(__name__)


class LoadedModel(Protocol):
    """What warm-up reads of the engine: the model as loaded and the choices made for it once."""

    model: ModelFamily
    ops: KernelOps
    lora: AdapterManager
    kv_spec: KVCacheSpec
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_position_embeddings: int
    generation_refusal: str
    use_cuda_graphs: bool
    cpu_kv_cache_gib: float
    gpu_memory_fraction: float


@dataclass(frozen=True)
class WarmupLimits:
    """The router's limits the cache and the dry run are sized for."""

    max_batch_prefill_tokens: int
    max_total_tokens: int
    max_batch_size: int
    max_batch_total_tokens: int = 0  # 0: no cap on the cache's tokens

    def check(self) -> None:
        if min(self.max_batch_prefill_tokens, self.max_total_tokens, self.max_batch_size) < 1:
            raise ValueError("warmup limits must be positive")


def allocate_cache(loaded: LoadedModel, limits: WarmupLimits) -> tuple[PagedKVCache, DecodeGraphs | None, int]:
    """Dry-runs the model, then allocates the paged KV cache and captures the decode graphs (with
    CUDA graphs on); returns them and the number of blocks the router may allocate."""
    kv_spec = loaded.kv_spec
    if loaded.device.type == "cuda":
        num_blocks = _cuda_blocks(loaded, limits)
    else:
        dry_run(loaded, min(limits.max_batch_prefill_tokens, 64), limits.max_total_tokens,
                min(limits.max_batch_size, 8))
        num_blocks = int(loaded.cpu_kv_cache_gib * 2**30) // kv_spec.bytes_per_block()
    if limits.max_batch_total_tokens > 0:
        num_blocks = min(num_blocks, kv_spec.blocks_for_tokens(limits.max_batch_total_tokens))
    if num_blocks < kv_spec.blocks_for_tokens(limits.max_total_tokens):
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {BLOCK_SIZE} tokens, fewer than one request "
            f"of max_total_tokens={limits.max_total_tokens} needs"
        )
    # With CUDA graphs one block more than the router is told of: the padded rows' scratch.
    scratch = 1 if loaded.use_cuda_graphs else 0
    kv_cache = PagedKVCache(kv_spec, num_blocks + scratch, loaded.device)
    log.info("KV cache: %d blocks of %d tokens in %s (%.2f GiB)", num_blocks, BLOCK_SIZE,
             str(kv_spec.dtype).removeprefix("torch."), num_blocks * kv_spec.bytes_per_block() / 2**30)
    if not loaded.use_cuda_graphs:
        return kv_cache, None, num_blocks
    try:
        graphs = _capture_decode_graphs(loaded, kv_cache, num_blocks, limits)
    except BaseException as exc:
        # A failed warmup holds no device memory: neither the cache nor the graphs'
        # buffers, which the traceback's frames would keep alive for whoever reports it.
        del kv_cache
        traceback.clear_frames(exc.__traceback__)
        raise
    return kv_cache, graphs, num_blocks


def _capture_decode_graphs(
    loaded: LoadedModel, kv_cache: PagedKVCache, scratch_block: int, limits: WarmupLimits
) -> DecodeGraphs:
    graphs = DecodeGraphs(
        loaded.model, kv_cache, scratch_block, limits.max_batch_size,
        loaded.kv_spec.blocks_for_tokens(limits.max_total_tokens), BLOCK_SIZE, loaded.lora.ranks, loaded.device,
    )
    seconds, nbytes = graphs.capture(loaded.lora.exercising_every_slot_buffer)
    log.info("CUDA graphs: decode batches %s captured in %.1f s, %.2f GiB",
             ",".join(map(str, graphs.sizes)), seconds, nbytes / 2**30)
    return graphs


def dry_run(loaded: LoadedModel, num_tokens: int, max_total_tokens: int, max_batch_size: int) -> None:
    """The worst of each kind of step, on a scratch cache: proves the forward works, warms the
    kernels, and on a GPU sets the memory peak the KV budget leaves room for.
    - A prefill of `num_tokens` prompt tokens with prompt logprobs on every row (the logits
      of every row);
    - as many new tokens again, each sequence now over the first pass's tokens as its cached
      context (a prefix-cache hit or a prompt's next chunk, whose attention reads the cache);
    - a decode step of `max_batch_size` rows through the costliest sampler (temperature,
      top-k/p, min-p, every penalty, 20 top logprobs).
    A model without an LM head only embeds: the first prefill's hidden states are its step."""
    model, device, lora, vocab_size = loaded.model, loaded.device, loaded.lora, loaded.vocab_size
    # Context and new tokens of a sequence fit max_total_tokens (and the positions).
    seq_len = max(1, min(max_total_tokens // 2, (loaded.max_position_embeddings - 1) // 2, num_tokens))
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    blocks_per_seq = loaded.kv_spec.blocks_for_tokens(2 * seq_len + 1)
    prefill_blocks = blocks_per_seq * len(lens)
    scratch = PagedKVCache(loaded.kv_spec, prefill_blocks + max_batch_size, device)
    table = torch.arange(prefill_blocks, dtype=torch.long).view(len(lens), blocks_per_seq)
    host_ids = torch.arange(num_tokens) % vocab_size
    input_ids = host_ids.to(device)
    # With adapter slots, every token goes through the LoRA kernels too (on the first slot of
    # each rank class, whatever it holds: the logits are thrown away), so their memory and
    # compilation are covered.
    # With more classes than rows, further passes run the classes the first one left out.
    ranks = lora.ranks
    prefill_slots = lora.warmup_slots(len(lens)) if ranks is not None else [None]
    lora_ranks = ranks if ranks is not None else 0
    slots = prefill_slots[0]
    fresh = build_prefill(lens, table, BLOCK_SIZE, device, slots, lora_ranks, [True] * len(lens))
    spans = logprobs.prompt_spans(host_ids.split(lens), [logprobs.MAX_LOGPROBS] * len(lens), lens)
    cached = build_prefill(lens, table, BLOCK_SIZE, device, slots, lora_ranks, context_lens=lens)
    more_prefills = [build_prefill(lens, table, BLOCK_SIZE, device, more, lora_ranks)
                     for more in prefill_slots[1:]]
    rows = max_batch_size
    decode_table = torch.arange(prefill_blocks, prefill_blocks + rows, dtype=torch.long, device=device)
    decodes = [
        build_decode([0] * rows, decode_table[:, None], BLOCK_SIZE, device,
                     build_lora_meta(decode_slots, [1] * rows, lora_ranks, device) if decode_slots else None)
        for decode_slots in (lora.warmup_slots(rows) if ranks is not None else [None])
    ]
    costliest = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1,
                               presence_penalty=0.5, frequency_penalty=0.5, top_logprobs=logprobs.MAX_LOGPROBS)
    with lora.exercising_every_slot_buffer():
        if loaded.generation_refusal:
            model.hidden_states(input_ids, fresh, scratch)
            return
        logprobs.prompt_logprobs(model(input_ids, fresh, scratch), list(spans.values()))
        model(input_ids, cached, scratch)
        for more in more_prefills:
            model(input_ids, more, scratch)
        for decode in decodes[1:]:
            model(torch.zeros(rows, dtype=torch.long, device=device), decode, scratch)
        logits = model(torch.zeros(rows, dtype=torch.long, device=device), decodes[0], scratch)
        sampling.sample(
            logits, SamplingBatch.from_params([costliest] * rows, device),
            torch.zeros(rows, dtype=torch.long, device=device),
            torch.zeros(rows, vocab_size, dtype=torch.bool, device=device), loaded.ops,
            torch.zeros(rows, vocab_size, dtype=torch.float32, device=device),
        )
    del scratch


def _cuda_blocks(loaded: LoadedModel, limits: WarmupLimits) -> int:
    """The blocks of `gpu_memory_fraction` of the device left once the dry run's peak, the torch
    decode gathers and the decode graphs' pool are set aside."""
    device, kv_spec = loaded.device, loaded.kv_spec
    max_batch_prefill_tokens, max_total_tokens, max_batch_size = (
        limits.max_batch_prefill_tokens, limits.max_total_tokens, limits.max_batch_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    dry_run(loaded, max_batch_prefill_tokens, max_total_tokens, max_batch_size)
    torch.cuda.synchronize(device)
    forward_peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # The torch decode path gathers one layer's K and V for the whole batch (padded to the
    # longest request), and attention may copy them once more; the Triton kernel reads in place.
    element = torch.empty((), dtype=loaded.dtype).element_size()
    kv_row = kv_spec.num_kv_heads * kv_spec.head_dim * element
    gather = 4 * max_batch_size * max_total_tokens * kv_row if loaded.ops.decode_gathers else 0
    # The decode graphs' pool holds one decode step's activations at the largest bucket, which
    # the dry run's peak bounds pro rata to its tokens, and the graphs' shared logits buffer.
    graphs = 0
    if loaded.use_cuda_graphs:
        rows = bucket_sizes(max_batch_size)[-1]
        graphs = int(forward_peak * min(1.0, rows / max_batch_prefill_tokens)) + rows * loaded.vocab_size * element
    budget = free - (1.0 - loaded.gpu_memory_fraction) * total - forward_peak - gather - graphs
    log.info("warmup: forward peak %.2f GiB, decode gather %.2f GiB, decode graphs %.2f GiB, free %.2f of %.2f GiB",
             forward_peak / 2**30, gather / 2**30, graphs / 2**30, free / 2**30, total / 2**30)
    return max(int(budget // kv_spec.bytes_per_block()), 0)
