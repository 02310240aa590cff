"""Device tier: a fixed table of adapter slots, preallocated at warmup.

For every layer and LoRA-capable projection there is one stacked pair of buffers,
A [slots * E, max_rank, in] and B [slots * E, out, max_rank] (laid out for the LoRA backend by
`KernelOps.lora_b_buffer`) in the serving dtype, E being 1 but for a sparse MLP's expert
projections (one A/B pair per expert: row slot * E + expert), plus one scaling vector per E,
[slots * E] float32, shared by all projections with that E. Slot s of every buffer belongs to
one adapter: its rank-r weights fill rows/columns [:r], the rest stays zero (zero rank
components add exact zeros), and the projections it does not target stay zero for that slot.
Each layer computing a projection is wrapped once in a LoRA wrapper holding its parts' buffers
(`layers.lora`), so the forward pass reads them without any lookup; with adapters disabled the
plain layers are put back.

Activating copies an adapter's host weights into its slot. The shard does it on a thread of its
own, beside the steps (on CUDA on a stream of its own, from pinned memory; on CPU on that one
thread, `service.py`), for a slot that no running request uses and that the router sends no
request for until the copy is done: a forward pass never reads the rows being written. A lock
orders activations and clears between them, so the set of projections in use always matches
what the slots hold. Only the rows an adapter writes and the stale rows of the previous
occupant are touched: rows at or past the rank written last are always zero.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn

from quiver_server.adapters.loader import LoadedAdapter
from quiver_server.adapters.spec import BaseModelSpec
from quiver_server.kernels.ops import KernelOps
from quiver_server.layers.lora import LoraPart, LoraWrapper, with_lora
from quiver_server.models.family import ModelFamily
from quiver_server.parallel import RowSpans, take_rows


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
        # One scaling vector per rows-per-slot count E: [slots * E], each adapter's value E times.
        self._scalings = {
            experts: torch.zeros(num_slots * experts, dtype=torch.float32, device=device)
            for experts in {1, *(p.experts for p in spec.projections.values())}
        }
        self.scaling = self._scalings[1]
        self.parts: dict[tuple[int, str], LoraPart] = {}
        self._shares: dict[tuple[int, str], tuple[RowSpans | None, slice | None]] = {}  # (B rows, A columns)
        for layer, name in sorted(spec.present):
            projection = spec.projections[name]
            linear = spec.layout.linear(model, layer, name)
            assert linear is not None
            start, end = linear.part_columns[name]
            rows = num_slots * projection.experts
            # Split over ranks (models/tensor_split.py), a part holds the share of A or B its
            # projection's split gives it: B's rows where the projection is split by output, A's
            # columns where by input; the other factor whole.
            split_rows = getattr(linear, "split_rows", None)
            held_rows = split_rows[name] if split_rows is not None else None
            held_inputs = getattr(linear, "split_inputs", None)
            self._shares[(layer, name)] = (held_rows, held_inputs)
            in_features = projection.in_features if held_inputs is None else held_inputs.stop - held_inputs.start
            self.parts[(layer, name)] = LoraPart(
                columns=slice(start, end),
                lora_a=torch.zeros(rows, max_rank, in_features, dtype=dtype, device=device),
                lora_b=ops.lora_b_buffer(rows, end - start, max_rank, dtype),
                scaling=self._scalings[projection.experts],
                ranks=torch.zeros(rows, dtype=torch.int32, device=device),
                experts=projection.experts,
            )
        self._attach(model, spec)
        self._adapters: list[str | None] = [None] * num_slots  # adapter id held by each slot
        self._targets: list[frozenset[tuple[int, str]]] = [frozenset()] * num_slots
        # Rank rows written per slot and projection: every row past it is zero.
        self._written: list[dict[tuple[int, str], int]] = [{} for _ in range(num_slots)]
        self._lock = threading.Lock()
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _attach(self, model: ModelFamily, spec: BaseModelSpec) -> None:
        """Wraps every layer that computes a projection in a LoRA wrapper reading its parts' slots."""
        wrapped = set()
        for layer, name in sorted(spec.present):
            path = spec.layout.layer_path(layer, name)
            base = spec.layout.linear(model, layer, name)
            if path in wrapped or base is None:
                continue  # fused parts: the same layer again
            _replace(model, path, with_lora(base, [self.parts[(layer, part)] for part in base.parts]))
            wrapped.add(path)

    @staticmethod
    def detach(model: ModelFamily, spec: BaseModelSpec) -> None:
        """Puts the plain layers back in place of any LoRA wrappers (adapters disabled)."""
        del spec  # every wrapper goes, whichever projections it served
        wrappers = [(path, module) for path, module in model.named_modules() if isinstance(module, LoraWrapper)]
        for path, wrapper in wrappers:
            _replace(model, path, wrapper.base)

    @property
    def nbytes(self) -> int:
        buffers = sum(p.lora_a.nbytes + p.lora_b.nbytes for p in self.parts.values())
        return buffers + sum(scaling.nbytes for scaling in self._scalings.values())

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
        with self._lock, self._on_copy_stream():
            # Empty until the copy is done: an unload of the previous occupant, or a copy that
            # fails half-way, leaves no adapter named on half-written rows.
            previous = self._set_adapter(slot, None)
            self._targets[slot] = frozenset()
            self._update_in_use()
            written = self._written[slot]
            # Zero what was written before that this adapter does not overwrite.
            for where in written.keys() - adapter.weights.keys():
                self._zero_ranks(where, slot, 0, written.pop(where))
            for where, (a, b) in adapter.weights.items():
                part = self.parts[where]
                held_rows, held_inputs = self._shares[where]
                if held_inputs is not None:
                    a = a[..., held_inputs]
                if held_rows is not None:
                    b = take_rows(b, held_rows, dim=-2)
                lora_a, lora_b, _ = part.of_slot(slot)  # [E, R, in], [E, out, R]
                rank = a.shape[-2]
                lora_a[:, :rank].copy_(a.reshape(-1, rank, a.shape[-1]), non_blocking=True)
                lora_b[:, :, :rank].copy_(b.reshape(-1, b.shape[-2], rank), non_blocking=True)
                # The stale rows past `rank` go to zero, and the part's rank is set to it.
                self._zero_ranks(where, slot, rank, written.get(where, 0))
                written[where] = rank
            for experts, scaling in self._scalings.items():
                scaling.unflatten(0, (-1, experts))[slot] = adapter.scaling
            if self._copy_stream is not None:
                self._copy_stream.synchronize()  # done before any step may read the slot
            self._set_adapter(slot, adapter.adapter_id)
            self._targets[slot] = frozenset(adapter.weights)
            self._update_in_use()
        return previous

    def clear(self, slot: int, expected: str | None = None) -> str | None:
        """Empties `slot` (its buffers back to zero); returns the adapter it held. With
        `expected`, only if the slot still holds that adapter once the lock is taken (a copy of
        another adapter into it may have begun meanwhile): else nothing changes."""
        self.check_slot(slot)
        with self._lock, self._on_copy_stream():
            if expected is not None and self._adapters[slot] != expected:
                return None
            written = self._written[slot]
            for where in list(written):
                self._zero_ranks(where, slot, 0, written.pop(where))
            for experts, scaling in self._scalings.items():
                scaling.unflatten(0, (-1, experts))[slot] = 0.0
            if self._copy_stream is not None:
                self._copy_stream.synchronize()
            previous = self._set_adapter(slot, None)
            self._targets[slot] = frozenset()
            self._update_in_use()
        return previous

    def _on_copy_stream(self) -> AbstractContextManager[object]:
        return torch.cuda.stream(self._copy_stream) if self._copy_stream is not None else nullcontext()

    def _zero_ranks(self, where: tuple[int, str], slot: int, start: int, stop: int) -> None:
        """Zeroes rank rows [start, stop) of `slot` in projection `where` (its rank to `start`)."""
        lora_a, lora_b, ranks = self.parts[where].of_slot(slot)
        if stop > start:
            lora_a[:, start:stop].zero_()
            lora_b[:, :, start:stop].zero_()
        ranks.fill_(start)

    def _set_adapter(self, slot: int, adapter_id: str | None) -> str | None:
        previous = self._adapters[slot]
        self._adapters[slot] = adapter_id
        return previous

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
        """A projection no slot targets skips its kernel call entirely (under `_lock`, or at
        warmup, when nothing else runs)."""
        targeted = frozenset().union(*self._targets)
        for where, part in self.parts.items():
            part.in_use = where in targeted



def _replace(model: ModelFamily, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, module)
