"""The shard's compute core: the model, the paged KV cache and the running batches.

The router owns scheduling and block accounting; the engine runs what it is told. A request's
life: `prefill` runs its prompt, writes the prompt's K/V into the blocks the router gave it and
samples the first token; each `decode` feeds the last sampled token of every request of the
merged batches, writes its K/V and samples the next; `filter_batch` drops finished requests.
A prefill may skip a prompt prefix whose K/V its blocks already hold (`cached_tokens`: the
router's prefix cache, or earlier chunks), and may stop short of the prompt's end
(`prefill_until`): such a chunk only writes K/V, and a later prefill finishes the prompt.

LoRA adapters (`adapters/`, held by `self.lora`): `load_adapter` reads one into host memory
(thread-safe, so the service runs it beside the steps), `activate_adapter` copies it into a
device slot between steps, and a request names its adapter by id and keeps that slot for life.

Grammars (`grammar/`, held by `self.grammars`): `compile_grammar` builds (or finds cached) one
for a request's tokenizer and pins it under the router's id until `release_grammars` (thread-
safe, so the service runs it off this thread); a request naming a pinned grammar gets its own
matcher at prefill, and nothing is compiled there; each step fills the matchers' mask while its forward
pass runs and masks the logits with it; the matchers then consume the sampled tokens in the
background, before the next step's fill.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import llguidance
import torch

from quiver_server import logprobs, sampling
from quiver_server.adapters.manager import AdapterManager
from quiver_server.decode_graphs import DecodeGraphs, bucket_sizes
from quiver_server.device_choice import resolve_device, resolve_dtype
from quiver_server.batch_state import CachedBatch, RequestState, padded_block_table
from quiver_server.batch_types import (
    AdapterInfo,
    GrammarSpec,
    ModelInfo,
    PromptPosition,
    RequestSpec,
    SamplingParams,
    StepResult,
    TokenOut,
)
from quiver_server.forward_batch import (
    build_decode,
    build_lora_meta,
    build_prefill,
    logits_rows_per_sequence,
)
from quiver_server.grammar import Grammars
from quiver_server.grammar.compiler import DEFAULT_BUDGET_S, DEFAULT_CACHE_SIZE
from quiver_server.kernels.ops import select_ops
from quiver_server.layers.grouped_linear import host_sync_free
from quiver_server.sampling import SamplingBatch
from quiver_server.kv_cache import BLOCK_SIZE, KVCacheSpec, PagedKVCache
from quiver_server.kv_cache_dtype import resolve as resolve_kv_cache_dtype
from quiver_server.models import family_for, load_model
from quiver_server.models.checkpoint_layout import no_lm_head_refusal
from quiver_server.penalties import generated_counts, uses_counts
from quiver_server.pooling import pool, read_pooling
from quiver_server.parallel import SINGLE, TensorParallel
from quiver_server.quant.quantize import DEFAULT_INT4_GROUP, QuantizeSpec
from quiver_server.weight_bytes import held_weight_bytes
from quiver_server.weights import eos_token_ids, load_config

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class _StepAhead:
    batch: CachedBatch
    lengths: list[int]
    logits: torch.Tensor


class Engine:
    def __init__(
        self,
        model_path: str,
        model_id: str,
        dtype: str = "auto",
        device: str = "auto",
        cpu_kv_cache_gib: float = 1.0,
        gpu_memory_fraction: float = 0.9,
        max_cpu_adapters: int = 64,
        adapter_root: str | None = None,
        s3_adapter_buckets: Sequence[str] = (),
        adapter_disk_cache_gib: float = 0.0,
        grammar_budget_s: float = DEFAULT_BUDGET_S,
        grammar_cache_size: int = DEFAULT_CACHE_SIZE,
        cuda_graphs: bool = True,
        overlap_steps: bool | None = None,
        quantize: str | None = None,
        quantize_group_size: int = DEFAULT_INT4_GROUP,
        quantize_lm_head: bool = False,
        kv_cache_dtype: str = "auto",
        tp: TensorParallel = SINGLE,
    ) -> None:
        """cuda_graphs: decode steps replay CUDA graphs (`decode_graphs`) where the device and
        ops allow it (CUDA, a decode attention that reads the cache in place); False: eager.
        overlap_steps: a decode step launches the next one's forward pass before it reads its
        sampled tokens back for the router (None: on CUDA, where the device then works while the
        host waits; on the CPU the two would only take turns).
        quantize: "int8" or "int4" quantizes the projections at load (`quant.quantize`), int4 in
        groups of `quantize_group_size` inputs; `quantize_lm_head` quantizes the LM head too.
        kv_cache_dtype: the KV cache's storage (`kv_cache_dtype.CHOICES`; "auto": the model's dtype).
        s3_adapter_buckets: the buckets `s3://bucket/prefix` adapters may come from (none: S3 is off).
        adapter_disk_cache_gib: the S3 adapter download cache's budget (0: no limit; `disk_budget`).
        tp: this shard's place among ranks that split the model (`parallel.join_group`): it holds
        and computes its share (`models.tensor_split`), and every call must reach every rank."""
        path = Path(model_path)
        config = load_config(path)
        family_for(config)  # an unsupported model_type fails before any weight is read
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, config, self.device)
        self.cpu_kv_cache_gib = cpu_kv_cache_gib
        self.gpu_memory_fraction = gpu_memory_fraction
        # The one choice of kernels and LoRA backend: the model's layers, the sampler and the
        # adapter slots all run what it picked.
        self.ops = select_ops(self.device)
        if quantize_lm_head and not quantize:
            raise ValueError("--quantize-lm-head needs --quantize")
        spec = QuantizeSpec(quantize, quantize_group_size, quantize_lm_head) if quantize else None
        self.model = load_model(path, config, self.dtype, self.device, self.ops, spec, tp)
        shape = self.model.config
        self.vocab_size = shape.vocab_size
        self.max_position_embeddings = shape.max_position_embeddings
        self.kv_spec = KVCacheSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                   resolve_kv_cache_dtype(kv_cache_dtype, self.dtype, self.device), BLOCK_SIZE)
        self.pooling = read_pooling(path)
        # A model without an LM head serves embeddings only (`models.checkpoint_layout`).
        self.generation_refusal = "" if shape.has_lm_head else no_lm_head_refusal(str(config["model_type"]))
        self.info = ModelInfo(
            model_id=model_id,
            model_type=str(config["model_type"]),
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            vocab_size=shape.vocab_size,
            max_position_embeddings=shape.max_position_embeddings,
            eos_token_ids=eos_token_ids(path, config),
            model_path=str(path),
            weight_bytes=held_weight_bytes(module for _, module in self.model.named_modules()),
            embedding_dim=shape.hidden_size,
            pooling=self.pooling.describe(),
            pooling_refusal=self.pooling.refusal,
            generation_refusal=self.generation_refusal,
        )
        self.kv_cache: PagedKVCache | None = None
        self.use_cuda_graphs = (cuda_graphs and self.device.type == "cuda" and not self.ops.decode_gathers
                                and not self.generation_refusal)  # no decode step to capture
        modules = (module for _, module in self.model.named_modules())
        if self.use_cuda_graphs and not host_sync_free(modules, self.device, self.dtype):
            log.info("CUDA graphs off: the %s experts have no grouped kernel on this device in %s (a per-expert "
                     "loop reads the group sizes on the host)", config["model_type"], self.dtype)
            self.use_cuda_graphs = False
        self.graphs: DecodeGraphs | None = None
        self.overlap_steps = self.device.type == "cuda" if overlap_steps is None else overlap_steps
        self._ahead: _StepAhead | None = None  # the next decode step's forward, launched early
        self.batches: dict[int, CachedBatch] = {}
        self.lora = AdapterManager(
            self.model, config, self.dtype, self.ops, max_cpu_adapters, adapter_root, s3_adapter_buckets,
            adapter_disk_cache_gib,
        )
        self.grammars = Grammars(
            path, self.vocab_size, self.lora.registry.location, grammar_budget_s, grammar_cache_size
        )

    # ---- warmup -------------------------------------------------------------------------------

    @torch.inference_mode()
    def warmup(
        self,
        max_batch_prefill_tokens: int,
        max_total_tokens: int,
        max_batch_size: int,
        max_batch_total_tokens: int = 0,
        max_active_adapters: int = 0,
        max_lora_rank: int = 0,
        slot_ranks: Sequence[int] = (),
    ) -> tuple[int, int]:
        """Allocates the adapter slots (max_active_adapters of rank up to max_lora_rank, or each
        of its rank in slot_ranks: rank classes; 0 slots disables adapters) and the paged KV
        cache; returns (block_size, num_blocks)."""
        if min(max_batch_prefill_tokens, max_total_tokens, max_batch_size) < 1:
            raise ValueError("warmup limits must be positive")
        if max_active_adapters > 0 and max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be positive with max_active_adapters={max_active_adapters}")
        self.batches.clear()
        self.kv_cache = self.graphs = self._ahead = None
        self.lora.allocate_slots(max_active_adapters, max_lora_rank, slot_ranks)
        if self.device.type == "cuda":
            num_blocks = self._cuda_blocks(max_batch_prefill_tokens, max_total_tokens, max_batch_size)
        else:
            self._dry_run(min(max_batch_prefill_tokens, 64), max_total_tokens, min(max_batch_size, 8))
            num_blocks = int(self.cpu_kv_cache_gib * 2**30) // self.kv_spec.bytes_per_block()
        if max_batch_total_tokens > 0:
            num_blocks = min(num_blocks, self.kv_spec.blocks_for_tokens(max_batch_total_tokens))
        if num_blocks < self.kv_spec.blocks_for_tokens(max_total_tokens):
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {BLOCK_SIZE} tokens, fewer than one request "
                f"of max_total_tokens={max_total_tokens} needs"
            )
        # With CUDA graphs one block more than the router is told of: the padded rows' scratch.
        scratch = 1 if self.use_cuda_graphs else 0
        self.kv_cache = PagedKVCache(self.kv_spec, num_blocks + scratch, self.device)
        log.info("KV cache: %d blocks of %d tokens in %s (%.2f GiB)", num_blocks, BLOCK_SIZE,
                 str(self.kv_spec.dtype).removeprefix("torch."), num_blocks * self.kv_spec.bytes_per_block() / 2**30)
        if self.use_cuda_graphs:
            try:
                self._capture_decode_graphs(num_blocks, max_batch_size, max_total_tokens)
            except BaseException as exc:
                # A failed warmup holds no device memory: neither the cache nor the graphs'
                # buffers, which the traceback's frames would keep alive for whoever reports it.
                self.kv_cache = self.graphs = None
                traceback.clear_frames(exc.__traceback__)
                raise
        return BLOCK_SIZE, num_blocks

    def _capture_decode_graphs(self, scratch_block: int, max_batch_size: int, max_total_tokens: int) -> None:
        assert self.kv_cache is not None
        self.graphs = DecodeGraphs(
            self.model, self.kv_cache, scratch_block, max_batch_size, self.kv_spec.blocks_for_tokens(max_total_tokens),
            BLOCK_SIZE, self.lora.ranks, self.device,
        )
        seconds, nbytes = self.graphs.capture(self.lora.exercising_every_slot_buffer)
        log.info("CUDA graphs: decode batches %s captured in %.1f s, %.2f GiB",
                 ",".join(map(str, self.graphs.sizes)), seconds, nbytes / 2**30)

    def _dry_run(self, num_tokens: int, max_total_tokens: int, max_batch_size: int) -> None:
        """The worst of each kind of step, on a scratch cache: proves the forward works, warms the
        kernels, and on a GPU sets the memory peak the KV budget leaves room for.
        - A prefill of `num_tokens` prompt tokens with prompt logprobs on every row (the logits
          of every row);
        - as many new tokens again, each sequence now over the first pass's tokens as its cached
          context (a prefix-cache hit or a prompt's next chunk, whose attention reads the cache);
        - a decode step of `max_batch_size` rows through the costliest sampler (temperature,
          top-k/p, min-p, every penalty, 20 top logprobs).
        A model without an LM head only embeds: the first prefill's hidden states are its step."""
        # Context and new tokens of a sequence fit max_total_tokens (and the positions).
        seq_len = max(1, min(max_total_tokens // 2, (self.max_position_embeddings - 1) // 2, num_tokens))
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        blocks_per_seq = self.kv_spec.blocks_for_tokens(2 * seq_len + 1)
        prefill_blocks = blocks_per_seq * len(lens)
        scratch = PagedKVCache(self.kv_spec, prefill_blocks + max_batch_size, self.device)
        table = torch.arange(prefill_blocks, dtype=torch.long).view(len(lens), blocks_per_seq)
        host_ids = torch.arange(num_tokens) % self.vocab_size
        input_ids = host_ids.to(self.device)
        # With adapter slots, every token goes through the LoRA kernels too (on the first slot of
        # each rank class, whatever it holds: the logits are thrown away), so their memory and
        # compilation are covered.
        # With more classes than rows, further passes run the classes the first one left out.
        ranks = self.lora.ranks
        prefill_slots = self.lora.warmup_slots(len(lens)) if ranks is not None else [None]
        lora_ranks = ranks if ranks is not None else 0
        slots = prefill_slots[0]
        fresh = build_prefill(lens, table, BLOCK_SIZE, self.device, slots, lora_ranks, [True] * len(lens))
        spans = logprobs.prompt_spans(host_ids.split(lens), [logprobs.MAX_LOGPROBS] * len(lens), lens)
        cached = build_prefill(lens, table, BLOCK_SIZE, self.device, slots, lora_ranks, context_lens=lens)
        more_prefills = [build_prefill(lens, table, BLOCK_SIZE, self.device, more, lora_ranks)
                         for more in prefill_slots[1:]]
        rows = max_batch_size
        decode_table = torch.arange(prefill_blocks, prefill_blocks + rows, dtype=torch.long, device=self.device)
        decodes = [
            build_decode([0] * rows, decode_table[:, None], BLOCK_SIZE, self.device,
                         build_lora_meta(decode_slots, [1] * rows, lora_ranks, self.device) if decode_slots else None)
            for decode_slots in (self.lora.warmup_slots(rows) if ranks is not None else [None])
        ]
        costliest = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1,
                                   presence_penalty=0.5, frequency_penalty=0.5, top_logprobs=logprobs.MAX_LOGPROBS)
        with self.lora.exercising_every_slot_buffer():
            if self.generation_refusal:
                self.model.hidden_states(input_ids, fresh, scratch)
                return
            logprobs.prompt_logprobs(self.model(input_ids, fresh, scratch), list(spans.values()))
            self.model(input_ids, cached, scratch)
            for more in more_prefills:
                self.model(input_ids, more, scratch)
            for decode in decodes[1:]:
                self.model(torch.zeros(rows, dtype=torch.long, device=self.device), decode, scratch)
            logits = self.model(torch.zeros(rows, dtype=torch.long, device=self.device), decodes[0], scratch)
            sampling.sample(
                logits, SamplingBatch.from_params([costliest] * rows, self.device),
                torch.zeros(rows, dtype=torch.long, device=self.device),
                torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=self.device), self.ops,
                torch.zeros(rows, self.vocab_size, dtype=torch.float32, device=self.device),
            )
        del scratch

    def _cuda_blocks(self, max_batch_prefill_tokens: int, max_total_tokens: int, max_batch_size: int) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._dry_run(max_batch_prefill_tokens, max_total_tokens, max_batch_size)
        torch.cuda.synchronize(self.device)
        forward_peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # The torch decode path gathers one layer's K and V for the whole batch (padded to the
        # longest request), and attention may copy them once more; the Triton kernel reads in place.
        element = torch.empty((), dtype=self.dtype).element_size()
        kv_row = self.kv_spec.num_kv_heads * self.kv_spec.head_dim * element
        gather = 4 * max_batch_size * max_total_tokens * kv_row if self.ops.decode_gathers else 0
        # The decode graphs' pool holds one decode step's activations at the largest bucket, which
        # the dry run's peak bounds pro rata to its tokens, and the graphs' shared logits buffer.
        graphs = 0
        if self.use_cuda_graphs:
            rows = bucket_sizes(max_batch_size)[-1]
            graphs = int(forward_peak * min(1.0, rows / max_batch_prefill_tokens)) + rows * self.vocab_size * element
        budget = free - (1.0 - self.gpu_memory_fraction) * total - forward_peak - gather - graphs
        log.info("warmup: forward peak %.2f GiB, decode gather %.2f GiB, decode graphs %.2f GiB, free %.2f of %.2f GiB",
                 forward_peak / 2**30, gather / 2**30, graphs / 2**30, free / 2**30, total / 2**30)
        return max(int(budget // self.kv_spec.bytes_per_block()), 0)

    # ---- steps --------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, batch_id: int, requests: list[RequestSpec]) -> StepResult:
        kv_cache = self._require_cache()
        if batch_id in self.batches:
            raise ValueError(f"batch id {batch_id} is already in use")
        if not requests:
            raise ValueError("prefill needs at least one request")
        if len({r.id for r in requests}) != len(requests):
            raise ValueError("prefill has duplicate request ids")
        for request in requests:
            self._validate(request, kv_cache.num_blocks)

        start = time.perf_counter_ns()
        embeds = [r for r in requests if r.embed]
        generating = [r for r in requests if not r.embed]
        result = (self._prefill_generating(batch_id, generating, kv_cache, start) if generating
                  else StepResult(generations=[], batch_id=batch_id, request_ids=[]))
        if embeds:
            # Their own forward pass: every token's hidden state is wanted, and no logits.
            embedded = self._embed(embeds, kv_cache)
            result = dataclasses.replace(result, generations=result.generations + embedded,
                                         forward_ns=time.perf_counter_ns() - start)
        return result

    def _prefill_generating(self, batch_id: int, requests: list[RequestSpec], kv_cache: PagedKVCache,
                            start: int) -> StepResult:
        # Chunks of unfinished prompts only write their K/V: no state, no sample, no batch.
        finals = [r for r in requests if r.is_final]
        # Each request's adapter slot, looked up once: its state keeps it for the request's life.
        slots = {r.id: self.lora.slot_for(r.id, r.adapter_id) for r in requests}
        batch = CachedBatch([self._new_state(r, slots[r.id]) for r in finals])
        input_ids = torch.tensor(
            [t for r in requests for t in r.input_ids[r.cached_tokens : r.until]], dtype=torch.long
        ).to(self.device)
        # LoRA applies to the tokens computed now, so its metadata counts the new tokens only.
        lora_slots = [slots[r.id] for r in requests] if any(r.adapter_id for r in requests) else None
        new_lens = [r.until - r.cached_tokens for r in requests]
        sampled = [r.is_final for r in requests]
        # Requests with prompt logprobs get the logits of every prompt token, the others the last
        # (validation keeps prompt logprobs to whole prompts computed in one pass).
        asked = [r.prompt_logprobs for r in requests]
        all_logits = [a is not None for a in asked] if any(a is not None for a in asked) else None
        table = batch.block_table(self.device) if len(finals) == len(requests) else padded_block_table(
            [r.blocks for r in requests], self.device)
        forward = build_prefill(
            new_lens, table, BLOCK_SIZE, self.device, lora_slots, self.lora.ranks or 0, all_logits,
            [r.cached_tokens for r in requests], sampled,
        )
        if not finals:
            self.model(input_ids, forward, kv_cache)
            return StepResult(generations=[], batch_id=batch_id, request_ids=[],
                              forward_ns=time.perf_counter_ns() - start)
        # Chunks have no logits rows, so the final requests' rows are laid out as among themselves.
        rows_per_sequence = logits_rows_per_sequence(new_lens, all_logits, sampled)
        spans = logprobs.prompt_spans(
            [r.input_ids for r in finals], [r.prompt_logprobs for r in finals],
            [n for n, final in zip(rows_per_sequence, sampled, strict=True) if final],
        )
        result = self._step(batch_id, batch, lambda: self.model(input_ids, forward, kv_cache), forward.sample_rows,
                            fed_last_token=False, start=start,
                            prompt_spans=spans)
        self.batches[batch_id] = batch
        return result

    def _embed(self, requests: list[RequestSpec], kv_cache: PagedKVCache) -> list[TokenOut]:
        """The pooled embedding of each `embed` request's prompt (its K/V land in its blocks,
        which the router frees when the call returns)."""
        lens = [len(r.input_ids) for r in requests]
        slots = [self.lora.slot_for(r.id, r.adapter_id) for r in requests]
        input_ids = torch.tensor([t for r in requests for t in r.input_ids], dtype=torch.long).to(self.device)
        table = padded_block_table([r.blocks for r in requests], self.device)
        forward = build_prefill(lens, table, BLOCK_SIZE, self.device, slots if any(s >= 0 for s in slots) else None,
                                self.lora.ranks or 0, sampled=[False] * len(requests))
        vectors = pool(self.model.hidden_states(input_ids, forward, kv_cache), lens, self.pooling)
        return [TokenOut(request_id=r.id, token_id=0, logprob=0.0, embedding=v)
                for r, v in zip(requests, vectors, strict=True)]

    @torch.inference_mode()
    def decode(self, batch_ids: list[int]) -> StepResult:
        self._require_cache()
        if not batch_ids:
            raise ValueError("decode needs at least one batch id")
        if len(set(batch_ids)) != len(batch_ids):
            raise ValueError(f"decode got a batch id twice: {batch_ids}")
        requests = [r for batch_id in batch_ids for r in self._batch(batch_id).requests]
        for request in requests:
            if request.length >= len(request.blocks) * BLOCK_SIZE:
                raise ValueError(f"request {request.id} has filled its {len(request.blocks)} KV blocks")
            if request.length >= self.max_position_embeddings:
                raise ValueError(f"request {request.id} reached max_position_embeddings")
        start = time.perf_counter_ns()
        batch = self.batches[batch_ids[0]]
        if len(batch_ids) > 1:
            batch = CachedBatch.joined([self.batches[batch_id] for batch_id in batch_ids])
            for batch_id in batch_ids[1:]:
                del self.batches[batch_id]
            self.batches[batch_ids[0]] = batch
        if not batch.requests:
            return StepResult(generations=[], batch_id=batch_ids[0], request_ids=[])
        lengths = [r.length for r in batch.requests]
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.batch is batch and ahead.lengths == lengths:
            # Launched by the previous step on exactly these requests, tokens and positions.
            return self._step(batch_ids[0], batch, lambda: ahead.logits, None, fed_last_token=True, start=start)
        input_ids = batch.input_ids(self.device)
        return self._step(batch_ids[0], batch, lambda: self._decode_logits(batch, input_ids, lengths), None,
                          fed_last_token=True, start=start)

    def _decode_logits(self, batch: CachedBatch, input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The forward pass of a decode step of `batch`: input_ids [B] at positions `lengths`,
        from its CUDA graph where one holds the batch, else eagerly."""
        kv_cache = self._require_cache()
        table = batch.block_table(self.device)
        graphs = self.graphs
        if graphs is not None and graphs.bucket(len(lengths)) is not None:
            slots = [r.lora_slot for r in batch.requests]
            return graphs.run(input_ids, lengths, table, slots if any(s >= 0 for s in slots) else None)
        ranks = self.lora.ranks
        lora = batch.lora_meta(ranks, self.device) if ranks is not None else None
        return self.model(input_ids, build_decode(lengths, table, BLOCK_SIZE, self.device, lora), kv_cache)

    def _launch_ahead(self, batch: CachedBatch, tokens: torch.Tensor) -> None:
        """The next decode step of `batch` as it stands, launched before this step's tokens are
        read back: it needs only the tokens on the device and positions one further. Used by the
        next decode if that one runs on the same batch, else dropped; the K/V it wrote are those
        of the tokens at their positions, which any later step writes alike."""
        lengths = [r.length + 1 for r in batch.requests]
        if any(n >= len(r.blocks) * BLOCK_SIZE or n >= self.max_position_embeddings
               for n, r in zip(lengths, batch.requests, strict=True)):
            return  # the next step would be refused: let it be, and say why then
        self._ahead = _StepAhead(batch, lengths, self._decode_logits(batch, tokens.to(torch.long), lengths))

    def _step(
        self,
        batch_id: int,
        batch: CachedBatch,
        run_forward: Callable[[], torch.Tensor],
        sample_rows: torch.Tensor | None,
        fed_last_token: bool,
        start: int,
        prompt_spans: dict[int, logprobs.PromptSpan] | None = None,
    ) -> StepResult:
        """run_forward: the step's forward pass (the model eagerly, or a decode graph) -> logits;
        sample_rows: each sequence's row among them, None when that is every row;
        prompt_spans: batch row -> where its prompt logprobs sit among the logits (prefill)."""
        matchers = batch.matchers
        # The grammar rows' mask is filled on its own thread while the forward pass runs.
        pending = self.grammars.masks.start(matchers, self.device.type == "cuda") if batch.has_grammar else None
        try:
            logits = run_forward()
            params = batch.sampling(self.device)
        finally:  # the matchers are the fill's until it ends, even when the forward pass failed
            grammar = pending.wait(self.device) if pending is not None else None
        sampled = sampling.sample(
            logits if sample_rows is None else logits[sample_rows],
            params,
            batch.draws(self.device),
            batch.seen_matrix(self.vocab_size, self.device),
            self.ops,
            batch.counts_matrix(self.vocab_size, self.device),
            grammar,
        )
        prompt: dict[int, list[PromptPosition]] = {}
        if prompt_spans:
            prompt = dict(zip(prompt_spans, logprobs.prompt_logprobs(logits, list(prompt_spans.values())),
                              strict=True))
        if fed_last_token and self.overlap_steps:
            self._launch_ahead(batch, sampled.tokens)
        token_list, logprob_list = sampled.tokens.tolist(), sampled.logprobs.tolist()
        batch.record(sampled.tokens, token_list, fed_last_token)
        if grammar is not None:
            self.grammars.masks.advance_in_background(matchers, token_list)
        tops = logprobs.top_lists(sampled.top, params.top_logprobs)
        generations = [
            TokenOut(request_id=r.id, token_id=t, logprob=lp, top_logprobs=tops[row],
                     prompt_logprobs=prompt.get(row, []))
            for row, (r, t, lp) in enumerate(zip(batch.requests, token_list, logprob_list, strict=True))
        ]
        return StepResult(
            generations=generations,
            batch_id=batch_id,
            request_ids=batch.request_ids,
            forward_ns=time.perf_counter_ns() - start,
            grammar_ns=grammar.ns if grammar is not None else 0,
        )

    # ---- batch bookkeeping --------------------------------------------------------------------

    def filter_batch(self, batch_id: int, keep_request_ids: list[int]) -> list[int]:
        """Keeps the listed requests (in the batch's order); an emptied batch is dropped."""
        batch = self._batch(batch_id)
        present = set(batch.request_ids)
        unknown = [i for i in keep_request_ids if i not in present]
        if unknown:
            raise ValueError(f"requests {unknown} are not in batch {batch_id}")
        keep = set(keep_request_ids)
        if keep == present:
            return batch.request_ids
        if not keep:
            del self.batches[batch_id]
            return []
        filtered = batch.subset(keep)
        ahead = self._ahead
        if ahead is not None and ahead.batch is batch:
            # Every row of a forward pass is its own: the kept rows' logits are the subset's.
            rows = [row for row, r in enumerate(batch.requests) if r.id in keep]
            index = torch.tensor(rows, dtype=torch.long).to(ahead.logits.device, non_blocking=True)
            self._ahead = _StepAhead(filtered, [ahead.lengths[row] for row in rows],
                                     ahead.logits.index_select(0, index))
        self.batches[batch_id] = filtered
        return filtered.request_ids

    def clear_cache(self, batch_id: int | None = None) -> None:
        """Drops one cached batch (unknown ids are ignored: clearing is idempotent) or all."""
        self._ahead = None
        if batch_id is None:
            self.batches.clear()
        else:
            self.batches.pop(batch_id, None)

    def _batch(self, batch_id: int) -> CachedBatch:
        batch = self.batches.get(batch_id)
        if batch is None:
            raise ValueError(f"unknown batch id {batch_id}")
        return batch

    def _require_cache(self) -> PagedKVCache:
        if self.kv_cache is None:
            raise ValueError("the KV cache is not allocated: call warmup first")
        return self.kv_cache

    def _validate(self, request: RequestSpec, num_blocks: int) -> None:
        rid = request.id
        self.lora.slot_for(rid, request.adapter_id)
        if not request.input_ids:
            raise ValueError(f"request {rid}: empty prompt")
        self._validate_span(request)
        if max(request.input_ids) >= self.vocab_size or min(request.input_ids) < 0:
            bad = next(t for t in request.input_ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"request {rid}: token id {bad} is out of range for vocab size {self.vocab_size}")
        if request.embed:
            self._validate_embed(request)
        elif self.generation_refusal:
            raise ValueError(f"request {rid}: {self.generation_refusal}")
        elif request.max_new_tokens < 1:
            raise ValueError(f"request {rid}: max_new_tokens must be >= 1")
        total = len(request.input_ids) + request.max_new_tokens
        if total > self.max_position_embeddings:
            raise ValueError(
                f"request {rid}: len(prompt) + max_new_tokens = {total} exceeds "
                f"max_position_embeddings = {self.max_position_embeddings}"
            )
        needed = self.kv_spec.blocks_for_tokens(total)
        if len(request.blocks) < needed:
            raise ValueError(
                f"request {rid}: block table too short: len(prompt) + max_new_tokens = {total} tokens need "
                f"{needed} blocks of {BLOCK_SIZE}, got {len(request.blocks)}"
            )
        if min(request.blocks) < 0 or max(request.blocks) >= num_blocks:
            raise ValueError(f"request {rid}: block ids must be in [0, {num_blocks})")
        sampling.validate(request.sampling, self.vocab_size, request.prompt_logprobs)
        if request.grammar_id and not self.grammars.is_pinned(request.grammar_id):
            raise ValueError(f"request {rid}: grammar {request.grammar_id} is not pinned on this shard "
                             "(CompileGrammar pins it, ReleaseGrammars unpins it)")

    def _validate_embed(self, request: RequestSpec) -> None:
        """An embedding is pooled over the whole prompt, computed in this one call."""
        if self.pooling.refusal:
            raise ValueError(f"request {request.id}: this model serves no embeddings: {self.pooling.refusal}")
        if request.cached_tokens or request.prefill_until or request.prompt_logprobs is not None \
                or request.grammar_id or request.max_new_tokens:
            raise ValueError(f"request {request.id}: an embed request computes its whole prompt and nothing else "
                             "(no cached_tokens, prefill_until, prompt_logprobs, grammar or max_new_tokens)")

    @staticmethod
    def _validate_span(request: RequestSpec) -> None:
        """The prompt tokens this prefill computes: cached_tokens <= x < until <= len(prompt)."""
        rid, length = request.id, len(request.input_ids)
        if not 0 <= request.cached_tokens < length:
            raise ValueError(
                f"request {rid}: cached_tokens = {request.cached_tokens} must be less than the prompt's "
                f"{length} tokens"
            )
        if request.prefill_until and not request.cached_tokens < request.prefill_until <= length:
            raise ValueError(
                f"request {rid}: prefill_until = {request.prefill_until} must be above cached_tokens = "
                f"{request.cached_tokens} and at most the prompt's {length} tokens"
            )
        if request.prompt_logprobs is not None and (request.cached_tokens or not request.is_final):
            raise ValueError(
                f"request {rid}: prompt_logprobs need the whole prompt computed in one prefill "
                "(no cached_tokens, no prefill_until)"
            )

    def _new_state(self, request: RequestSpec, lora_slot: int) -> RequestState:
        seen = None
        if request.sampling.repetition_penalty != 1.0:
            seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            seen[torch.tensor(request.input_ids, device=self.device)] = True
        counts = None
        if uses_counts(request.sampling):
            counts = generated_counts(request.input_ids, request.sampling.draws_done, self.vocab_size, self.device)
        return RequestState(
            id=request.id,
            blocks=list(request.blocks),
            length=len(request.input_ids),
            last_token=-1,
            sampling=request.sampling,
            draws_done=request.sampling.draws_done if request.sampling.temperature > 0 else 0,
            seen=seen,
            counts=counts,
            adapter_id=request.adapter_id,
            lora_slot=lora_slot,
            matcher=self._new_matcher(request),
        )

    def _new_matcher(self, request: RequestSpec) -> llguidance.LLMatcher | None:
        """The request's matcher, past the tokens a resumed request generated before (the last
        `draws_done` prompt tokens, as for the penalties), from the grammar pinned for it."""
        if not request.grammar_id:
            return None
        draws_done = min(request.sampling.draws_done, len(request.input_ids))
        generated = request.input_ids[len(request.input_ids) - draws_done :]
        return self.grammars.matcher(request.grammar_id, generated)

    # ---- grammars -----------------------------------------------------------------------------

    def compile_grammar(self, adapter_id: str, grammar: GrammarSpec, grammar_id: int) -> int:
        """Compiles a grammar for the tokenizer of `adapter_id` ("" = the base model), or finds
        it cached, and pins it under `grammar_id` for the requests that name it; returns the ns
        spent (0 when cached). GrammarError (a ValueError) says why it cannot be used, and
        nothing is pinned then. Safe to call while steps run on another thread."""
        return self.grammars.pin(grammar_id, adapter_id, grammar)

    def release_grammars(self, grammar_ids: Sequence[int]) -> None:
        """Unpins grammars no request will name again. Safe to call while steps run."""
        self.grammars.release(grammar_ids)

    # ---- adapters -----------------------------------------------------------------------------

    def load_adapter(self, adapter_id: str, source: str, path: str, revision: str = "") -> AdapterInfo:
        """Reads an adapter into host memory and checks it against the base (ValueError saying
        what differs; AdapterNotFoundError for a missing directory, hub repo or S3 prefix;
        AdapterStoreError when the store fails). Source "local" reads `path`; "hub" downloads
        `adapter_id` (owner/name[@revision]), "s3" `adapter_id` (s3://bucket/prefix), unless
        `path` gives the directory another rank downloaded. Safe to call while steps run on another thread."""
        return self.lora.load(adapter_id, source, path, revision)

    @torch.inference_mode()
    def activate_adapter(self, adapter_id: str, slot: int) -> bool:
        """Copies a loaded adapter into device slot `slot`, replacing what it held; refused for a
        slot that running requests use. True when the weights were in the host-memory cache.
        Safe to call while steps run on another thread (the service does), for a slot no step
        reads: the router admits the adapter's requests only once it returns."""
        return self.lora.activate(adapter_id, slot, self._running_adapters_by_slot())

    def prefetch_adapter(self, adapter_id: str) -> bool:
        """Reads a loaded adapter back into host memory if the cache evicted it (the router asks
        while it waits for a slot); True when it was there. Safe to call while steps run."""
        return self.lora.prefetch(adapter_id)

    @torch.inference_mode()
    def unload_adapter(self, adapter_id: str) -> None:
        """Forgets an adapter (slots, host copy); refused while requests use it; idempotent."""
        running = self._running_adapters_by_slot()
        if adapter_id not in running.values():
            # Its directory may hold another tokenizer when an adapter of that id comes back.
            self.grammars.forget_adapter(adapter_id)
        self.lora.unload(adapter_id, running)

    def _running_adapters_by_slot(self) -> dict[int, str]:
        # Snapshots first (atomic under the GIL): activations call this beside the steps.
        return {
            r.lora_slot: r.adapter_id
            for batch in list(self.batches.values())
            for r in list(batch.requests)
            if r.lora_slot >= 0
        }
