"""A step's plan: what one prefill, decode or embedding step runs on, resolved once from its requests.

The engine builds the plan and then only runs it: forward pass -> sample -> record (`Engine`).
A prefill's plan comes from its checked requests and the adapter slot each was given (looked up
once, by `request_checks`): the new requests' states (penalty rows, grammar matchers), the
input tokens, the forward batch (block tables, spans, LoRA metadata), which logits rows are
sampled, where prompt logprobs sit, and the batch's sampling tensors. A decode step's plan is
its cached batch's, whose tensors were built once for its composition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import llguidance
import torch

from quiver_server.engine import logprobs
from quiver_server.engine.batch_state import CachedBatch, SamplingInputs, new_request_state, padded_block_table
from quiver_server.engine.batch_types import RequestSpec
from quiver_server.engine.forward_batch import (
    ForwardBatch,
    build_decode,
    build_mixed,
    build_prefill,
    logits_rows_per_sequence,
)
from quiver_server.engine.kv_cache import BLOCK_SIZE
from quiver_server.grammar import Grammars
from quiver_server.kernels.lora_meta import RankClasses


@dataclass(frozen=True)
class StepPlan:
    """The rows one step samples and keeps, and what their sampling reads."""

    batch: CachedBatch
    inputs: SamplingInputs  # the batch's sampling tensors and grammar matchers
    fed_last_token: bool  # a decode step: each row's previous last token is now in the cache
    sample_rows: torch.Tensor | None = None  # each row's logits row; None: every row is one
    prompt_spans: dict[int, logprobs.PromptSpan] = field(default_factory=dict)  # row -> its prompt logprobs


@dataclass(frozen=True)
class ForwardPlan:
    """One forward pass over the new tokens of every request of a prefill (or embedding call)."""

    input_ids: torch.Tensor  # [tokens] on the device
    batch: ForwardBatch
    lengths: list[int]  # new tokens per request


@dataclass(frozen=True)
class PrefillPlan:
    forward: ForwardPlan
    step: StepPlan | None  # None: every request is a chunk, which only writes its K/V
    slots: list[int]  # each request's adapter slot (-1: the base model)
    logits_rows: list[int]  # logits rows per request (`logits_rows_per_sequence`)


@dataclass(frozen=True)
class MixedPlan:
    """A prefill and a decode step in one forward pass (prompt tokens first): the prefill's
    plan samples the first `prefill_rows` logits rows, the decode's the others."""

    forward: ForwardPlan
    prefill: StepPlan | None
    decode: StepPlan
    prefill_rows: int


def plan_prefill(
    requests: Sequence[RequestSpec], slots: Sequence[int], grammars: Grammars, lora_ranks: RankClasses | None,
    vocab_size: int, device: torch.device,
) -> PrefillPlan:
    """The plan of a prefill of generating requests; `slots`: each one's adapter slot."""
    # Chunks of unfinished prompts only write their K/V: no state, no sample, no batch.
    finals = [(r, slot) for r, slot in zip(requests, slots, strict=True) if r.is_final]
    batch = CachedBatch([new_request_state(r, slot, new_matcher(r, grammars), vocab_size, device)
                         for r, slot in finals])
    new_lens = [r.until - r.cached_tokens for r in requests]
    sampled = [r.is_final for r in requests]
    # Requests with prompt logprobs get the logits of every prompt token, the others the last
    # (validation keeps prompt logprobs to whole prompts computed in one pass).
    asked = [r.prompt_logprobs for r in requests]
    all_logits = [a is not None for a in asked] if any(a is not None for a in asked) else None
    table = batch.block_table(device) if len(finals) == len(requests) else padded_block_table(
        [r.blocks for r in requests], device)
    # LoRA applies to the tokens computed now, so its metadata counts the new tokens only.
    lora_slots = list(slots) if any(r.adapter_id for r in requests) else None
    forward = ForwardPlan(
        _input_ids(requests, device),
        build_prefill(new_lens, table, BLOCK_SIZE, device, lora_slots, lora_ranks or 0, all_logits,
                      [r.cached_tokens for r in requests], sampled),
        new_lens,
    )
    rows_per_sequence = logits_rows_per_sequence(new_lens, all_logits, sampled)
    if not finals:
        return PrefillPlan(forward, None, list(slots), rows_per_sequence)
    # Chunks have no logits rows, so the final requests' rows are laid out as among themselves.
    spans = logprobs.prompt_spans(
        [r.input_ids for r, _ in finals], [r.prompt_logprobs for r, _ in finals],
        [n for n, final in zip(rows_per_sequence, sampled, strict=True) if final],
    )
    step = StepPlan(batch, batch.sampling_inputs(vocab_size, device), fed_last_token=False,
                    sample_rows=forward.batch.sample_rows, prompt_spans=spans)
    return PrefillPlan(forward, step, list(slots), rows_per_sequence)


def plan_mixed(prefill: PrefillPlan, batch: CachedBatch, lora_ranks: RankClasses | None, vocab_size: int,
               device: torch.device) -> MixedPlan:
    """A decode step of `batch` run in the forward pass of `prefill` (planned by plan_prefill)."""
    lengths = [r.length for r in batch.requests]
    tail = build_decode(lengths, batch.block_table(device), BLOCK_SIZE, device)
    head = prefill.forward.batch
    forward = build_mixed(head, prefill.logits_rows, prefill.slots, tail, [r.lora_slot for r in batch.requests],
                          lora_ranks or 0, device)
    input_ids = torch.cat((prefill.forward.input_ids, batch.input_ids(device).to(torch.long)))
    return MixedPlan(ForwardPlan(input_ids, forward, prefill.forward.lengths + [1] * len(lengths)),
                     prefill.step, plan_decode(batch, vocab_size, device), int(head.logits_indices.shape[0]))


def plan_embedding(
    requests: Sequence[RequestSpec], slots: Sequence[int], lora_ranks: RankClasses | None, device: torch.device
) -> ForwardPlan:
    """The forward pass of `embed` requests: every prompt token's hidden state, no logits rows
    (their K/V land in their blocks, which the router frees when the call returns)."""
    lens = [len(r.input_ids) for r in requests]
    table = padded_block_table([r.blocks for r in requests], device)
    lora_slots = list(slots) if any(s >= 0 for s in slots) else None
    forward = build_prefill(lens, table, BLOCK_SIZE, device, lora_slots, lora_ranks or 0,
                            sampled=[False] * len(requests))
    return ForwardPlan(_input_ids(requests, device), forward, lens)


def plan_decode(batch: CachedBatch, vocab_size: int, device: torch.device) -> StepPlan:
    """A decode step of `batch`: one row per request, each fed its last sampled token."""
    return StepPlan(batch, batch.sampling_inputs(vocab_size, device), fed_last_token=True)


def new_matcher(request: RequestSpec, grammars: Grammars) -> llguidance.LLMatcher | None:
    """The request's matcher, past the tokens a resumed request generated before (the last
    `draws_done` prompt tokens, as for the penalties), from the grammar pinned for it."""
    if not request.grammar_id:
        return None
    draws_done = min(request.sampling.draws_done, len(request.input_ids))
    generated = request.input_ids[len(request.input_ids) - draws_done :]
    return grammars.matcher(request.grammar_id, generated)


def _input_ids(requests: Sequence[RequestSpec], device: torch.device) -> torch.Tensor:
    """The tokens each request computes now, end to end."""
    return torch.tensor(
        [t for r in requests for t in r.input_ids[r.cached_tokens : r.until]], dtype=torch.long
    ).to(device)
