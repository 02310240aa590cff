"""Per-batch LoRA index metadata: which device slot each token's adapter sits in.

Built once per forward pass (host lists -> a few small int32 device tensors) and shared by every
LoRA-carrying linear layer of that pass. Two views of the same mapping:

- `token_slots[t]`: the slot of token t's adapter, -1 for the base model. The decode kernel
  (BGMV: one row per request) reads this.
- segments: maximal runs of consecutive tokens with one slot, `seg_indptr` (CSR style, covering
  [0, T) without gaps, base-model runs included with slot -1) and `seg_slots`. The prefill kernel
  (SGMV) tiles each segment into row blocks that share one adapter, so it can use matrix units.
  Adjacent requests on the same adapter merge into one segment: bigger tiles, same result.

`segments` is what the grouped kernels (`lora_triton.FusedLora`) tile: `RowSegments`, runs of
rows sharing one slot, optionally through a permutation of the rows. A decode batch built on the
host (`build`) carries `adapter_groups`: its adapter rows sorted by slot, so that rows of one
adapter in any batch order form one segment and the kernel reads that adapter's weights once per
step. Prefill uses the batch-order segments (a request's tokens are contiguous already), and
`for_rows` (built on the device, nothing known on the host) one segment per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowSegments:
    """Segment g holds positions indptr[g] .. indptr[g + 1] - 1 of `rows` (int32, a list of row
    indices; None: positions are the rows themselves), all on slot slots[g] (-1: no delta).
    max_len: the longest segment (host int, bounds the kernel's grid); 0 = unknown."""

    indptr: torch.Tensor  # int32 [num_segments + 1]
    slots: torch.Tensor  # int32 [num_segments]
    rows: torch.Tensor | None
    max_len: int

    @property
    def num_segments(self) -> int:
        return int(self.slots.shape[0])


@dataclass(frozen=True)
class RankClasses:
    """How the adapter slots split into rank classes (`adapters.slots`): class c's slots hold
    ranks up to ranks[c] (ascending) in buffers of their own; slot s, as the router numbers
    it, is row local[s] of class of_slot[s]. With one class, local[s] == s."""

    ranks: tuple[int, ...]
    of_slot: tuple[int, ...]
    local: tuple[int, ...]

    @classmethod
    def of(cls, slot_ranks: Sequence[int]) -> RankClasses:
        """From each slot's largest rank, in slot order."""
        ranks = tuple(sorted(set(slot_ranks)))
        if not ranks or ranks[0] < 1:
            raise ValueError(f"adapter slots need a positive rank each, got {list(slot_ranks)}")
        index = {rank: c for c, rank in enumerate(ranks)}
        counts = [0] * len(ranks)
        of_slot, local = [], []
        for rank in slot_ranks:
            c = index[rank]
            of_slot.append(c)
            local.append(counts[c])
            counts[c] += 1
        return cls(ranks, tuple(of_slot), tuple(local))

    @classmethod
    def uniform(cls, num_slots: int, rank: int) -> RankClasses:
        return cls.of([rank] * num_slots)

    @property
    def num_slots(self) -> int:
        return len(self.of_slot)

    @property
    def max_rank(self) -> int:
        return self.ranks[-1]

    def count(self, c: int) -> int:
        """Slots of class c."""
        return self.of_slot.count(c)

    def split(self, slots: Sequence[int]) -> list[list[int]]:
        """Per class, each entry of `slots` as that class's row (-1: the base model or another
        class)."""
        return [[self.local[s] if s >= 0 and self.of_slot[s] == c else -1 for s in slots]
                for c in range(len(self.ranks))]


@dataclass(frozen=True)
class LoraBatchMeta:
    token_slots: torch.Tensor  # int32 [T]: slot of each token's adapter, -1 = base model (no delta)
    seg_indptr: torch.Tensor  # int32 [num_segments+1]: consecutive token runs sharing one slot
    seg_slots: torch.Tensor  # int32 [num_segments]
    max_rank: int  # rank dimension of the slot buffers
    is_decode: bool  # one token per request -> BGMV, else SGMV over segments
    has_lora: bool  # False when every token is -1 (skip all LoRA work)
    # Longest segment in tokens (host int, so launching the SGMV grid needs no device sync);
    # 0 = unknown, kernels then assume the whole batch could be one segment.
    max_seg_len: int = 0
    # Decode: the adapter rows sorted by slot (stable), one segment per slot in the batch; base
    # rows are left out. None: the grouped kernels run the batch-order segments.
    adapter_groups: RowSegments | None = None
    # With more than one rank class: the same mapping once per class, in class order, each
    # naming its class's rows (-1 elsewhere); a layer runs its kernels once per class. Empty
    # with one class: this meta is that class's.
    classes: tuple[LoraBatchMeta, ...] = ()

    def per_class(self) -> tuple[LoraBatchMeta, ...]:
        """The meta each rank class's kernels read, in class order."""
        return self.classes or (self,)

    @property
    def num_tokens(self) -> int:
        return int(self.token_slots.shape[0])

    @property
    def num_segments(self) -> int:
        return int(self.seg_slots.shape[0])

    @property
    def segments(self) -> RowSegments:
        """The row segments the grouped kernels tile: `adapter_groups` if any, else the
        batch-order segments."""
        if self.adapter_groups is not None:
            return self.adapter_groups
        return RowSegments(self.seg_indptr, self.seg_slots, None, self.max_seg_len)

    @staticmethod
    def for_class_rows(row_slots: torch.Tensor, class_rows: Sequence[torch.Tensor],
                       ranks: Sequence[int]) -> LoraBatchMeta:
        """`for_rows` over every slot, with one per rank class when there are several:
        class_rows[c] (int32 [N]) names each row's row in class c's buffers, -1 elsewhere."""
        whole = LoraBatchMeta.for_rows(row_slots, max(ranks))
        if len(ranks) < 2:
            return whole
        classes = tuple(LoraBatchMeta.for_rows(rows, rank) for rows, rank in zip(class_rows, ranks, strict=True))
        return dataclasses.replace(whole, classes=classes)

    @staticmethod
    def for_rows(row_slots: torch.Tensor, max_rank: int) -> LoraBatchMeta:
        """Metadata for rows that each name their own buffer row (int32 [N], -1 = none), built
        on the device without a host sync: every row is its own segment, as in decode, so each
        backend runs its per-row kernel (BGMV). Sparse MLPs use it for their (token, expert)
        rows, whose buffer row is slot * experts + expert. Its shapes depend on N only, so a
        CUDA graph captured over static row_slots replays with whatever slots they then hold."""
        rows = row_slots.shape[0]
        return LoraBatchMeta(
            token_slots=row_slots,
            seg_indptr=torch.arange(rows + 1, dtype=torch.int32, device=row_slots.device),
            seg_slots=row_slots,
            max_rank=max_rank,
            is_decode=True,
            has_lora=rows > 0,
            max_seg_len=1,
        )

    @staticmethod
    def build(
        slots_per_request: list[int], tokens_per_request: list[int], max_rank: int, device
    ) -> LoraBatchMeta:
        """slots_per_request[i]: device slot of request i's adapter (-1 = base model);
        tokens_per_request[i]: its tokens in this pass, in the batch's token order
        (prompt length in prefill, 1 in decode)."""
        if len(slots_per_request) != len(tokens_per_request):
            raise ValueError(
                f"{len(slots_per_request)} slots for {len(tokens_per_request)} requests"
            )
        if any(s < -1 for s in slots_per_request):
            raise ValueError(f"adapter slots must be >= -1, got {slots_per_request}")
        if any(n < 0 for n in tokens_per_request):
            raise ValueError(f"token counts must be >= 0, got {tokens_per_request}")
        indptr = [0]
        seg_slots: list[int] = []
        for slot, count in zip(slots_per_request, tokens_per_request, strict=True):
            if count == 0:
                continue
            if seg_slots and seg_slots[-1] == slot:
                indptr[-1] += count
            else:
                seg_slots.append(slot)
                indptr.append(indptr[-1] + count)
        seg_lens = [indptr[i + 1] - indptr[i] for i in range(len(seg_slots))]
        num_tokens = indptr[-1]
        is_decode = all(n == 1 for n in tokens_per_request)
        # Decode: adapter rows sorted by slot, then one group per slot (host ints, no device sort).
        order = sorted((slot, row) for row, slot in enumerate(slots_per_request) if slot >= 0) if is_decode else []
        group_indptr, group_slots = [0], list[int]()
        for slot, _ in order:
            if group_slots and group_slots[-1] == slot:
                group_indptr[-1] += 1
            else:
                group_slots.append(slot)
                group_indptr.append(group_indptr[-1] + 1)
        # One host buffer, one copy to the device, views of it.
        pieces = [
            torch.repeat_interleave(torch.tensor(seg_slots, dtype=torch.int32),
                                    torch.tensor(seg_lens, dtype=torch.long), output_size=num_tokens),
            torch.tensor(indptr, dtype=torch.int32), torch.tensor(seg_slots, dtype=torch.int32),
        ]
        if group_slots:
            pieces += [torch.tensor([row for _, row in order], dtype=torch.int32),
                       torch.tensor(group_indptr, dtype=torch.int32), torch.tensor(group_slots, dtype=torch.int32)]
        packed = torch.cat(pieces).to(device)
        token_slots, seg_indptr_d, seg_slots_d, *groups = packed.split([len(piece) for piece in pieces])
        adapter_groups = None
        if groups:
            rows, g_indptr, g_slots = groups
            longest = max(end - start for start, end in zip(group_indptr, group_indptr[1:], strict=False))
            adapter_groups = RowSegments(g_indptr, g_slots, rows, longest)
        return LoraBatchMeta(
            token_slots=token_slots,
            seg_indptr=seg_indptr_d,
            seg_slots=seg_slots_d,
            max_rank=max_rank,
            is_decode=is_decode,
            has_lora=any(s >= 0 for s in seg_slots),
            max_seg_len=max(seg_lens, default=0),
            adapter_groups=adapter_groups,
        )
