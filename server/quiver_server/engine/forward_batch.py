"""Metadata of one forward pass over a flattened batch of tokens (no padding between sequences).

Prefill: the new prompt tokens of B requests are concatenated into T = sum(len) tokens, sequence
after sequence (lengths in `seq_lens_host`). A sequence may start after a prefix whose K/V is
already cached (`context_lens_host`: a prefix-cache hit, or earlier chunks of its prompt): its
positions then start at that context length and attention also reads the prefix from the cache
through `block_tables`. Decode: one token per sequence (T = B).
Every token writes its K/V at `slot_mapping[t]` = block * block_size + offset, where block is
taken from its request's block table at position // block_size.

LoRA: `lora` says which device slot each token's adapter sits in (None when no request of the
step uses an adapter, so the base-only path does no LoRA work at all). In a prefill the last
layer computes o_proj and the MLP only for the rows `logits_indices` selects; `lora_rows` is
the same mapping for those rows, switched in by `at_logits_rows`.

Mixed step: a prefill's new tokens and a decode step's (one per running sequence) in one pass,
prompt tokens first: everything but attention treats it as a prefill whose decode sequences
have one new token after their cached context; attention runs the two parts through their own
kernels (`mixed`: the prefill's batch for the first rows, the decode's for the rest).

Logits rows: one per sequence (its last token), except in a prefill for the sequences that ask
for prompt logprobs, which get one per prompt token, and for the chunks of a prompt that is not
complete yet, which get none; `sample_rows` then says which logits row is each sampled
sequence's last. A prefill may have no logits row at all (when every sequence is a chunk).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from quiver_server.kernels.lora_meta import LoraBatchMeta, RankClasses


@dataclass
class ForwardBatch:
    is_prefill: bool
    positions: torch.Tensor  # [T] long, position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] long, flat KV-cache slot each token writes
    # Rows whose logits are wanted: the last token of each sequence, or in a prefill every token
    # of the sequences that asked for all of them (see `logits_rows_per_sequence`).
    logits_indices: torch.Tensor  # [R] long
    # Tokens per sequence (host ints): the new prompt tokens in prefill, the lengths including
    # the new token in decode. Attention uses them to split work without a device sync.
    seq_lens_host: list[int] = field(default_factory=list)
    # Prefill: tokens per sequence already in the cache before this pass (host ints, empty when
    # every sequence starts at 0); its new tokens sit at positions context .. context + len - 1.
    context_lens_host: list[int] = field(default_factory=list)
    # Decode: block tables cut to the longest sequence. Prefill: the full block tables (the torch
    # path reads a cached context through them, the Triton kernel every key).
    block_tables: torch.Tensor | None = None  # [B, nb] long
    # Decode only: lengths including the new token.
    seq_lens: torch.Tensor | None = None  # [B] long
    kv_span: int = 0  # decode: nb * block_size, the number of gathered key slots per sequence
    lora: LoraBatchMeta | None = None
    lora_rows: LoraBatchMeta | None = None  # prefill: `lora` for the rows of logits_indices
    # [B] long: each sequence's last-token row among the logits; None when that is every row.
    sample_rows: torch.Tensor | None = None
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    # Per-pass data a kernel builds on its first layer and every later layer reuses (the Triton
    # prefill's tile table), keyed by what it depends on besides the batch.
    kernel_plans: dict[object, object] = field(default_factory=dict)
    mixed: MixedSplit | None = None  # a mixed step's two attention views

    def context_of(self, sequence: int) -> int:
        """Tokens of `sequence` cached before this pass (0 in decode: see `seq_lens`)."""
        return self.context_lens_host[sequence] if self.context_lens_host else 0

    def sequence_ends(self) -> torch.Tensor:
        """[T] long: each token's sequence length at the end of this pass (LongRoPE's switch)."""
        if not self.is_prefill:
            return self.positions + 1
        lens = torch.tensor(self.seq_lens_host, dtype=torch.long)
        ends = lens + torch.tensor(self.context_lens_host, dtype=torch.long) if self.context_lens_host else lens
        return torch.repeat_interleave(ends, lens).to(self.positions.device, non_blocking=True)

    def at_logits_rows(self) -> ForwardBatch:
        """This batch as seen by layers that run on the `logits_indices` rows only."""
        if self.lora is None:
            return self
        return dataclasses.replace(self, lora=self.lora_rows, lora_rows=None)

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, 1, nb * block_size] bool, True where the new token may attend; computed once
        per forward and shared by every layer with the same window."""
        mask = self._decode_masks.get(sliding_window)
        if mask is None:
            assert self.block_tables is not None and self.seq_lens is not None
            kv_pos = torch.arange(self.kv_span, device=self.seq_lens.device)[None, :]
            mask = kv_pos < self.seq_lens[:, None]
            if sliding_window is not None:
                # The new token sits at seq_len - 1 and sees keys with kv > q - window.
                mask &= kv_pos > (self.seq_lens[:, None] - 1 - sliding_window)
            mask = mask[:, None, None, :]
            self._decode_masks[sliding_window] = mask
        return mask


