"""LoRA wrapper layers over the LoRA-free projection layers (`Linear`, `GroupedLinear`).

`adapters.slots.AdapterSlots` puts a wrapper in place of every projection it allocates adapter
slots for, and takes it away again when adapters are disabled: a model served without adapters
runs its plain layers. A wrapper calls its base layer, then adds every row's adapter delta into
the output columns of each of the base's parts (`LoraPart`: that part's stacked slot buffers),
with the shard's LoRA backend bound once into the kernel call (`kernels.lora_projection.LoraProjection`).

A part's buffers hold `experts` rows per slot: one for a plain projection, one per expert for a
sparse MLP's stacked expert projections (row slot * experts + expert). Rows of x name the buffer
row they read through the batch's `LoraBatchMeta`, so one kernel call serves both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quiver_server.engine.forward_batch import ForwardBatch
from quiver_server.kernels.lora_meta import LoraBatchMeta
from quiver_server.kernels.lora_projection import LoraProjection
from quiver_server.layers.grouped_linear import GroupedLinear
from quiver_server.layers.linear import Linear


@dataclass
class LoraPart:
    """One projection's adapter slots: lora_a [S*E, R, in], lora_b [S*E, out, R] in the serving
    dtype, scaling [S*E] float32 (shared by every projection with the same E), and the output
    columns it adds to; E = `experts` (1 outside sparse MLPs). `ranks` [S*E] int32 is each
    row's own rank in this projection (0: the slot's adapter does not target it); the rows past
    it are zero, and the CPU kernel does not read them. `in_use` is False while no slot holds
    weights for this projection, so the kernel is skipped."""

    columns: slice
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: torch.Tensor
    ranks: torch.Tensor
    in_use: bool = False
    experts: int = 1

    def of_slot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of slot `slot`'s rows: A [E, R, in], B [E, out, R], ranks [E]."""
        shape = (-1, self.experts)
        return (self.lora_a.unflatten(0, shape)[slot], self.lora_b.unflatten(0, shape)[slot],
                self.ranks.unflatten(0, shape)[slot])


class LoraWrapper(nn.Module):
    """The adapter half of a wrapped layer: `lora_parts` (per rank class, one per part of the
    base in column order; set by `AdapterSlots`) and, per class, the kernel call for those in
    use."""

    def __init__(self, base: Linear | GroupedLinear, parts: list[list[LoraPart]]) -> None:
        super().__init__()
        self.base = base
        self.lora_parts = parts
        self._backend = base.ops.lora_backend
        # Per class, the kernel call for the parts in use, rebuilt when that set changes (slot
        # activations).
        self._lora: list[LoraProjection | None] = [None] * len(parts)
        self._in_use: list[tuple[bool, ...] | None] = [None] * len(parts)

    def _add(self, y: torch.Tensor, x: torch.Tensor, meta: LoraBatchMeta) -> None:
        metas = meta.per_class()
        if len(metas) != len(self.lora_parts):
            raise ValueError(f"a LoRA batch meta of {len(metas)} rank classes for slots of {len(self.lora_parts)}")
        for c, (class_parts, class_meta) in enumerate(zip(self.lora_parts, metas, strict=True)):
            if not class_meta.has_lora:
                continue
            in_use = tuple(part.in_use for part in class_parts)
            if in_use != self._in_use[c]:
                # From the tuple read once: the slot-copy thread may flip a flag meanwhile.
                parts = [(p.lora_a, p.lora_b, p.scaling, p.columns, p.ranks)
                         for p, used in zip(class_parts, in_use, strict=True) if used]
                self._lora[c] = LoraProjection(parts, self._backend) if parts else None
                self._in_use[c] = in_use
            projection = self._lora[c]
            if projection is not None:
                projection.add(y, x, class_meta)


class LoraLinear(LoraWrapper):
    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        y = self.base(x, batch)
        if batch.lora is not None:
            self._add(y, x, batch.lora)
        return y


class LoraGroupedLinear(LoraWrapper):
    def forward(self, x: torch.Tensor, offsets: torch.Tensor, lora: LoraBatchMeta | None) -> torch.Tensor:
        y = self.base(x, offsets, lora)
        if lora is not None:
            self._add(y, x, lora)
        return y


def with_lora(base: Linear | GroupedLinear, parts: list[list[LoraPart]]) -> LoraWrapper:
    """`base` wrapped so that it adds the deltas of `parts` (per rank class, one per part of
    base, in order)."""
    if isinstance(base, GroupedLinear):
        return LoraGroupedLinear(base, parts)
    return LoraLinear(base, parts)
