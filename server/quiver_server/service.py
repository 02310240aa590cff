"""The gRPC face of the shard: protobuf in, `Engine` call, protobuf out. No logic of its own.

Engine calls block (torch), so they run on one dedicated worker thread (`EngineThread`, the
thread that also loaded the model): the event loop stays free
to answer `Health` during a long prefill, and the engine never sees two calls at once (its batch
state and KV cache are not thread-safe, and the router never overlaps steps anyway).
`LoadAdapter` and `PrefetchAdapter` are exceptions: a hub download or a disk read must not stall
decoding, so they run on loader threads (the engine's adapter manager, `Engine.lora`, is
thread-safe). So does
`ActivateAdapter`, on a slot-copy thread of its own: the router fills a slot no step reads and
admits its requests once the copy is done (`adapters/slots.py`). Unloading runs on the engine
thread, between steps. `CompileGrammar` runs on a compile pool too (a grammar can take seconds
to build) and pins the grammar for the Prefills that name it, so the engine thread never
compiles.

Only the engine thread runs torch ops on a team of threads: the helper threads run theirs on
themselves (`torch.set_num_threads(1)` as they start). OpenMP gives each thread that opens a
parallel region a team of its own, and a second team slowed the engine's steps on small hosts
(docs/architecture.md, "Threads"); a helper's copy or conversion then takes one core, not all.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

import torch
from grpc import aio

from quiver_server.engine.batch_types import (
    GrammarSpec,
    ModelInfo,
    RequestSpec,
    SamplingParams,
    StepResult,
    TokenLogprob,
    TokenOut,
)
from quiver_server.bounded_text import bounded
from quiver_server.engine.engine_thread import EngineThread
from quiver_server.grammar import GrammarError
from quiver_server.pb import shard_pb2, shard_pb2_grpc

if TYPE_CHECKING:
    from quiver_server.engine.engine import Engine

T = TypeVar("T")

GRAMMAR_KINDS = {
    shard_pb2.Grammar.KIND_JSON_SCHEMA: "json_schema",
    shard_pb2.Grammar.KIND_REGEX: "regex",
    shard_pb2.Grammar.KIND_LARK: "lark",
}


def grammar_from_pb(grammar: shard_pb2.Grammar) -> GrammarSpec:
    # An unspecified kind becomes "", which validation refuses with a message.
    return GrammarSpec(
        kind=GRAMMAR_KINDS.get(grammar.kind, ""), text=grammar.text, eos_token_ids=tuple(grammar.eos_token_ids)
    )


def request_from_pb(request: shard_pb2.Request) -> RequestSpec:
    sampling = request.sampling
    return RequestSpec(
        id=request.id,
        input_ids=list(request.input_ids),
        blocks=list(request.blocks),
        sampling=SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            repetition_penalty=sampling.repetition_penalty,
            seed=sampling.seed,
            draws_done=sampling.draws_done,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            logit_bias=dict(sampling.logit_bias),
            top_logprobs=sampling.top_logprobs,
        ),
        max_new_tokens=request.max_new_tokens,
        adapter_id=request.adapter_id,
        prompt_logprobs=request.prompt_logprobs if request.HasField("prompt_logprobs") else None,
        grammar_id=request.grammar_id,
        cached_tokens=request.cached_tokens,
        prefill_until=request.prefill_until,
        embed=request.embed,
    )


def info_to_pb(info: ModelInfo) -> shard_pb2.InfoResponse:
    return shard_pb2.InfoResponse(
        model_id=info.model_id,
        model_type=info.model_type,
        dtype=info.dtype,
        device=info.device,
        vocab_size=info.vocab_size,
        max_position_embeddings=info.max_position_embeddings,
        rank=info.rank,
        world_size=info.world_size,
        eos_token_ids=info.eos_token_ids,
        model_path=info.model_path,
        weight_bytes=info.weight_bytes,
        embedding_dim=info.embedding_dim,
        pooling=info.pooling,
        pooling_refusal=info.pooling_refusal,
        generation_refusal=info.generation_refusal,
    )


def _token_logprobs_to_pb(tokens: list[TokenLogprob]) -> list[shard_pb2.TokenLogprob]:
    return [shard_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in tokens]


def generation_to_pb(generation: TokenOut) -> shard_pb2.Generation:
    return shard_pb2.Generation(
        request_id=generation.request_id,
        token_id=generation.token_id,
        logprob=generation.logprob,
        top_logprobs=_token_logprobs_to_pb(generation.top_logprobs),
        prompt_logprobs=[
            shard_pb2.PromptPosition(logprob=p.logprob, top=_token_logprobs_to_pb(p.top), rank=p.rank)
            for p in generation.prompt_logprobs
        ],
        embedding=generation.embedding,
    )


def _generations_to_pb(step: StepResult) -> list[shard_pb2.Generation]:
    return [generation_to_pb(g) for g in step.generations]


def _batch_to_pb(batch_id: int, request_ids: list[int]) -> shard_pb2.CachedBatch:
    return shard_pb2.CachedBatch(id=batch_id, request_ids=request_ids)


def _helper_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """Threads beside the engine's, whose torch ops each run on the thread itself."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=torch.set_num_threads,
                              initargs=(1,))


