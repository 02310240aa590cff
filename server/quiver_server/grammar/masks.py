"""Each step's token mask from the batch's matchers, and advancing them by the sampled tokens.

llguidance fills one bit per token (32 per int32 word, lowest bit first) for every row with a
matcher, in parallel on its own threads; rows without one stay all ones. The words go to the
logits' device and are unpacked there into a [B, V] bool mask with plain torch ops. A matcher in
an error state, or stopped because the output is complete, allows only its EOS ids: llguidance's
mask says so itself, and the test suite holds it to that.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import llguidance
import torch

BITS = 32


class StepMask:
    """The allowed tokens of one step: [B, V] bool on the logits' device; `ns` accumulates the
    time spent on it (filling, unpacking, applying)."""

    def __init__(self, allowed: torch.Tensor, ns: int) -> None:
        self.allowed = allowed
        self.ns = ns

    def apply(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores` with the disallowed tokens at -inf (out of place: the raw logits stay raw)."""
        start = time.perf_counter_ns()
        masked = scores.masked_fill(~self.allowed, float("-inf"))
        self.ns += time.perf_counter_ns() - start
        return masked


class GrammarMasks:
    def __init__(self, vocab_size: int, num_threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + BITS - 1) // BITS
        # None: llguidance's default (80% of the CPUs, at most 32).
        self.executor = llguidance.LLExecutor(num_threads)
        self._shifts: dict[torch.device, torch.Tensor] = {}

    def step_mask(self, matchers: Sequence[llguidance.LLMatcher | None], device: torch.device) -> StepMask | None:
        """The mask of a batch whose row i has `matchers[i]` (None: a free row); None when no
        row has a matcher."""
        rows = [(matcher, row) for row, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return None
        start = time.perf_counter_ns()
        batch = len(matchers)
        words = torch.full((batch, self.words), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.executor.unsafe_compute_mask_ptr(rows, words.data_ptr(), self.words * 4, batch)
        allowed = self._unpack(words.to(device, non_blocking=True))
        return StepMask(allowed, time.perf_counter_ns() - start)

    def advance(self, matchers: Sequence[llguidance.LLMatcher | None], tokens: Sequence[int]) -> int:
        """Each matcher consumes its row's token; returns the ns it took. A token a matcher refuses
        (which the mask prevents) leaves it in its error state: only EOS from then on."""
        pairs = [(matcher, token) for matcher, token in zip(matchers, tokens, strict=True) if matcher is not None]
        if not pairs:
            return 0
        start = time.perf_counter_ns()
        self.executor.consume_token_par(pairs)
        return time.perf_counter_ns() - start

    def _unpack(self, words: torch.Tensor) -> torch.Tensor:
        shifts = self._shifts.get(words.device)
        if shifts is None:
            shifts = self._shifts[words.device] = torch.arange(BITS, dtype=torch.int32, device=words.device)
        bits = (words[:, :, None] >> shifts) & 1  # [B, W, 32]; >> of -1 keeps every bit set
        return bits.view(words.shape[0], -1)[:, : self.vocab_size].bool()
