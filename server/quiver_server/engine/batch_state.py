"""State of the running requests between steps: what the engine keeps per cached batch.

A step enters a batch twice: `sampling_inputs` hands its plan every tensor the sampler reads
(built once per batch composition), and `record` stores what the step sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import llguidance
import torch

from quiver_server.engine.batch_types import RequestSpec, SamplingParams
from quiver_server.engine.forward_batch import build_lora_meta
from quiver_server.engine.penalties import generated_counts, uses_counts
from quiver_server.engine.sampling import SamplingBatch
from quiver_server.kernels.lora_meta import LoraBatchMeta, RankClasses


@dataclass
class RequestState:
    id: int
    blocks: list[int]  # block table from the router
    length: int  # tokens whose K/V are in the cache (= position of `last_token`)
    last_token: int  # sampled, not yet fed through the model
    sampling: SamplingParams
    draws_done: int  # uniforms its seeded stream gave so far (sampling rows draw one per token)
    # [vocab] bool: prompt and output tokens, kept only when repetition_penalty != 1. Inside a
    # batch it is a row view of the batch's seen matrix, so one scatter updates every request.
    seen: torch.Tensor | None = None
    # [vocab] float32: how often each token was generated, kept only with a frequency or presence
    # penalty; a row view of the batch's counts matrix, like `seen`.
    counts: torch.Tensor | None = None
    adapter_id: str = ""  # "" = base model
    lora_slot: int = -1  # device slot of the adapter, fixed for the request's life
    # The request's own grammar state (None: free); it has consumed every token sampled so far.
    matcher: llguidance.LLMatcher | None = None


def new_request_state(
    request: RequestSpec, lora_slot: int, matcher: llguidance.LLMatcher | None, vocab_size: int,
    device: torch.device,
) -> RequestState:
    """The state a request keeps from its prefill on: it has not sampled yet, and its penalty rows
    hold its prompt (the last `draws_done` prompt tokens count as generated, for a resumed one)."""
    seen = None
    if request.sampling.repetition_penalty != 1.0:
        seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        seen[torch.tensor(request.input_ids, device=device)] = True
    counts = None
    if uses_counts(request.sampling):
        counts = generated_counts(request.input_ids, request.sampling.draws_done, vocab_size, device)
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
        matcher=matcher,
    )


@dataclass(frozen=True)
class SamplingInputs:
    """What the sampler reads for a batch's rows, all on the device but the matchers."""

    params: SamplingBatch
    draws: torch.Tensor  # [B] int64: each row's draws so far
    seen: torch.Tensor | None  # [B, vocab] bool with a repetition penalty, else None
    counts: torch.Tensor | None  # [B, vocab] float32 with a frequency/presence penalty, else None
    matchers: list[llguidance.LLMatcher | None]  # each row's grammar matcher (None: free)

    @property
    def has_grammar(self) -> bool:
        return any(m is not None for m in self.matchers)