class ShardService(shard_pb2_grpc.ShardServicer):
    """Implements `quiver.v1.Shard` by delegating to one `Engine`.

    `rank`/`world_size` come from the command line: they describe this process's place among the
    shards, which the engine (a single-process model runner) does not know.
    """

    def __init__(self, engine: Engine, rank: int = 0, world_size: int = 1,
                 engine_thread: EngineThread | None = None) -> None:
        self._engine = engine
        self._info = dataclasses.replace(engine.info, rank=rank, world_size=world_size)
        # The thread that built `engine`, where there is one (see engine_thread.py).
        self._worker = engine_thread or EngineThread()
        # The engine thread's team is the caller's size, set now: a helper's start sets torch's
        # default for threads that have not run a torch op yet to 1.
        self._worker.call(torch.set_num_threads, torch.get_num_threads())
        self._loader = _helper_pool(2, "quiver-adapter-load")
        # Slot copies run beside the steps, one at a time (adapters/slots.py).
        self._activator = _helper_pool(1, "quiver-adapter-slot")
        self._compiler = _helper_pool(2, "quiver-grammar")

    @property
    def info(self) -> ModelInfo:
        return self._info

    async def _run(self, call: Callable[..., T], *args: object) -> T:
        return await self._worker.run(call, *args)

    def close(self) -> None:
        """Waits for the engine calls in progress (if any), then stops the worker threads."""
        self._loader.shutdown(wait=True)
        self._activator.shutdown(wait=True)
        self._compiler.shutdown(wait=True)
        self._worker.shutdown()

    async def Info(
        self, request: shard_pb2.InfoRequest, context: aio.ServicerContext
    ) -> shard_pb2.InfoResponse:
        return info_to_pb(self._info)

    async def Health(
        self, request: shard_pb2.HealthRequest, context: aio.ServicerContext
    ) -> shard_pb2.HealthResponse:
        # The server only starts listening once the model is loaded, so answering at all is
        # the health signal.
        return shard_pb2.HealthResponse()

    async def Warmup(
        self, request: shard_pb2.WarmupRequest, context: aio.ServicerContext
    ) -> shard_pb2.WarmupResponse:
        block_size, num_blocks = await self._run(
            self._engine.warmup,
            request.max_batch_prefill_tokens,
            request.max_total_tokens,
            request.max_batch_size,
            request.max_batch_total_tokens,
            request.max_active_adapters,
            request.max_lora_rank,
            list(request.slot_ranks),
        )
        return shard_pb2.WarmupResponse(block_size=block_size, num_blocks=num_blocks)

    async def Prefill(
        self, request: shard_pb2.PrefillRequest, context: aio.ServicerContext
    ) -> shard_pb2.PrefillResponse:
        specs = [request_from_pb(r) for r in request.requests]
        step = await self._run(self._engine.prefill, request.batch_id, specs)
        return shard_pb2.PrefillResponse(
            generations=_generations_to_pb(step),
            batch=_batch_to_pb(step.batch_id, step.request_ids),
            forward_ns=step.forward_ns,
            grammar_ns=step.grammar_ns,
        )

    async def Decode(
        self, request: shard_pb2.DecodeRequest, context: aio.ServicerContext
    ) -> shard_pb2.DecodeResponse:
        # Membership of each cached batch lives in the engine (FilterBatch updates it); only the
        # ids are needed here.
        batch_ids = [b.id for b in request.batches]
        prefill: shard_pb2.PrefillResponse | None = None
        if request.HasField("prefill"):
            specs = [request_from_pb(r) for r in request.prefill.requests]
            step, prefilled = await self._run(self._engine.mixed_step, batch_ids, request.prefill.batch_id, specs)
            prefill = shard_pb2.PrefillResponse(
                generations=_generations_to_pb(prefilled),
                batch=_batch_to_pb(prefilled.batch_id, prefilled.request_ids),
            )
        else:
            step = await self._run(self._engine.decode, batch_ids)
        return shard_pb2.DecodeResponse(
            generations=_generations_to_pb(step),
            batch=_batch_to_pb(step.batch_id, step.request_ids),
            forward_ns=step.forward_ns,
            grammar_ns=step.grammar_ns,
            prefill=prefill,
        )

    async def FilterBatch(
        self, request: shard_pb2.FilterBatchRequest, context: aio.ServicerContext
    ) -> shard_pb2.FilterBatchResponse:
        kept = await self._run(self._engine.filter_batch, request.batch_id, list(request.request_ids))
        return shard_pb2.FilterBatchResponse(batch=_batch_to_pb(request.batch_id, kept))

    async def ClearCache(
        self, request: shard_pb2.ClearCacheRequest, context: aio.ServicerContext
    ) -> shard_pb2.ClearCacheResponse:
        batch_id = request.batch_id if request.HasField("batch_id") else None
        await self._run(self._engine.clear_cache, batch_id)
        return shard_pb2.ClearCacheResponse()

    async def LoadAdapter(
        self, request: shard_pb2.LoadAdapterRequest, context: aio.ServicerContext
    ) -> shard_pb2.LoadAdapterResponse:
        info = await asyncio.get_running_loop().run_in_executor(
            self._loader, self._engine.lora.load, request.adapter_id, request.source, request.path,
            request.revision,
        )
        return shard_pb2.LoadAdapterResponse(
            path=info.path, rank=info.rank, scaling=info.scaling, target_modules=info.target_modules
        )

    async def ActivateAdapter(
        self, request: shard_pb2.ActivateAdapterRequest, context: aio.ServicerContext
    ) -> shard_pb2.ActivateAdapterResponse:
        hit = await asyncio.get_running_loop().run_in_executor(
            self._activator, self._engine.activate_adapter, request.adapter_id, request.slot
        )
        return shard_pb2.ActivateAdapterResponse(host_cache_hit=hit)

    async def PrefetchAdapter(
        self, request: shard_pb2.PrefetchAdapterRequest, context: aio.ServicerContext
    ) -> shard_pb2.PrefetchAdapterResponse:
        hit = await asyncio.get_running_loop().run_in_executor(
            self._loader, self._engine.lora.prefetch, request.adapter_id
        )
        return shard_pb2.PrefetchAdapterResponse(host_cache_hit=hit)

    async def UnloadAdapter(
        self, request: shard_pb2.UnloadAdapterRequest, context: aio.ServicerContext
    ) -> shard_pb2.UnloadAdapterResponse:
        await self._run(self._engine.unload_adapter, request.adapter_id)
        return shard_pb2.UnloadAdapterResponse()

    async def CompileGrammar(
        self, request: shard_pb2.CompileGrammarRequest, context: aio.ServicerContext
    ) -> shard_pb2.CompileGrammarResponse:
        grammar = grammar_from_pb(request.grammar)
        try:
            compile_ns = await asyncio.get_running_loop().run_in_executor(
                self._compiler, self._engine.grammars.pin, request.grammar_id, request.adapter_id, grammar
            )
        except GrammarError as error:
            return shard_pb2.CompileGrammarResponse(error=bounded(str(error)))
        return shard_pb2.CompileGrammarResponse(compile_ns=compile_ns)

    async def ReleaseGrammars(
        self, request: shard_pb2.ReleaseGrammarsRequest, context: aio.ServicerContext
    ) -> shard_pb2.ReleaseGrammarsResponse:
        self._engine.grammars.release(list(request.grammar_ids))
        return shard_pb2.ReleaseGrammarsResponse()
