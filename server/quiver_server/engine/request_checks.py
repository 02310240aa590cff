"""What a step refuses before it touches the device: a prefill's requests, a decode's batch.

A prefill's check is also where each request's adapter slot is looked up, once: the slot it
returns goes into the step plan and the request's state, and nothing looks it up again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from quiver_server.adapters.manager import AdapterManager
from quiver_server.engine import sampling
from quiver_server.engine.batch_state import RequestState
from quiver_server.engine.batch_types import RequestSpec
from quiver_server.engine.kv_cache import BLOCK_SIZE, KVCacheSpec
from quiver_server.grammar import Grammars


@dataclass(frozen=True)
class RequestLimits:
    """What the loaded model and the allocated cache allow a request."""

    vocab_size: int
    max_position_embeddings: int
    kv_spec: KVCacheSpec
    num_blocks: int  # in the KV cache the router allocates from
    generation_refusal: str  # non-empty: why this model generates nothing
    pooling_refusal: str  # non-empty: why this model serves no embeddings


def check_prefill(
    requests: Sequence[RequestSpec], limits: RequestLimits, lora: AdapterManager, grammars: Grammars
) -> list[int]:
    """Refuses a prefill that cannot run (ValueError saying why); returns each request's adapter
    slot (-1: the base model), the one lookup the request gets."""
    if not requests:
        raise ValueError("prefill needs at least one request")
    if len({r.id for r in requests}) != len(requests):
        raise ValueError("prefill has duplicate request ids")
    return [_check_request(request, limits, lora, grammars) for request in requests]


def check_decode(requests: Sequence[RequestState], max_position_embeddings: int) -> None:
    """Refuses a decode step that a request has no room for (in its blocks, or in positions)."""
    for request in requests:
        if request.length >= len(request.blocks) * BLOCK_SIZE:
            raise ValueError(f"request {request.id} has filled its {len(request.blocks)} KV blocks")
        if request.length >= max_position_embeddings:
            raise ValueError(f"request {request.id} reached max_position_embeddings")


def _check_request(request: RequestSpec, limits: RequestLimits, lora: AdapterManager, grammars: Grammars) -> int:
    rid = request.id
    slot = lora.slot_for(rid, request.adapter_id)
    if not request.input_ids:
        raise ValueError(f"request {rid}: empty prompt")
    _check_span(request)
    vocab_size = limits.vocab_size
    if max(request.input_ids) >= vocab_size or min(request.input_ids) < 0:
        bad = next(t for t in request.input_ids if not 0 <= t < vocab_size)
        raise ValueError(f"request {rid}: token id {bad} is out of range for vocab size {vocab_size}")
    if request.embed:
        _check_embed(request, limits.pooling_refusal)
    elif limits.generation_refusal:
        raise ValueError(f"request {rid}: {limits.generation_refusal}")
    elif request.max_new_tokens < 1:
        raise ValueError(f"request {rid}: max_new_tokens must be >= 1")
    total = len(request.input_ids) + request.max_new_tokens
    if total > limits.max_position_embeddings:
        raise ValueError(
            f"request {rid}: len(prompt) + max_new_tokens = {total} exceeds "
            f"max_position_embeddings = {limits.max_position_embeddings}"
        )
    needed = limits.kv_spec.blocks_for_tokens(total)
    if len(request.blocks) < needed:
        raise ValueError(
            f"request {rid}: block table too short: len(prompt) + max_new_tokens = {total} tokens need "
            f"{needed} blocks of {BLOCK_SIZE}, got {len(request.blocks)}"
        )
    if min(request.blocks) < 0 or max(request.blocks) >= limits.num_blocks:
        raise ValueError(f"request {rid}: block ids must be in [0, {limits.num_blocks})")
    sampling.validate(request.sampling, vocab_size, request.prompt_logprobs)
    if request.grammar_id and not grammars.is_pinned(request.grammar_id):
        raise ValueError(f"request {rid}: grammar {request.grammar_id} is not pinned on this shard "
                         "(CompileGrammar pins it, ReleaseGrammars unpins it)")
    return slot


def _check_embed(request: RequestSpec, pooling_refusal: str) -> None:
    """An embedding is pooled over the whole prompt, computed in this one call."""
    if pooling_refusal:
        raise ValueError(f"request {request.id}: this model serves no embeddings: {pooling_refusal}")
    if request.cached_tokens or request.prefill_until or request.prompt_logprobs is not None \
            or request.grammar_id or request.max_new_tokens:
        raise ValueError(f"request {request.id}: an embed request computes its whole prompt and nothing else "
                         "(no cached_tokens, prefill_until, prompt_logprobs, grammar or max_new_tokens)")


def _check_span(request: RequestSpec) -> None:
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
