"""Choosing the next token for every row of a batch, each row with its own parameters.

Per row, in vLLM's order: repetition penalty, frequency/presence penalties and logit_bias on
the raw logits (`penalties.py`); then greedy (argmax) when temperature == 0, else temperature,
top_k, top_p, min_p and a draw from the row's own seeded stream (`draw_streams`). All rows are
processed as one tensor, the draws included, and a request's tokens do not depend on what else
is in the batch. The reported logprobs are of the raw logits
(`logprobs.py`). A batch where nobody asks for any of that takes the shard's
`KernelOps.greedy_logprob` (one fused pass per row with the C++ kernels).

A grammar's mask (`grammar/masks.py`) comes first of all: the tokens it forbids are -inf before
the penalties, bias and warpers, so a greedy row takes the argmax of what its grammar allows.
A greedy batch with grammar rows still takes the fused pass for every row, then redoes only the
constrained rows: the argmax of their masked logits, and its raw logprob from the normaliser the
fused pass implies (logit[argmax] - logprob[argmax]), so no row pays a second log-softmax.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from quiver_server.engine.batch_types import SamplingParams
from quiver_server.engine.draw_streams import as_int64, uniforms
from quiver_server.kernels.ops import KernelOps
from quiver_server.kernels.torch_ops import greedy_logprob
from quiver_server.engine.logprobs import MAX_LOGPROBS, TopTokens, raw_logprobs, top_alternatives
from quiver_server.engine.penalties import LogitBias, apply_frequency_presence, apply_repetition_penalty, uses_counts

if TYPE_CHECKING:
    from quiver_server.grammar.masks import StepMask

MAX_PENALTY = 2.0  # OpenAI's bound on |presence_penalty| and |frequency_penalty|


def validate(params: SamplingParams, vocab_size: int, prompt_logprobs: int | None = None) -> None:
    if not params.temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {params.top_k}")
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")
    if not params.repetition_penalty > 0.0:
        raise ValueError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
    for name, value in (("presence_penalty", params.presence_penalty),
                        ("frequency_penalty", params.frequency_penalty)):
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    for token, bias in params.logit_bias.items():
        if not 0 <= token < vocab_size:
            raise ValueError(f"logit_bias token id {token} is out of range for vocab size {vocab_size}")
        if not math.isfinite(bias):
            raise ValueError(f"logit_bias of token {token} must be finite, got {bias}")
    if not 0 <= params.top_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {params.top_logprobs}")
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {prompt_logprobs}")


@dataclass
class SamplingBatch:
    """The rows' parameters as device tensors, built once per batch composition."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] long, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    min_p: torch.Tensor  # [B] float32, 0 = off
    repetition_penalty: torch.Tensor  # [B, 1] float32, 1 = off
    presence_penalty: torch.Tensor  # [B, 1] float32, 0 = off
    frequency_penalty: torch.Tensor  # [B, 1] float32, 0 = off
    logit_bias: LogitBias | None  # None: no row has a bias
    seeds: torch.Tensor  # [B] int64: each row's draw stream
    draws_per_step: torch.Tensor  # [B] int64: 1 on rows that draw (temperature > 0), else 0
    sampling_rows: list[int]  # rows with temperature > 0
    top_rows: list[int]  # rows that report top logprobs
    top_logprobs: list[int]  # per row, how many
    max_top_k: int
    uses_top_p: bool
    uses_min_p: bool
    uses_penalty: bool  # some row has a repetition penalty (needs the seen matrix)
    uses_counts: bool  # some row has a frequency or presence penalty (needs the counts matrix)

    @property
    def greedy_on_raw_logits(self) -> bool:
        """Every row takes the argmax of the raw logits: no sampling, penalty or bias."""
        return not (self.uses_penalty or self.uses_counts or self.logit_bias is not None or self.sampling_rows)

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits and its logprob is all the batch needs."""
        return self.greedy_on_raw_logits and not self.top_rows

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device) -> SamplingBatch:
        def column(values: list[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            temperature=column([p.temperature for p in params], torch.float32),
            top_k=column([p.top_k for p in params], torch.long),
            top_p=column([p.top_p for p in params], torch.float32),
            min_p=column([p.min_p for p in params], torch.float32),
            repetition_penalty=column([p.repetition_penalty for p in params], torch.float32)[:, None],
            presence_penalty=column([p.presence_penalty for p in params], torch.float32)[:, None],
            frequency_penalty=column([p.frequency_penalty for p in params], torch.float32)[:, None],
            logit_bias=LogitBias.from_params(params, device),
            seeds=column([as_int64(p.seed) for p in params], torch.long),
            draws_per_step=column([int(p.temperature > 0) for p in params], torch.long),
            sampling_rows=[i for i, p in enumerate(params) if p.temperature > 0],
            top_rows=[i for i, p in enumerate(params) if p.top_logprobs > 0],
            top_logprobs=[p.top_logprobs for p in params],
            max_top_k=max((p.top_k for p in params if p.temperature > 0), default=0),
            uses_top_p=any(p.top_p < 1.0 for p in params if p.temperature > 0),
            uses_min_p=any(p.min_p > 0.0 for p in params if p.temperature > 0),
            uses_penalty=any(p.repetition_penalty != 1.0 for p in params),
            uses_counts=any(uses_counts(p) for p in params),
        )


class Sampled(NamedTuple):
    tokens: torch.Tensor  # [B] long
    logprobs: torch.Tensor  # [B] float32, raw log_softmax at the tokens
    top: TopTokens | None = None  # the rows that asked for top logprobs


def process_scores(
    logits: torch.Tensor, params: SamplingBatch, seen: torch.Tensor | None = None, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """The penalties and logit_bias on float32 logits [B, V] (never modified in place)."""
    scores = logits
    if params.uses_penalty:
        assert seen is not None, "rows with a repetition penalty need their seen tokens"
        scores = apply_repetition_penalty(scores, seen, params.repetition_penalty)
    if params.uses_counts:
        assert counts is not None, "rows with frequency/presence penalties need their generated counts"
        scores = apply_frequency_presence(scores, counts, params.frequency_penalty, params.presence_penalty)
    if params.logit_bias is not None:
        scores = params.logit_bias.apply(scores)
    return scores


def sample(
    logits: torch.Tensor,
    params: SamplingBatch,
    draws: torch.Tensor | None = None,
    seen: torch.Tensor | None = None,
    ops: KernelOps | None = None,
    counts: torch.Tensor | None = None,
    grammar: StepMask | None = None,
) -> Sampled:
    """logits [B, V]; draws [B] int64: each row's draws so far (None: none), the caller adds
    `params.draws_per_step` after the step; seen [B, V] bool (tokens of prompt + output so far, needed when a row has a
    repetition penalty); counts [B, V] float32 (generated tokens, needed when a row has a
    frequency or presence penalty); ops: the shard's (None: plain torch throughout); grammar:
    the allowed tokens of the rows with a grammar (None: no row has one)."""
    logits = logits.float()
    if params.greedy_on_raw_logits:
        # The fused argmax + logprob pass; only the rows asking for alternatives add a top-k.
        tokens, logprobs = ops.greedy_logprob(logits) if ops is not None else greedy_logprob(logits)
        if grammar is not None:
            tokens, logprobs = _constrained_greedy(logits, tokens, logprobs, grammar)
        if params.plain_greedy:
            return Sampled(tokens, logprobs)
        return Sampled(tokens, logprobs, top_of_rows(logits, tokens, logprobs, params))
    scores = process_scores(logits if grammar is None else grammar.apply(logits), params, seen, counts)
    tokens = scores.argmax(dim=-1)
    if params.sampling_rows:
        sampled = _draw(warp_scores(scores, params), params, draws)
        tokens = torch.where(params.temperature > 0, sampled, tokens)
    logprobs, top = raw_logprobs(logits, tokens, params.top_rows, max(params.top_logprobs))
    return Sampled(tokens, logprobs, top)


def _constrained_greedy(
    logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, grammar: StepMask
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused pass's tokens and logprobs with the constrained rows' replaced by the argmax of
    what their grammar allows and its raw logprob (against the row's own log-normaliser)."""
    index = grammar.index()
    raw = logits.index_select(0, index)
    chosen = grammar.mask_rows(raw).argmax(dim=-1)
    normaliser = raw.gather(1, tokens[index, None])[:, 0] - logprobs[index]
    chosen_logprobs = raw.gather(1, chosen[:, None])[:, 0] - normaliser
    return tokens.index_copy(0, index, chosen), logprobs.index_copy(0, index, chosen_logprobs)


