"""The shard's compute core: the model, the paged KV cache and the running batches.

The router owns scheduling and block accounting; the engine runs what it is told. A request's
life: `prefill` runs its prompt, writes the prompt's K/V into the blocks the router gave it and
samples the first token; each `decode` feeds the last sampled token of every request of the
merged batches, writes its K/V and samples the next; `filter_batch` drops finished requests.
A prefill may skip a prompt prefix whose K/V its blocks already hold (`cached_tokens`: the
router's prefix cache, or earlier chunks), and may stop short of the prompt's end
(`prefill_until`): such a chunk only writes K/V, and a later prefill finishes the prompt.
An `embed` request of a prefill gets its own forward pass (`_embed`): pooled hidden states, no
logits, nothing kept.

Plan, then run: a step checks its requests (`request_checks`, where each request's adapter slot
is looked up, once), builds its plan (`step_plan`: states, tokens, block tables, spans, sampling
tensors, grammar matchers), then runs forward pass -> sample -> record (`_run`). Warm-up and
the KV cache's sizing live in `warmup`.

LoRA adapters (`adapters/`, held by `self.lora`): `lora.load` reads one into host memory
(thread-safe, so the service runs it beside the steps), `activate_adapter` copies it into a
device slot between steps, and a request names its adapter by id and keeps that slot for life.

Grammars (`grammar/`, held by `self.grammars`): `grammars.pin` compiles (or finds cached) one
for a request's tokenizer and pins it under the router's id until `grammars.release` (thread-
safe, so the service runs it off this thread); a request naming a pinned grammar gets its own
matcher at prefill, and nothing is compiled there; each step fills the matchers' mask while its forward
pass runs and masks the logits with it; the matchers then consume the sampled tokens in the
background, before the next step's fill.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from quiver_server.adapters.manager import AdapterManager
from quiver_server.device_choice import resolve_device, resolve_dtype
from quiver_server.engine import logprobs, sampling
from quiver_server.engine.batch_state import CachedBatch
from quiver_server.engine.batch_types import ModelInfo, PromptPosition, RequestSpec, StepResult, TokenOut
from quiver_server.engine.decode_graphs import DecodeGraphs
from quiver_server.engine.forward_batch import build_decode
from quiver_server.engine.kv_cache import BLOCK_SIZE, KVCacheSpec, PagedKVCache
from quiver_server.engine.kv_cache_dtype import resolve as resolve_kv_cache_dtype
from quiver_server.engine.pooling import pool, read_pooling
from quiver_server.engine.request_checks import RequestLimits, check_decode, check_prefill
from quiver_server.engine.step_plan import (
    ForwardPlan,
    PrefillPlan,
    StepPlan,
    plan_decode,
    plan_embedding,
    plan_mixed,
    plan_prefill,
)
from quiver_server.engine.warmup import WarmupLimits, allocate_cache
from quiver_server.grammar import Grammars
from quiver_server.grammar.masks import PendingMask
from quiver_server.grammar.compiler import DEFAULT_BUDGET_S, DEFAULT_CACHE_SIZE
from quiver_server.kernels.ops import select_ops
from quiver_server.kernels.quant_gemm import check_int8_activations
from quiver_server.layers.grouped_linear import host_sync_free
from quiver_server.models import family_for, load_model
from quiver_server.models.checkpoint_layout import no_lm_head_refusal
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
        quantize_activations: str = "none",
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
        quantize_activations: "int8" rounds the quantized projections' inputs to int8 in blocks of
        32 and multiplies in 8-bit integers (CPU kernels only; needs quantized projections).
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
        self.ops = select_ops(self.device, quantize_activations)
        if quantize_lm_head and not quantize:
            raise ValueError("--quantize-lm-head needs --quantize")
        spec = QuantizeSpec(quantize, quantize_group_size, quantize_lm_head) if quantize else None
        self.model = load_model(path, config, self.dtype, self.device, self.ops, spec, tp)
        if quantize_activations != "none":
            check_int8_activations(self.model.quantized_weights())
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
        cache (`warmup.allocate_cache`); returns (block_size, num_blocks)."""
        limits = WarmupLimits(max_batch_prefill_tokens, max_total_tokens, max_batch_size, max_batch_total_tokens)
        limits.check()
        if max_active_adapters > 0 and max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be positive with max_active_adapters={max_active_adapters}")
        self.batches.clear()
        self.kv_cache = self.graphs = self._ahead = None
        self.lora.allocate_slots(max_active_adapters, max_lora_rank, slot_ranks)
        self.kv_cache, self.graphs, num_blocks = allocate_cache(self, limits)
        return BLOCK_SIZE, num_blocks

    # ---- steps --------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, batch_id: int, requests: list[RequestSpec]) -> StepResult:
        kv_cache = self._require_cache()
        if batch_id in self.batches:
            raise ValueError(f"batch id {batch_id} is already in use")
        slots = check_prefill(requests, self._request_limits(kv_cache), self.lora, self.grammars)

        start = time.perf_counter_ns()
        generating = [(r, slot) for r, slot in zip(requests, slots, strict=True) if not r.embed]
        embeds = [(r, slot) for r, slot in zip(requests, slots, strict=True) if r.embed]
        result = (self._prefill_generating(batch_id, generating, kv_cache, start) if generating
                  else StepResult(generations=[], batch_id=batch_id, request_ids=[]))
        if embeds:
            # Their own forward pass: every token's hidden state is wanted, and no logits.
            embedded = self._embed(embeds, kv_cache)
            result = dataclasses.replace(result, generations=result.generations + embedded,
                                         forward_ns=time.perf_counter_ns() - start)
        return result

    def _prefill_generating(self, batch_id: int, requests: list[tuple[RequestSpec, int]], kv_cache: PagedKVCache,
                            start: int) -> StepResult:
        return self._run_prefill(batch_id, self._plan_prefill(requests), kv_cache, start)

    def _plan_prefill(self, requests: list[tuple[RequestSpec, int]]) -> PrefillPlan:
        return plan_prefill([r for r, _ in requests], [slot for _, slot in requests], self.grammars,
                            self.lora.ranks, self.vocab_size, self.device)

    def _run_prefill(self, batch_id: int, plan: PrefillPlan, kv_cache: PagedKVCache, start: int) -> StepResult:
        forward = plan.forward
        if plan.step is None:
            self._forward(forward, kv_cache)
            return StepResult(generations=[], batch_id=batch_id, request_ids=[],
                              forward_ns=time.perf_counter_ns() - start)
        result = self._run(batch_id, plan.step, lambda: self._forward(forward, kv_cache), start)
        self.batches[batch_id] = plan.step.batch
        return result

    def _embed(self, requests: list[tuple[RequestSpec, int]], kv_cache: PagedKVCache) -> list[TokenOut]:
        """The pooled embedding of each `embed` request's prompt (its K/V land in its blocks,
        which the router frees when the call returns)."""
        forward = plan_embedding([r for r, _ in requests], [slot for _, slot in requests], self.lora.ranks,
                                 self.device)
        hidden = self.model.hidden_states(forward.input_ids, forward.batch, kv_cache)
        vectors = pool(hidden, forward.lengths, self.pooling)
        return [TokenOut(request_id=r.id, token_id=0, logprob=0.0, embedding=v)
                for (r, _), v in zip(requests, vectors, strict=True)]

    def _forward(self, forward: ForwardPlan, kv_cache: PagedKVCache) -> torch.Tensor:
        return self.model(forward.input_ids, forward.batch, kv_cache)

    @torch.inference_mode()
    def decode(self, batch_ids: list[int]) -> StepResult:
        self._require_cache()
        self._check_decode(batch_ids)
        start = time.perf_counter_ns()
        return self._decode_batch(batch_ids[0], self._merged(batch_ids), start)

    def _check_decode(self, batch_ids: list[int]) -> None:
        if not batch_ids:
            raise ValueError("decode needs at least one batch id")
        if len(set(batch_ids)) != len(batch_ids):
            raise ValueError(f"decode got a batch id twice: {batch_ids}")
        check_decode([r for batch_id in batch_ids for r in self._batch(batch_id).requests],
                     self.max_position_embeddings)

    def _decode_batch(self, batch_id: int, batch: CachedBatch, start: int) -> StepResult:
        if not batch.requests:
            return StepResult(generations=[], batch_id=batch_id, request_ids=[])
        plan = plan_decode(batch, self.vocab_size, self.device)
        lengths = [r.length for r in batch.requests]
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.batch is batch and ahead.lengths == lengths:
            # Launched by the previous step on exactly these requests, tokens and positions.
            return self._run(batch_id, plan, lambda: ahead.logits, start)
        input_ids = batch.input_ids(self.device)
        return self._run(batch_id, plan, lambda: self._decode_logits(batch, input_ids, lengths), start)

    @torch.inference_mode()
    def mixed_step(self, batch_ids: list[int], prefill_batch_id: int,
                   requests: list[RequestSpec]) -> tuple[StepResult, StepResult]:
        """A decode step of `batch_ids` (as `decode`) and the prefill of `requests` (as `prefill`
        would run them under `prefill_batch_id`) in one forward pass, so the weights are read
        once for both: (the decode's result, the prefill's). The prefill's finished prompts then
        join the decoded batch, after its requests, and no batch of `prefill_batch_id` is kept.
        The decode's forward_ns is the whole step's; the prefill's is 0."""
        kv_cache = self._require_cache()
        if prefill_batch_id in self.batches or prefill_batch_id in batch_ids:
            raise ValueError(f"batch id {prefill_batch_id} is already in use")
        self._check_decode(batch_ids)
        slots = check_prefill(requests, self._request_limits(kv_cache), self.lora, self.grammars)
        start = time.perf_counter_ns()
        generating = [(r, slot) for r, slot in zip(requests, slots, strict=True) if not r.embed]
        embeds = [(r, slot) for r, slot in zip(requests, slots, strict=True) if r.embed]
        # Planned before anything changes: a refusal (ValueError) leaves every batch as it was,
        # so the router may take the step again as a Prefill and a Decode.
        prefill = self._plan_prefill(generating) if generating else None
        batch = self._merged(batch_ids)
        self._ahead = None  # the batch changes now: a forward launched for it is void
        if prefill is not None and batch.requests:
            decoded, prefilled, new = self._run_mixed(batch_ids[0], batch, prefill_batch_id, prefill, kv_cache,
                                                      start)
        else:  # nothing to share a pass with
            decoded = self._decode_batch(batch_ids[0], batch, start)
            prefilled = (self._run_prefill(prefill_batch_id, prefill, kv_cache, start) if prefill is not None
                         else StepResult(generations=[], batch_id=prefill_batch_id, request_ids=[]))
            new = self.batches.pop(prefill_batch_id, None)
        joined = CachedBatch.joined([batch, new]) if new is not None else batch
        if joined.requests:
            self.batches[batch_ids[0]] = joined
        if embeds:
            embedded = self._embed(embeds, kv_cache)
            prefilled = dataclasses.replace(prefilled, generations=prefilled.generations + embedded)
        decoded = dataclasses.replace(decoded, request_ids=joined.request_ids,
                                      forward_ns=time.perf_counter_ns() - start,
                                      grammar_ns=decoded.grammar_ns + prefilled.grammar_ns)
        return decoded, dataclasses.replace(prefilled, forward_ns=0, grammar_ns=0)

    def _run_mixed(self, batch_id: int, batch: CachedBatch, prefill_batch_id: int, prefill: PrefillPlan,
                   kv_cache: PagedKVCache, start: int) -> tuple[StepResult, StepResult, CachedBatch | None]:
        """`mixed_step`'s shared pass: (the decode's result, the prefill's, its new batch)."""
        plan = plan_mixed(prefill, batch, self.lora.ranks, self.vocab_size, self.device)
        logits: list[torch.Tensor] = []

        def forward_once() -> torch.Tensor:  # the pass both steps sample from
            if not logits:
                logits.append(self._forward(plan.forward, kv_cache))
            return logits[0]

        prefilled = StepResult(generations=[], batch_id=prefill_batch_id, request_ids=[])
        # The decode rows' grammar mask fills beside the shared pass too, not after it.
        decode_mask = self._start_mask(plan.decode)
        if plan.prefill is not None:
            try:
                prefilled = self._run(prefill_batch_id, plan.prefill, lambda: forward_once()[: plan.prefill_rows],
                                      start, launch_ahead=False)
            except BaseException:
                if decode_mask is not None:  # its matchers are the fill's until it ends
                    with contextlib.suppress(Exception):  # the pass's own error is the one to report
                        decode_mask.wait(self.device)
                raise
        decoded = self._run(batch_id, plan.decode, lambda: forward_once()[plan.prefill_rows :], start,
                            launch_ahead=False, started_mask=decode_mask)
        return decoded, prefilled, plan.prefill.batch if plan.prefill is not None else None

    def _merged(self, batch_ids: list[int]) -> CachedBatch:
        """The batches' requests as one batch, kept under the first id."""
        batch = self.batches[batch_ids[0]]
        if len(batch_ids) > 1:
            batch = CachedBatch.joined([self.batches[batch_id] for batch_id in batch_ids])
            for batch_id in batch_ids[1:]:
                del self.batches[batch_id]
            self.batches[batch_ids[0]] = batch
        return batch

    def _start_mask(self, plan: StepPlan) -> PendingMask | None:
        """Starts filling the step's grammar rows' mask on its own thread (None: no such row)."""
        inputs = plan.inputs
        return self.grammars.masks.start(inputs.matchers, self.device.type == "cuda") if inputs.has_grammar \
            else None

    def _run(self, batch_id: int, plan: StepPlan, run_forward: Callable[[], torch.Tensor], start: int,
             launch_ahead: bool = True, started_mask: PendingMask | None = None) -> StepResult:
        """A planned step: forward pass -> sample -> record. run_forward: the step's forward pass
        (the model eagerly, a decode graph, or the logits launched ahead) -> logits.
        launch_ahead: False where the batch changes after this step (a mixed step).
        started_mask: the step's mask fill, where the caller started it (`_start_mask`)."""
        batch, inputs = plan.batch, plan.inputs
        # The grammar rows' mask is filled on its own thread while the forward pass runs.
        pending = started_mask if started_mask is not None else self._start_mask(plan)
        try:
            logits = run_forward()
        finally:  # the matchers are the fill's until it ends, even when the forward pass failed
            grammar = pending.wait(self.device) if pending is not None else None
        sampled = sampling.sample(
            logits if plan.sample_rows is None else logits[plan.sample_rows],
            inputs.params, inputs.draws, inputs.seen, self.ops, inputs.counts, grammar,
        )
        prompt: dict[int, list[PromptPosition]] = {}
        if plan.prompt_spans:
            prompt = dict(zip(plan.prompt_spans,
                              logprobs.prompt_logprobs(logits, list(plan.prompt_spans.values())), strict=True))
        if plan.fed_last_token and self.overlap_steps and launch_ahead:
            self._launch_ahead(batch, sampled.tokens)
        token_list, logprob_list = sampled.tokens.tolist(), sampled.logprobs.tolist()
        batch.record(sampled.tokens, token_list, plan.fed_last_token)
        if grammar is not None:
            self.grammars.masks.advance_in_background(inputs.matchers, token_list)
        tops = logprobs.top_lists(sampled.top, inputs.params.top_logprobs)
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

    def _request_limits(self, kv_cache: PagedKVCache) -> RequestLimits:
        return RequestLimits(self.vocab_size, self.max_position_embeddings, self.kv_spec, kv_cache.num_blocks,
                             self.generation_refusal, self.pooling.refusal)

    # ---- adapters -----------------------------------------------------------------------------
    # Loading, prefetching and grammars go to `self.lora` and `self.grammars` directly; these two
    # also read which adapters the running requests hold.

    @torch.inference_mode()
    def activate_adapter(self, adapter_id: str, slot: int) -> bool:
        """Copies a loaded adapter into device slot `slot`, replacing what it held; refused for a
        slot that running requests use. True when the weights were in the host-memory cache.
        Safe to call while steps run on another thread (the service does), for a slot no step
        reads: the router admits the adapter's requests only once it returns."""
        return self.lora.activate(adapter_id, slot, self._running_adapters_by_slot())

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