def padded_block_table(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """[len(tables), longest] long; short tables are padded with block 0 (never read: masked)."""
    width = max(len(blocks) for blocks in tables)
    rows = [blocks + [0] * (width - len(blocks)) for blocks in tables]
    return torch.tensor(rows, dtype=torch.long).to(device)


class CachedBatch:
    """A fixed list of requests; merging or filtering builds a new one. Device tensors that only
    depend on the composition (block table, sampling parameters, seen and counts matrices) are built lazily
    once and reused by every decode step."""

    def __init__(self, requests: list[RequestState]) -> None:
        self.requests = requests
        self._block_table: torch.Tensor | None = None
        self._sampling: SamplingBatch | None = None
        self._seen: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._lora: LoraBatchMeta | None = None
        self._lora_built = False
        # The tokens the last step sampled, still on the device: the next decode step's input
        # without a host-to-device copy (None until a step ran on exactly these requests).
        self._last_tokens: torch.Tensor | None = None
        self._draws: torch.Tensor | None = None  # [B] int64 on the device: each row's draws_done

    @classmethod
    def joined(cls, batches: list[CachedBatch]) -> CachedBatch:
        """The requests of `batches` in order, their last tokens kept on the device."""
        joined = cls([r for batch in batches for r in batch.requests])
        parts = [batch._last_tokens for batch in batches]
        if all(part is not None for part in parts):
            joined._last_tokens = torch.cat(parts)  # type: ignore[arg-type]
        return joined

    def subset(self, keep: set[int]) -> CachedBatch:
        """The requests whose ids are in `keep`, in order, their last tokens kept on the device."""
        rows = [row for row, r in enumerate(self.requests) if r.id in keep]
        subset = CachedBatch([self.requests[row] for row in rows])
        if self._last_tokens is not None:
            index = torch.tensor(rows, dtype=torch.long).to(self._last_tokens.device, non_blocking=True)
            subset._last_tokens = self._last_tokens.index_select(0, index)
        return subset

    def draws(self, device: torch.device) -> torch.Tensor:
        """[B] int64: each request's draws so far, the position in its stream of the next one."""
        if self._draws is None:
            self._draws = torch.tensor([r.draws_done for r in self.requests], dtype=torch.long).to(device)
        return self._draws

    def input_ids(self, device: torch.device) -> torch.Tensor:
        """[B] long: each request's last token, the input of the next decode step."""
        if self._last_tokens is not None:
            return self._last_tokens.to(device, non_blocking=True)  # a no-op where sampled
        return torch.tensor([r.last_token for r in self.requests], dtype=torch.long).to(device)

    @property
    def request_ids(self) -> list[int]:
        return [r.id for r in self.requests]

    def block_table(self, device: torch.device) -> torch.Tensor:
        """[B, max_blocks] long (see `padded_block_table`)."""
        if self._block_table is None:
            self._block_table = padded_block_table([r.blocks for r in self.requests], device)
        return self._block_table

    def lora_meta(self, ranks: RankClasses, device: torch.device) -> LoraBatchMeta | None:
        """Decode's LoRA slot mapping (one token per request), None if no request has an adapter."""
        if not self._lora_built:
            slots = [r.lora_slot for r in self.requests]
            self._lora = build_lora_meta(slots, [1] * len(slots), ranks, device)
            self._lora_built = True
        return self._lora

    @property
    def matchers(self) -> list[llguidance.LLMatcher | None]:
        """Each row's grammar matcher (None for free rows)."""
        return [r.matcher for r in self.requests]

    def sampling_inputs(self, vocab_size: int, device: torch.device) -> SamplingInputs:
        """Everything the sampler needs for these rows, in one call (cached tensors after the first)."""
        return SamplingInputs(self.sampling(device), self.draws(device), self.seen_matrix(vocab_size, device),
                              self.counts_matrix(vocab_size, device), self.matchers)

    def sampling(self, device: torch.device) -> SamplingBatch:
        if self._sampling is None:
            self._sampling = SamplingBatch.from_params([r.sampling for r in self.requests], device)
        return self._sampling

    def seen_matrix(self, vocab_size: int, device: torch.device) -> torch.Tensor | None:
        """[B, vocab] bool when some request has a repetition penalty, else None."""
        if not self.sampling(device).uses_penalty:
            return None
        if self._seen is None:
            self._seen = self._stack_rows("seen", torch.zeros(vocab_size, dtype=torch.bool, device=device))
        return self._seen

    def counts_matrix(self, vocab_size: int, device: torch.device) -> torch.Tensor | None:
        """[B, vocab] float32 when some request has a frequency or presence penalty, else None."""
        if not self.sampling(device).uses_counts:
            return None
        if self._counts is None:
            self._counts = self._stack_rows("counts", torch.zeros(vocab_size, dtype=torch.float32, device=device))
        return self._counts

    def _stack_rows(self, name: str, empty: torch.Tensor) -> torch.Tensor:
        """One matrix of the requests' per-token rows `name` (`empty` for requests without one);
        the requests that have one keep a view of their row, so the batch's updates reach them
        and survive a later filter or merge."""
        rows: list[torch.Tensor | None] = [getattr(r, name) for r in self.requests]
        matrix = torch.stack([empty if row is None else row for row in rows])
        for index, (request, row) in enumerate(zip(self.requests, rows, strict=True)):
            if row is not None:
                setattr(request, name, matrix[index])
        return matrix

    def record(self, tokens: torch.Tensor, token_list: list[int], fed_last_token: bool) -> None:
        """Stores the tokens just sampled (their K/V get cached by the next step); after a decode
        step the previous last token (`fed_last_token`) is now in the cache."""
        for request, token in zip(self.requests, token_list, strict=True):
            request.length += fed_last_token
            request.last_token = token
            request.draws_done += request.sampling.temperature > 0
        self._last_tokens = tokens.to(torch.long)
        if self._draws is not None and self._sampling is not None:
            self._draws += self._sampling.draws_per_step
        if self._seen is not None or self._counts is not None:
            rows = torch.arange(len(self.requests), device=tokens.device)
            if self._seen is not None:
                self._seen[rows, tokens] = True
            if self._counts is not None:
                self._counts[rows, tokens] += 1.0