def top_of_rows(logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, params: SamplingBatch):
    """The alternatives of the rows that ask, given the chosen tokens' raw logprobs: each row's
    log-normaliser is logit[token] - logprob[token], so no second logsumexp pass is needed."""
    normaliser = logits.gather(1, tokens[:, None])[:, 0] - logprobs
    return top_alternatives(logits, normaliser, params.top_rows, max(params.top_logprobs))


def warp_scores(scores: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """Temperature, top_k, top_p, min_p as transformers' warpers define them; filtered tokens get
    -inf. Greedy rows pass through with temperature 1 (their result is discarded)."""
    temperature = torch.where(params.temperature > 0, params.temperature, torch.ones_like(params.temperature))
    scores = scores / temperature[:, None]
    if params.max_top_k > 0:
        # Keep tokens whose score is >= the row's k-th largest (ties kept, like transformers).
        k = params.top_k.clamp(max=scores.shape[-1])
        top = torch.topk(scores, min(params.max_top_k, scores.shape[-1]), dim=-1).values
        kth = top.gather(1, (k - 1).clamp(min=0)[:, None])
        scores = scores.masked_fill((scores < kth) & (k > 0)[:, None], float("-inf"))
    if params.uses_top_p:
        # Drop a token when the mass of the tokens ranked strictly above it already reaches top_p
        # (transformers' "ascending cumsum <= 1 - top_p", read from the other end).
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (mass_above >= params.top_p[:, None]) & (params.top_p < 1.0)[:, None]
        scores = scores.scatter(1, order, sorted_scores.masked_fill(drop, float("-inf")))
    if params.uses_min_p:
        probs = scores.softmax(dim=-1)
        threshold = params.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        scores = scores.masked_fill(probs < threshold, float("-inf"))
    return scores


def _draw(scores: torch.Tensor, params: SamplingBatch, draws: torch.Tensor | None) -> torch.Tensor:
    """Inverse-CDF sampling from softmax(scores), each row's next uniform from its stream (the
    rows that do not sample draw too; their tokens are the argmax all the same)."""
    if draws is None:
        draws = torch.zeros_like(params.seeds)
    u = uniforms(params.seeds, draws).to(torch.float32)
    cdf = scores.softmax(dim=-1).cumsum(dim=-1)
    # The first token whose cdf reaches a strictly positive target: never a zero-probability one.
    target = (u[:, None] * cdf[:, -1:]).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.searchsorted(cdf, target).clamp(max=scores.shape[-1] - 1)[:, 0]