@dataclass(frozen=True)
class MixedSplit:
    """A mixed step's attention views: its first `prefill_tokens` rows are the prompt tokens of
    `head` (a prefill's batch), the others one token per sequence of `tail` (a decode's)."""

    prefill_tokens: int
    head: ForwardBatch
    tail: ForwardBatch


def _slots(
    block_table: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    return block_table[seq_index, positions // block_size] * block_size + positions % block_size


def build_lora_meta(
    slots: list[int], tokens_per_request: list[int], ranks: int | RankClasses, device: torch.device
) -> LoraBatchMeta | None:
    """The LoRA slot mapping of one pass (see LoraBatchMeta.build), or None when every request
    is on the base model (slot -1). ranks: the slots' rank classes (an int: one class of that
    rank); with several, the meta carries one per class."""
    if max(slots, default=-1) < 0:
        return None
    if isinstance(ranks, int) or len(ranks.ranks) == 1:
        return LoraBatchMeta.build(slots, tokens_per_request, ranks if isinstance(ranks, int) else ranks.max_rank,
                                   device)
    whole = LoraBatchMeta.build(slots, tokens_per_request, ranks.max_rank, device)
    classes = tuple(LoraBatchMeta.build(rows, tokens_per_request, rank, device)
                    for rows, rank in zip(ranks.split(slots), ranks.ranks, strict=True))
    return dataclasses.replace(whole, classes=classes)


def logits_rows_per_sequence(
    prompt_lens: list[int], all_logits: list[bool] | None, sampled: list[bool] | None = None
) -> list[int]:
    """How many logits rows each sequence of a prefill gets: none where `sampled` says it is a
    chunk of an unfinished prompt, its new-token count where `all_logits` says so (prompt
    logprobs), else one."""
    rows = [1] * len(prompt_lens) if all_logits is None else [
        n if every else 1 for n, every in zip(prompt_lens, all_logits, strict=True)
    ]
    if sampled is None:
        return rows
    return [r if s else 0 for r, s in zip(rows, sampled, strict=True)]


def build_prefill(
    prompt_lens: list[int],
    block_table: torch.Tensor,
    block_size: int,
    device: torch.device,
    lora_slots: list[int] | None = None,
    lora_ranks: int | RankClasses = 0,
    all_logits: list[bool] | None = None,
    context_lens: list[int] | None = None,
    sampled: list[bool] | None = None,
) -> ForwardBatch:
    """prompt_lens: new tokens per sequence (computed in this pass, >= 1 each);
    block_table: [B, max_blocks] long (rows padded with any valid id), on any device;
    lora_slots: each request's adapter slot (-1 = base model), None if no request has one;
    lora_ranks: the slots' rank classes (see build_lora_meta);
    all_logits: per request, whether it wants the logits of every prompt token (None: none);
    context_lens: per request, tokens already cached before its new ones (None: all 0);
    sampled: per request, whether its last new token gets a logits row (None: all do; False
    for a chunk of a prompt that later passes finish)."""
    lens = torch.tensor(prompt_lens, dtype=torch.long)
    num_seqs = len(prompt_lens)
    seq_index = torch.repeat_interleave(torch.arange(num_seqs), lens)
    starts = torch.cumsum(lens, 0) - lens
    offsets = torch.arange(int(lens.sum())) - starts[seq_index]
    has_context = context_lens is not None and any(context_lens)
    positions = offsets + torch.tensor(context_lens, dtype=torch.long)[seq_index] if has_context else offsets
    slots = _slots(block_table.cpu(), seq_index, positions, block_size)
    rows_per_seq = logits_rows_per_sequence(prompt_lens, all_logits, sampled)
    logits_indices, sample_rows = starts + lens - 1, None
    if any(n != 1 for n in rows_per_seq):
        rows = torch.tensor(rows_per_seq, dtype=torch.long)
        # A token's logits are wanted when its sequence wants every row, or it is a sampled
        # sequence's last; rows == lens says the former (a one-token prompt: both the same).
        last = offsets == lens[seq_index] - 1
        wanted = (rows == lens)[seq_index] | (last & (rows > 0)[seq_index])
        logits_indices = wanted.nonzero()[:, 0]
        if all_logits is not None and any(all_logits):
            sample_rows = (rows.cumsum(0) - 1)[rows > 0].to(device, non_blocking=True)
    lora = lora_rows = None
    if lora_slots is not None:
        lora = build_lora_meta(lora_slots, prompt_lens, lora_ranks, device)
        if lora is not None:
            lora_rows = build_lora_meta(lora_slots, rows_per_seq, lora_ranks, device)
    return ForwardBatch(
        is_prefill=True,
        positions=positions.to(device, non_blocking=True),
        slot_mapping=slots.to(device, non_blocking=True),
        logits_indices=logits_indices.to(device, non_blocking=True),
        seq_lens_host=list(prompt_lens),
        context_lens_host=list(context_lens) if has_context and context_lens is not None else [],
        block_tables=block_table.to(device, non_blocking=True),
        lora=lora,
        lora_rows=lora_rows,
        sample_rows=sample_rows,
    )


def build_decode(
    lengths: list[int],
    block_table: torch.Tensor,
    block_size: int,
    device: torch.device,
    lora: LoraBatchMeta | None = None,
) -> ForwardBatch:
    """lengths: tokens already cached per sequence (= position of the new token);
    block_table: [B, max_blocks] long on `device`; lora: one token per sequence (a cached batch
    builds it once, see CachedBatch.lora_meta)."""
    positions = torch.tensor(lengths, dtype=torch.long).to(device, non_blocking=True)
    num_seqs = len(lengths)
    seq_index = torch.arange(num_seqs, device=device)
    num_blocks = (max(lengths) + block_size) // block_size  # blocks covering max(lengths) + 1 tokens
    return ForwardBatch(
        is_prefill=False,
        positions=positions,
        slot_mapping=_slots(block_table, seq_index, positions, block_size),
        logits_indices=seq_index,
        block_tables=block_table[:, :num_blocks],
        seq_lens=positions + 1,
        seq_lens_host=[n + 1 for n in lengths],
        kv_span=num_blocks * block_size,
        lora=lora,
    )


def build_mixed(
    head: ForwardBatch,
    head_rows: list[int],
    head_slots: list[int],
    tail: ForwardBatch,
    tail_slots: list[int],
    lora_ranks: int | RankClasses,
    device: torch.device,
) -> ForwardBatch:
    """One pass over a prefill's tokens (`head`, from build_prefill; its logits rows per
    sequence `head_rows`) and a decode step's (`tail`, from build_decode), prompt tokens first.
    head_slots / tail_slots: each sequence's adapter slot (-1 = base). The logits rows are the
    head's, then one per decode sequence."""
    prompt_tokens, decoding = int(head.positions.shape[0]), len(tail.seq_lens_host)
    contexts = head.context_lens_host or [0] * len(head.seq_lens_host)
    slots = head_slots + tail_slots
    lora = lora_rows = None
    if max(slots, default=-1) >= 0:
        lora = build_lora_meta(slots, head.seq_lens_host + [1] * decoding, lora_ranks, device)
        lora_rows = build_lora_meta(slots, head_rows + [1] * decoding, lora_ranks, device)
    decode_rows = torch.arange(prompt_tokens, prompt_tokens + decoding, device=device)
    return ForwardBatch(
        is_prefill=True,
        positions=torch.cat((head.positions, tail.positions)),
        slot_mapping=torch.cat((head.slot_mapping, tail.slot_mapping)),
        logits_indices=torch.cat((head.logits_indices, decode_rows)),
        seq_lens_host=head.seq_lens_host + [1] * decoding,
        # A decode sequence's one new token sits after its cached tokens: seq_lens - 1 of them.
        context_lens_host=contexts + [n - 1 for n in tail.seq_lens_host],
        lora=lora,
        lora_rows=lora_rows,
        mixed=MixedSplit(prompt_tokens, head, tail),
    )
