"""The raw logprobs reported beside the chosen tokens: the chosen token's, its top alternatives'
(top_logprobs), and a prompt's (prompt_logprobs).

"Raw" is vLLM's default: log_softmax of the model's logits, before penalties, bias, temperature
or any filter. The top alternatives are ranked by (logprob descending, id ascending). Only the
rows that ask for alternatives pay for the top-k; the row's log-normaliser (logsumexp) is
computed once and shared by the chosen token and its alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quiver_server.engine.batch_types import PromptPosition, TokenLogprob

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs, and ours on prompt_logprobs
# Prompt positions whose logprobs are computed at once: bounds the float32 copy and the top-k's
# [rows, V] temporaries (an int64 running count among them) for a long prompt.
PROMPT_CHUNK_ROWS = 256


@dataclass
class TopTokens:
    """The top alternatives of some rows of a batch."""

    rows: list[int]  # batch rows, ascending
    ids: torch.Tensor  # [len(rows), K] long, most likely first
    logprobs: torch.Tensor  # [len(rows), K] float32


def top_tokens(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] -> (ids, values) [n, min(k, V)]: each row's k largest entries ordered by
    (value descending, id ascending), NaN ranking last.

    One torch.topk of k + 1 entries settles it unless the k-th and the (k+1)-th are equal (which
    of the tied ids make the cut is then topk's choice) or a NaN is among them: those rare
    batches take the exact path, whose full passes over [n, V] cost ten times more."""
    k = min(k, logits.shape[-1])
    values, ids = torch.topk(logits, min(k + 1, logits.shape[-1]), dim=-1)
    boundary_tie = values.shape[-1] > k and bool((values[:, k - 1] == values[:, k]).any())
    if boundary_tie or bool(torch.isnan(values).any()):
        return _top_tokens_exact(logits, k)
    values, ids = values[:, :k], ids[:, :k]
    # Ties inside the k kept: id order first, then a stable sort by value keeps it among equals.
    by_id = ids.argsort(dim=-1)
    ids, values = ids.gather(1, by_id), values.gather(1, by_id)
    order = values.argsort(dim=-1, descending=True, stable=True)
    return ids.gather(1, order), values.gather(1, order)


