"""Device tier: a fixed table of adapter slots, preallocated at warmup.

For every layer and LoRA-capable projection there is one stacked pair of buffers,
A [slots, max_rank, in] and B [slots, out, max_rank] (laid out for the LoRA backend by
`KernelOps.lora_b_buffer`) in the serving dtype, plus one scaling
vector [slots] float32 shared by all projections. Slot s of every buffer belongs to one adapter:
its rank-r weights fill rows/columns [:r], the rest stays zero (zero rank components add exact
zeros), and the projections it does not target stay zero for that slot. The buffers are attached
to the model's `Linear` layers once, so the forward pass reads them without any lookup.

Activating copies an adapter's host weights into its slot. The router does that between steps
for a slot no running request uses, so the copy never races a forward pass reading the slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from quiver_server.adapters.loader import LoadedAdapter
from quiver_server.adapters.spec import BaseModelSpec
from quiver_server.kernels.ops import KernelOps
from quiver_server.layers.linear import LoraPart
from quiver_server.models.family import ModelFamily


class AdapterSlots:
    def __init__(
        self,
        model: ModelFamily,
        spec: BaseModelSpec,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        ops: KernelOps,
    ) -> None:
        """ops: the shard's, which lay out the lora_B buffers for its LoRA backend."""
        if num_slots < 1 or max_rank < 1:
            raise ValueError(f"adapter slots need num_slots >= 1 and max_rank >= 1, got {num_slots}, {max_rank}")
        self.num_slots = num_slots
        self.max_rank = max_rank
        device = ops.device
        self.scaling = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.parts: dict[tuple[int, str], LoraPart] = {}
        for layer in range(spec.num_layers):
            for name, projection in spec.projections.items():
                linear = spec.layout.linear(model, layer, name)
                start, end = linear.part_columns[name]
                part = LoraPart(
                    columns=slice(start, end),
                    lora_a=torch.zeros(num_slots, max_rank, projection.in_features, dtype=dtype, device=device),
                    lora_b=ops.lora_b_buffer(num_slots, projection.out_features, max_rank, dtype),
                    scaling=self.scaling,
                    ranks=torch.zeros(num_slots, dtype=torch.int32, device=device),
                )
                self.parts[(layer, name)] = part
        self._attach(model, spec)
        self._adapters: list[str | None] = [None] * num_slots  # adapter id held by each slot
        self._targets: list[frozenset[tuple[int, str]]] = [frozenset()] * num_slots

    def _attach(self, model: ModelFamily, spec: BaseModelSpec) -> None:
        for layer in range(spec.num_layers):
            for name in spec.projections:
                linear = spec.layout.linear(model, layer, name)  # fused parts: the same Linear again
                linear.lora_parts = [self.parts[(layer, part)] for part in linear.parts]

    @staticmethod
    def detach(model: ModelFamily, spec: BaseModelSpec) -> None:
        """Removes any slot buffers from the model (adapters disabled)."""
        for layer in range(spec.num_layers):
            for name in spec.projections:
                spec.layout.linear(model, layer, name).lora_parts = []

    @property
    def nbytes(self) -> int:
        return sum(p.lora_a.nbytes + p.lora_b.nbytes for p in self.parts.values()) + self.scaling.nbytes

    def adapter_in(self, slot: int) -> str | None:
        return self._adapters[slot]

    def slot_of(self, adapter_id: str) -> int | None:
        return self._adapters.index(adapter_id) if adapter_id in self._adapters else None

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is out of range: there are {self.num_slots} adapter slots")

    def activate(self, adapter: LoadedAdapter, slot: int) -> str | None:
        """Copies `adapter` into `slot`; returns the id of the adapter it replaced, if any."""
        self.check_slot(slot)
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter rank {adapter.rank} exceeds max_lora_rank {self.max_rank}")
        rank = adapter.rank
        # Zero what the previous occupant wrote that this adapter does not overwrite.
        for where in self._targets[slot] - adapter.weights.keys():
            self._zero(self.parts[where], slot)
        for where, (a, b) in adapter.weights.items():
            part = self.parts[where]
            part.lora_a[slot, :rank].copy_(a, non_blocking=True)
            part.lora_a[slot, rank:].zero_()
            part.lora_b[slot, :, :rank].copy_(b, non_blocking=True)
            part.lora_b[slot, :, rank:].zero_()
            part.ranks[slot] = rank
        self.scaling[slot] = adapter.scaling
        previous = self._adapters[slot]
        self._adapters[slot] = adapter.adapter_id
        self._targets[slot] = frozenset(adapter.weights)
        self._update_in_use()
        return previous

    def clear(self, slot: int) -> str | None:
        """Empties `slot` (its buffers back to zero); returns the adapter it held."""
        self.check_slot(slot)
        for where in self._targets[slot]:
            self._zero(self.parts[where], slot)
        self.scaling[slot] = 0.0
        previous = self._adapters[slot]
        self._adapters[slot] = None
        self._targets[slot] = frozenset()
        self._update_in_use()
        return previous

    @staticmethod
    def _zero(part: LoraPart, slot: int) -> None:
        part.ranks[slot] = 0
        part.lora_a[slot].zero_()
        part.lora_b[slot].zero_()

    @contextmanager
    def every_part_in_use(self) -> Iterator[None]:
        """Runs the LoRA kernels of every projection (warmup: compile them, measure memory)."""
        for part in self.parts.values():
            part.in_use = True
        try:
            yield
        finally:
            self._update_in_use()

    def _update_in_use(self) -> None:
        """A projection no slot targets skips its kernel call entirely."""
        targeted = frozenset().union(*self._targets)
        for where, part in self.parts.items():
            part.in_use = where in targeted

