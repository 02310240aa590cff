"""Each step's token mask from the batch's matchers, and advancing them by the sampled tokens.

llguidance fills one bit per token (32 per int32 word, lowest bit first) for every row with a
matcher. The fill starts before the forward pass, on a thread of its own (llguidance drops the
GIL and fans the rows out on its pool), so on a step with free cores it costs the step nothing;
the step then waits for it, moves the words to the logits' device and unpacks them there into
an additive [R, V] float32 bias of the R constrained rows only: 0 where a token is allowed,
-inf where it is not. (Adding the bias is exact and an order of magnitude faster on CPU than
`masked_fill` with a bool mask; the unpack makes it with integer ops alone, as the bit pattern
of -inf or of 0.) A matcher in an error state, or stopped
because the output is complete, allows only its EOS ids: llguidance's mask says so itself, and
the test suite holds it to that.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

BITS = 32
NEG_INF_BITS = -8388608  # 0xFF800000: float32 -inf as an int32


class StepMask:
    """The allowed tokens of one step's constrained rows: `rows` (batch row indices, ascending),
    `bias` [len(rows), V] float32 on the logits' device (0: allowed, -inf: not). `ns`
    accumulates the time the step spent on the mask (waiting for the fill, unpacking, applying,
    advancing)."""

    def __init__(self, rows: list[int], bias: torch.Tensor, ns: int) -> None:
        self.rows = rows
        self.bias = bias
        self.ns = ns
        self._index: torch.Tensor | None = None

    def index(self) -> torch.Tensor:
        """`rows` as a long tensor on the mask's device."""
        if self._index is None:
            self._index = torch.tensor(self.rows, dtype=torch.long).to(self.bias.device, non_blocking=True)
        return self._index

    def mask_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The constrained rows' scores ([R, V], in `rows` order) with their disallowed tokens at
        -inf (out of place)."""
        start = time.perf_counter_ns()
        masked = rows + self.bias
        self.ns += time.perf_counter_ns() - start
        return masked

    def apply(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores` [B, V] with every constrained row's disallowed tokens at -inf (out of place:
        the raw logits stay raw); free rows are unchanged."""
        masked_rows = self.mask_rows(scores.index_select(0, self.index()))
        start = time.perf_counter_ns()
        masked = scores.index_copy(0, self.index(), masked_rows)
        self.ns += time.perf_counter_ns() - start
        return masked


class PendingMask:
    """A fill under way; `wait` turns it into the step's mask."""

    def __init__(
        self, masks: GrammarMasks, rows: list[int], words: torch.Tensor, fill: Future[None],
        advancing: Future[list[bool]] | None,
    ) -> None:
        self._masks = masks
        self._rows = rows
        self._words = words
        self._fill = fill
        self._advancing = advancing  # queued before the fill, so done before it

    def wait(self, device: torch.device) -> StepMask:
        start = time.perf_counter_ns()
        self._fill.result()
        if self._advancing is not None:
            self._advancing.result()
        bias = self._masks.unpack(self._words.to(device, non_blocking=True))
        return StepMask(self._rows, bias, time.perf_counter_ns() - start)


class GrammarMasks:
    def __init__(self, vocab_size: int, num_threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + BITS - 1) // BITS
        # None: llguidance's default (80% of the CPUs, at most 32).
        self.executor = llguidance.LLExecutor(num_threads)
        # One worker: a step's background advance and the next step's fill run in that order.
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._shifts: dict[torch.device, torch.Tensor] = {}
        self._advancing: Future[list[bool]] | None = None  # the last step's advance, if not yet waited for

    def start(self, matchers: Sequence[llguidance.LLMatcher | None], pinned: bool = False) -> PendingMask | None:
        """Starts filling the mask of a batch whose row i has `matchers[i]` (None: a free row);
        None when no row has a matcher. The matchers must not change until the result is waited
        for. pinned: page-locked host words (for a copy to CUDA)."""
        constrained = [(row, matcher) for row, matcher in enumerate(matchers) if matcher is not None]
        if not constrained:
            return None
        rows = [row for row, _ in constrained]
        words = torch.empty((len(rows), self.words), dtype=torch.int32, pin_memory=pinned)
        targets = [(matcher, i) for i, (_, matcher) in enumerate(constrained)]
        fill = self._filler.submit(
            self.executor.unsafe_compute_mask_ptr, targets, words.data_ptr(), self.words * 4, len(rows)
        )
        advancing, self._advancing = self._advancing, None
        return PendingMask(self, rows, words, fill, advancing)

    def advance_in_background(self, matchers: Sequence[llguidance.LLMatcher | None], tokens: Sequence[int]) -> None:
        """Each matcher consumes its row's token, on the fill's thread: it runs while the step's
        results travel to the router and the next step is prepared, and the next `start` queues
        its fill behind it. Its error, if any, is raised by the next `wait`. A token a matcher
        refuses (which the mask prevents) leaves it in its error state: only EOS from then on."""
        pairs = [(matcher, token) for matcher, token in zip(matchers, tokens, strict=True) if matcher is not None]
        if pairs:
            self._advancing = self._filler.submit(self.executor.consume_token_par, pairs)

    def unpack(self, words: torch.Tensor) -> torch.Tensor:
        """[R, W] int32 words -> [R, V] float32 bias: 0 where the token's bit is set, else -inf."""
        shifts = self._shifts.get(words.device)
        if shifts is None:
            shifts = self._shifts[words.device] = torch.arange(BITS, dtype=torch.int32, device=words.device)
        bits = (words[:, :, None] >> shifts) & 1  # [R, W, 32]
        # bit 1 -> 0 & x = 0 (0.0); bit 0 -> -1 & x = x (-inf)
        patterns = (bits - 1) & NEG_INF_BITS
        return patterns.view(words.shape[0], -1)[:, : self.vocab_size].view(torch.float32)