def _top_tokens_exact(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_tokens for any input: the cut at the k-th value goes to the lowest ids (a running
    count of the ties), and a stable sort of the k kept entries, taken in id order, fixes the
    order."""
    logits = logits.masked_fill(torch.isnan(logits), float("-inf"))
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    above = logits > kth
    tied = logits == kth
    tied_needed = k - above.sum(dim=-1, keepdim=True)
    keep = above | (tied & (tied.cumsum(dim=-1) <= tied_needed))
    ids = keep.nonzero()[:, 1].view(logits.shape[0], k)  # ascending ids within each row
    values = logits.gather(1, ids)
    order = values.argsort(dim=-1, descending=True, stable=True)
    return ids.gather(1, order), values.gather(1, order)


def raw_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top_rows: Sequence[int], max_top: int
) -> tuple[torch.Tensor, TopTokens | None]:
    """logits [B, V] float32, tokens [B] long -> (log_softmax(logits) at tokens [B], the `max_top`
    best alternatives of the rows `top_rows`, or None when none asks)."""
    normaliser = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(1, tokens[:, None])[:, 0] - normaliser
    return chosen, top_alternatives(logits, normaliser, top_rows, max_top)


def top_alternatives(
    logits: torch.Tensor, normaliser: torch.Tensor, top_rows: Sequence[int], max_top: int
) -> TopTokens | None:
    """The `max_top` best alternatives of the rows `top_rows` (None when none asks), as raw
    logprobs: logits minus each row's log-normaliser [B]."""
    if not top_rows or max_top == 0:
        return None
    if len(top_rows) == logits.shape[0]:  # every row (rows are distinct): no gathered copy
        ids, values = top_tokens(logits, max_top)
        return TopTokens(list(top_rows), ids, values - normaliser[:, None])
    index = torch.tensor(list(top_rows), dtype=torch.long).to(logits.device, non_blocking=True)
    ids, values = top_tokens(logits[index], max_top)
    return TopTokens(list(top_rows), ids, values - normaliser[index, None])


def _token_lists(ids: list[list[int]], values: list[list[float]], k: int) -> list[list[TokenLogprob]]:
    return [[TokenLogprob(i, v) for i, v in zip(row_ids[:k], row_values[:k], strict=True)]
            for row_ids, row_values in zip(ids, values, strict=True)]


def top_lists(top: TopTokens | None, ks: Sequence[int]) -> list[list[TokenLogprob]]:
    """Per batch row, its own `ks[row]` alternatives (a prefix of the batch's `max_top`: the
    ranking is a total order, so a row's top-k is the first k of anyone's top-K)."""
    out: list[list[TokenLogprob]] = [[] for _ in ks]
    if top is None:
        return out
    lists = _token_lists(top.ids.tolist(), top.logprobs.tolist(), max(ks))
    for row, alternatives in zip(top.rows, lists, strict=True):
        out[row] = alternatives[: ks[row]]
    return out


@dataclass(frozen=True)
class PromptSpan:
    """One request's prompt rows among a prefill's logits: the rows start..start+len(targets)-1
    predict targets = the prompt tokens after the first."""

    start: int
    targets: list[int]
    top: int  # alternatives per position


def prompt_logprobs(logits: torch.Tensor, spans: Sequence[PromptSpan]) -> list[list[PromptPosition]]:
    """logits [rows, V] of a prefill; one list of PromptPosition per span. The spans' rows are
    read PROMPT_CHUNK_ROWS at a time, so a long prompt's float32 copies stay bounded."""
    if not any(s.targets for s in spans):  # one-token prompts have no positions to report
        return [[] for _ in spans]
    device = logits.device
    rows = torch.cat([torch.arange(s.start, s.start + len(s.targets)) for s in spans]).to(device)
    targets = torch.tensor([t for s in spans for t in s.targets], dtype=torch.long).to(device)
    max_top = max(s.top for s in spans)
    chosen: list[float] = []
    ranks: list[int] = []
    alternatives: list[list[TokenLogprob]] = []
    for first in range(0, len(rows), PROMPT_CHUNK_ROWS):
        chunk = slice(first, first + PROMPT_CHUNK_ROWS)
        picked = logits[rows[chunk]].float()
        count = picked.shape[0]
        logprobs, top = raw_logprobs(picked, targets[chunk], range(count), max_top)
        chosen += logprobs.tolist()
        target_logits = picked.gather(1, targets[chunk][:, None])
        ranks += ((picked > target_logits).sum(dim=-1) + 1).tolist()
        if top is None:
            alternatives += [[] for _ in range(count)]
        else:
            alternatives += _token_lists(top.ids.tolist(), top.logprobs.tolist(), max_top)
    out, offset = [], 0
    for span in spans:
        end = offset + len(span.targets)
        out.append([PromptPosition(lp, top[: span.top], rank)
                    for lp, top, rank in zip(chosen[offset:end], alternatives[offset:end], ranks[offset:end],
                                             strict=True)])
        offset = end
    return out


def prompt_spans(
    prompts: Sequence[Sequence[int]], asked: Sequence[int | None], rows_per_sequence: Sequence[int]
) -> dict[int, PromptSpan]:
    """Batch row -> its PromptSpan, for the prefill requests that asked for prompt logprobs
    (`asked[row]` alternatives; None: not asked); rows_per_sequence as the prefill laid out."""
    spans, start = {}, 0
    for row, (prompt, top, count) in enumerate(zip(prompts, asked, rows_per_sequence, strict=True)):
        if top is not None:
            spans[row] = PromptSpan(start, [int(t) for t in prompt[1:]], top)
        start += count
    return spans
