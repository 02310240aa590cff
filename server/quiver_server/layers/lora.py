"""Adapter slots as the projection layers see them: `LoraPart` (one projection's stacked slot
buffers) and `LoraTarget`, the mixin through which `Linear` and `GroupedLinear` add every row's
adapter delta into their output. The layers' own matmuls know nothing of adapters.

A part's buffers hold `experts` rows per slot: one for a plain projection, one per expert for a
sparse MLP's stacked expert projections (row slot * experts + expert). Rows of x name the buffer
row they read through the batch's `LoraBatchMeta`, so one kernel call serves both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quiver_server.kernels import LoraBatchMeta, LoraProjection


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


class LoraTarget:
    """Mixin of a layer whose output columns take adapter deltas: `AdapterSlots` sets
    `lora_parts` (one per checkpoint part, in column order); `add_lora` adds the parts in use."""

    lora_parts: list[LoraPart]
    _lora_backend: str
    _lora: LoraProjection | None
    _lora_key: tuple[object, tuple[bool, ...]] | None

    def _init_lora(self, backend: str) -> None:
        """backend: the shard's LoRA backend (`KernelOps.lora_backend`), bound into each
        `LoraProjection` built here."""
        self._lora_backend = backend
        self.lora_parts = []  # empty: adapters disabled
        # The kernel call for the parts in use, rebuilt when that set changes (slot activations).
        self._lora = None
        self._lora_key = None

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, meta: LoraBatchMeta) -> None:
        # AdapterSlots assigns a new list when it attaches buffers; `in_use` flips on activation.
        key = (self.lora_parts, tuple(p.in_use for p in self.lora_parts))
        if self._lora_key is None or key[0] is not self._lora_key[0] or key[1] != self._lora_key[1]:
            parts = [(p.lora_a, p.lora_b, p.scaling, p.columns, p.ranks) for p in self.lora_parts if p.in_use]
            self._lora = LoraProjection(parts, self._lora_backend) if parts else None
            self._lora_key = key
        if self._lora is not None:
            self._lora.add(y, x, meta)


def part_columns(parts: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Each part's [start, end) output columns, the parts side by side in their order."""
    columns: dict[str, tuple[int, int]] = {}
    start = 0
    for name, width in parts.items():
        columns[name] = (start, start + width)
        start += width
    return columns
