"""Choosing the next token for every row of a batch, each row with its own parameters.

Per row, in transformers' order: repetition penalty on the raw logits; then greedy (argmax)
when temperature == 0, else temperature, top_k, top_p, min_p and a draw from the row's own
seeded generator. All rows are processed as one tensor; only the uniform draws loop over rows
(one per sampling row), so a request's tokens do not depend on what else is in the batch.
The reported logprob is log_softmax of the raw logits at the chosen token. An all-greedy batch
takes the shard's `KernelOps.greedy_logprob` (one fused pass per row with the C++ kernels).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quiver_server.batch_types import SamplingParams
from quiver_server.kernels.ops import KernelOps
from quiver_server.kernels.torch_ops import greedy_logprob, logprob_at


def validate(params: SamplingParams) -> None:
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


def new_generator(seed: int, draws_done: int = 0) -> torch.Generator:
    """The request's generator, past the `draws_done` draws a preempted request already made
    (each one as `_draw` makes it, so the state is the same as if it had never stopped)."""
    # Host generators: the draws (and so the tokens) for a seed are the same on CPU and CUDA.
    generator = torch.Generator().manual_seed(seed)
    for _ in range(draws_done):
        torch.rand((), generator=generator, dtype=torch.float64)
    return generator


@dataclass
class SamplingBatch:
    """The rows' parameters as device tensors, built once per batch composition."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] long, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    min_p: torch.Tensor  # [B] float32, 0 = off
    repetition_penalty: torch.Tensor  # [B, 1] float32, 1 = off
    sampling_rows: list[int]  # rows with temperature > 0
    max_top_k: int
    uses_top_p: bool
    uses_min_p: bool
    uses_penalty: bool

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
            sampling_rows=[i for i, p in enumerate(params) if p.temperature > 0],
            max_top_k=max((p.top_k for p in params if p.temperature > 0), default=0),
            uses_top_p=any(p.top_p < 1.0 for p in params if p.temperature > 0),
            uses_min_p=any(p.min_p > 0.0 for p in params if p.temperature > 0),
            uses_penalty=any(p.repetition_penalty != 1.0 for p in params),
        )


def sample(
    logits: torch.Tensor,
    params: SamplingBatch,
    generators: Sequence[torch.Generator],
    seen: torch.Tensor | None = None,
    ops: KernelOps | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V]; seen [B, V] bool (tokens of prompt + output so far, needed when a row has a
    repetition penalty); ops: the shard's (None: plain torch throughout). Returns (tokens [B]
    long, logprobs [B] float32)."""
    logits = logits.float()
    if not params.uses_penalty and not params.sampling_rows:
        return ops.greedy_logprob(logits) if ops is not None else greedy_logprob(logits)
    scores = logits
    if params.uses_penalty:
        assert seen is not None, "rows with a repetition penalty need their seen tokens"
        scores = apply_repetition_penalty(scores, seen, params.repetition_penalty)
    tokens = scores.argmax(dim=-1)
    if params.sampling_rows:
        sampled = _draw(warp_scores(scores, params), params, generators)
        tokens = torch.where(params.temperature > 0, sampled, tokens)
    return tokens, logprob_at(logits, tokens)


def apply_repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor: a seen token's logit is divided by the
    penalty if positive and multiplied by it if negative. penalty [B, 1]."""
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalised, scores)


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


def _draw(scores: torch.Tensor, params: SamplingBatch, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Inverse-CDF sampling from softmax(scores), one uniform per sampling row from its generator."""
    uniforms = [0.5] * scores.shape[0]
    for row in params.sampling_rows:
        uniforms[row] = float(torch.rand((), generator=generators[row], dtype=torch.float64))
    u = torch.tensor(uniforms, dtype=torch.float32).to(scores.device, non_blocking=True)
    cdf = scores.softmax(dim=-1).cumsum(dim=-1)
    # The first token whose cdf reaches a strictly positive target: never a zero-probability one.
    target = (u[:, None] * cdf[:, -1:]).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.searchsorted(cdf, target).clamp(max=scores.shape[-1] - 1)[:, 0]
