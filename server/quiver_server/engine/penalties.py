"""The changes sampling makes to the raw logits before temperature and the filters, in vLLM's
order: transformers' repetition penalty, then OpenAI's frequency/presence penalties, then
logit_bias.

Each is applied only when some row of the batch uses it, and a row that does not use it passes
unchanged (its penalty is the identity value, and bias touches only the listed entries), so a
request's scores do not depend on what else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quiver_server.engine.batch_types import SamplingParams


def apply_repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor: a seen token's logit is divided by the
    penalty if positive and multiplied by it if negative. penalty [B, 1]."""
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalised, scores)


def apply_frequency_presence(
    scores: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor
) -> torch.Tensor:
    """OpenAI's definition: scores[t] - frequency * count[t] - presence * (count[t] > 0), where
    count [B, V] float32 counts the tokens the request generated; frequency, presence [B, 1]."""
    return scores - frequency * counts - presence * (counts > 0)


def uses_counts(params: SamplingParams) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def generated_counts(input_ids: Sequence[int], draws_done: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[V] float32 counts of the generated tokens a prefill starts with: none for a new request,
    the last `draws_done` prompt tokens for one resumed after a preemption."""
    generated = list(input_ids[len(input_ids) - min(draws_done, len(input_ids)) :])
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=vocab_size)
    return counts.to(device=device, dtype=torch.float32)


@dataclass
class LogitBias:
    """Every row's bias as one sparse list of (row, token, value) on the device."""

    rows: torch.Tensor  # [N] long
    ids: torch.Tensor  # [N] long
    values: torch.Tensor  # [N] float32

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device) -> LogitBias | None:
        entries = [(row, token, value) for row, p in enumerate(params) for token, value in p.logit_bias.items()]
        if not entries:
            return None
        rows, ids, values = zip(*entries, strict=True)
        return cls(
            rows=torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True),
            ids=torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True),
            values=torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True),
        )

    def apply(self, scores: torch.Tensor) -> torch.Tensor:
        # Out of place: `scores` may still be the raw logits that the logprobs are read from.
        return scores.index_put((self.rows, self.ids), self.values, accumulate=True)
