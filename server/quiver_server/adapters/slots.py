"""Device tier: a fixed table of adapter slots, preallocated at warmup.

The slots split into rank classes (`--lora-rank-classes`; by default one class, every slot at
max_lora_rank): a class's slots hold adapters up to its rank, in buffers of its own, so a slot
meant for small adapters does not carry the padding of the largest rank. Per class, for every
layer and LoRA-capable projection there is one stacked pair of buffers,
A [slots * E, rank, in] and B [slots * E, out, rank] (laid out for the LoRA backend by
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
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn

from quiver_server.adapters.loader import LoadedAdapter
from quiver_server.adapters.spec import BaseModelSpec
from quiver_server.kernels.lora_meta import RankClasses
from quiver_server.kernels.ops import KernelOps
from quiver_server.layers.lora import LoraPart, LoraWrapper, with_lora
from quiver_server.models.family import ModelFamily
from quiver_server.parallel import RowSpans, take_rows


_Share = tuple[RowSpans | None, slice | None]  # (B rows, A columns) a rank holds of a projection


class _RankClass:
    """The buffers of one rank class: a stacked A/B pair per projection for `num_slots` slots of
    rank up to `rank`, and one scaling vector per E."""

    def __init__(self, model: ModelFamily, spec: BaseModelSpec, shares: dict[tuple[int, str], _Share],
                 num_slots: int, rank: int, dtype: torch.dtype, ops: KernelOps) -> None:
        self.rank = rank
        device = ops.device
        # One scaling vector per rows-per-slot count E: [slots * E], each adapter's value E times.
        self.scalings = {
            experts: torch.zeros(num_slots * experts, dtype=torch.float32, device=device)
            for experts in {1, *(p.experts for p in spec.projections.values())}
        }
        self.parts: dict[tuple[int, str], LoraPart] = {}
        for layer, name in sorted(spec.present):
            projection = spec.projections[name]
            linear = spec.layout.linear(model, layer, name)
            assert linear is not None
            start, end = linear.part_columns[name]
            _, held_inputs = shares[(layer, name)]
            in_features = projection.in_features if held_inputs is None else held_inputs.stop - held_inputs.start
            rows = num_slots * projection.experts
            self.parts[(layer, name)] = LoraPart(
                columns=slice(start, end),
                lora_a=torch.zeros(rows, rank, in_features, dtype=dtype, device=device),
                lora_b=ops.lora_b_buffer(rows, end - start, rank, dtype),
                scaling=self.scalings[projection.experts],
                ranks=torch.zeros(rows, dtype=torch.int32, device=device),
                experts=projection.experts,
            )

    @property
    def nbytes(self) -> int:
        buffers = sum(p.lora_a.nbytes + p.lora_b.nbytes for p in self.parts.values())
        return buffers + sum(scaling.nbytes for scaling in self.scalings.values())


class AdapterSlots:
    def __init__(
        self,
        model: ModelFamily,
        spec: BaseModelSpec,
        slot_ranks: Sequence[int],
        dtype: torch.dtype,
        ops: KernelOps,
    ) -> None:
        """slot_ranks: each slot's largest rank, in slot order; slots of one rank form a class.
        ops: the shard's, which lay out the lora_B buffers for its LoRA backend."""
        if not slot_ranks or min(slot_ranks) < 1:
            raise ValueError(f"adapter slots need at least one slot and ranks >= 1, got {list(slot_ranks)}")
        self.ranks = RankClasses.of(slot_ranks)
        self.num_slots = self.ranks.num_slots
        self.max_rank = self.ranks.max_rank
        # Split over ranks (models/tensor_split.py), a part holds the share of A or B its
        # projection's split gives it: B's rows where the projection is split by output, A's
        # columns where by input; the other factor whole.
        self._shares: dict[tuple[int, str], _Share] = {}
        for layer, name in sorted(spec.present):
            linear = spec.layout.linear(model, layer, name)
            split_rows = getattr(linear, "split_rows", None)
            self._shares[(layer, name)] = (split_rows[name] if split_rows is not None else None,
                                           getattr(linear, "split_inputs", None))
        self.classes = [_RankClass(model, spec, self._shares, self.ranks.count(c), rank, dtype, ops)
                        for c, rank in enumerate(self.ranks.ranks)]
        self._attach(model, spec)
        self._adapters: list[str | None] = [None] * self.num_slots  # adapter id held by each slot
        self._targets: list[frozenset[tuple[int, str]]] = [frozenset()] * self.num_slots
        # Rank rows written per slot and projection: every row past it is zero.
        self._written: list[dict[tuple[int, str], int]] = [{} for _ in range(self.num_slots)]
        self._lock = threading.Lock()
        device = ops.device
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _attach(self, model: ModelFamily, spec: BaseModelSpec) -> None:
        """Wraps every layer that computes a projection in a LoRA wrapper reading its parts' slots."""
        wrapped = set()
        for layer, name in sorted(spec.present):
            path = spec.layout.layer_path(layer, name)
            base = spec.layout.linear(model, layer, name)
            if path in wrapped or base is None:
                continue  # fused parts: the same layer again
            parts = [[rank_class.parts[(layer, part)] for part in base.parts] for rank_class in self.classes]
            _replace(model, path, with_lora(base, parts))
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
        return sum(rank_class.nbytes for rank_class in self.classes)

    @property
    def projections(self) -> list[tuple[int, str]]:
        """Every (layer, projection) the slots hold weights for."""
        return list(self.classes[0].parts)

    def rank_of(self, slot: int) -> int:
        """The largest rank `slot` holds (its class's)."""
        return self.ranks.ranks[self.ranks.of_slot[slot]]

    def buffers(self, where: tuple[int, str], slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of `slot`'s rows in projection `where`: A [E, R, in], B [E, out, R], ranks [E]
        (R: its class's rank)."""
        return self._part(where, slot).of_slot(self.ranks.local[slot])

    def _part(self, where: tuple[int, str], slot: int) -> LoraPart:
        return self.classes[self.ranks.of_slot[slot]].parts[where]

    def _set_scaling(self, slot: int, value: float) -> None:
        for experts, scaling in self.classes[self.ranks.of_slot[slot]].scalings.items():
            scaling.unflatten(0, (-1, experts))[self.ranks.local[slot]] = value

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
        if adapter.rank > self.rank_of(slot):
            raise ValueError(f"adapter rank {adapter.rank} exceeds the rank slot {slot} holds ({self.rank_of(slot)}; "
                             f"max_lora_rank {self.max_rank})")
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
                held_rows, held_inputs = self._shares[where]
                if held_inputs is not None:
                    a = a[..., held_inputs]
                if held_rows is not None:
                    b = take_rows(b, held_rows, dim=-2)
                lora_a, lora_b, _ = self.buffers(where, slot)  # [E, R, in], [E, out, R]
                rank = a.shape[-2]
                lora_a[:, :rank].copy_(a.reshape(-1, rank, a.shape[-1]), non_blocking=True)
                lora_b[:, :, :rank].copy_(b.reshape(-1, b.shape[-2], rank), non_blocking=True)
                # The stale rows past `rank` go to zero, and the part's rank is set to it.
                self._zero_ranks(where, slot, rank, written.get(where, 0))
                written[where] = rank
            self._set_scaling(slot, adapter.scaling)
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
            self._set_scaling(slot, 0.0)
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
        lora_a, lora_b, ranks = self.buffers(where, slot)
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
        for rank_class in self.classes:
            for part in rank_class.parts.values():
                part.in_use = True
        try:
            yield
        finally:
            self._update_in_use()

    def _update_in_use(self) -> None:
        """A projection no slot of a class targets skips that class's kernel call entirely
        (under `_lock`, or at warmup, when nothing else runs)."""
        for c, rank_class in enumerate(self.classes):
            targeted = frozenset().union(*(targets for slot, targets in enumerate(self._targets)
                                           if self.ranks.of_slot[slot] == c))
            for where, part in rank_class.parts.items():
                part.in_use = where in targeted



def _replace(model: ModelFamily, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, module)
