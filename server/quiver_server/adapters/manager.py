"""The engine's adapter side: the tiers (disk and host memory in `registry`, device `slots`)
and the rules that keep running requests correct while adapters come and go.

A request keeps the slot it was prefilled with for its whole life, so a slot that running
requests use is never overwritten and their adapter never unloaded; the router knows that
(it activates only free slots and unloads only idle adapters), and these checks make a router
bug a clear ValueError instead of silently wrong tokens.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from quiver_server.adapters.registry import AdapterRegistry
from quiver_server.adapters.slots import AdapterSlots
from quiver_server.adapters.spec import BaseModelSpec
from quiver_server.engine.batch_types import AdapterInfo
from quiver_server.kernels.lora_meta import RankClasses
from quiver_server.kernels.ops import KernelOps
from quiver_server.models.family import ModelFamily

log = logging.getLogger(__name__)

DISABLED = "LoRA adapters are disabled: warmup allocated no adapter slots (max_active_adapters=0)"


class AdapterManager:
    def __init__(
        self,
        model: ModelFamily,
        config: dict[str, Any],
        dtype: torch.dtype,
        ops: KernelOps,
        max_cpu_adapters: int,
        adapter_root: str | None = None,
        s3_buckets: Collection[str] = (),
        adapter_disk_cache_gib: float = 0.0,
    ) -> None:
        self.model = model
        self.dtype = dtype
        self.ops = ops
        self.spec = BaseModelSpec.from_model(model, config)
        self.registry = AdapterRegistry(
            self.spec, dtype, ops.device, max_cpu_adapters, adapter_root, s3_buckets,
            disk_cache_bytes=int(adapter_disk_cache_gib * 2**30),
        )
        self.slots: AdapterSlots | None = None  # None: adapters disabled (or no warmup yet)
        self._warmed_up = False

    @property
    def max_rank(self) -> int:
        return self.slots.max_rank if self.slots is not None else 0

    @property
    def ranks(self) -> RankClasses | None:
        """The slots' rank classes, which every pass's LoRA meta follows (None: no slots)."""
        return self.slots.ranks if self.slots is not None else None

    def allocate_slots(self, num_slots: int, max_rank: int, slot_ranks: Sequence[int] = ()) -> None:
        """(Re)allocates the slot table at warmup; every slot starts empty. slot_ranks: each
        slot's largest rank (rank classes), none: every slot holds max_rank."""
        if slot_ranks and (len(slot_ranks) != num_slots or max(slot_ranks) != max_rank or min(slot_ranks) < 1):
            raise ValueError(f"slot_ranks must give each of the {num_slots} slots a rank in 1..{max_rank}, at least "
                             f"one of them max_lora_rank={max_rank}; got {list(slot_ranks)}")
        # The old buffers go first, so a bigger table can reuse their memory.
        AdapterSlots.detach(self.model, self.spec)
        self.slots = None
        self.registry.host.unpin_all()
        self.registry.max_rank = 0
        self._warmed_up = True
        if num_slots < 1:
            return
        self.slots = AdapterSlots(self.model, self.spec, list(slot_ranks) or [max_rank] * num_slots, self.dtype,
                                  self.ops)
        self.registry.max_rank = self.slots.max_rank
        classes = ", ".join(f"{self.slots.ranks.count(c)} of rank up to {rank}"
                            for c, rank in enumerate(self.slots.ranks.ranks))
        log.info("adapter slots: %s (%.1f MiB)", classes, self.slots.nbytes / 2**20)

    def warmup_slots(self, rows: int) -> list[list[int]]:
        """The slots of warmup's dry-run passes of `rows` rows each: the first slot of each rank
        class in turn, largest class first, and as many passes as it takes for every class's
        kernels to run (compiled, their memory counted). The first pass, which sets the memory
        peak, holds the largest class."""
        slots = self._require_slots()
        firsts = [slots.ranks.of_slot.index(c) for c in reversed(range(len(slots.ranks.ranks)))]
        chunks = [firsts[start:start + rows] for start in range(0, len(firsts), max(rows, 1))]
        return [[chunk[row % len(chunk)] for row in range(rows)] for chunk in chunks]

    def exercising_every_slot_buffer(self) -> contextlib.AbstractContextManager[None]:
        """Warmup's dry run: LoRA kernels run for every projection, whatever the slots hold."""
        return self.slots.every_part_in_use() if self.slots is not None else contextlib.nullcontext()

    def load(self, adapter_id: str, source: str, path: str, revision: str = "") -> AdapterInfo:
        """Reads an adapter into host memory and checks it against the base (ValueError saying
        what differs; AdapterNotFoundError for a missing directory, hub repo or S3 prefix;
        AdapterStoreError when the store fails). Source "local" reads `path`; "hub" downloads
        `adapter_id` (owner/name[@revision]), "s3" `adapter_id` (s3://bucket/prefix), unless
        `path` gives the directory another rank downloaded. Safe to call while steps run on another thread."""
        if self.slots is None:
            raise ValueError(DISABLED if self._warmed_up else "call warmup first: it sizes the adapter slots")
        return self.registry.load(adapter_id, source, path, revision)

    def activate(self, adapter_id: str, slot: int, running: Mapping[int, str]) -> bool:
        """`running`: slot -> adapter of the requests in flight. True when the weights came from
        the host-memory cache (or the slot held them already), false when read from disk again."""
        slots = self._require_slots()
        slots.check_slot(slot)
        if slots.adapter_in(slot) == adapter_id:
            return True
        if slot in running:
            raise ValueError(f"slot {slot} holds adapter {running[slot]!r}, which running requests use")
        info = self.registry.info(adapter_id)
        if info is not None and info.rank > slots.rank_of(slot):
            # Before any move or read: a refused activation changes nothing.
            raise ValueError(f"adapter {adapter_id!r} has rank {info.rank}, but slot {slot} holds ranks up to "
                             f"{slots.rank_of(slot)}")
        other = slots.slot_of(adapter_id)
        if other is not None and other not in running:
            # A move: the router evicted the adapter from `other`, and the copy of another
            # adapter into it may not have arrived yet (activations run beside the steps). New
            # requests must not be bound to a slot about to be overwritten. (A copy in a slot
            # that running requests use stays: it holds the same weights until they finish.)
            slots.clear(other, adapter_id)
        host_cache_hit = adapter_id in self.registry.host
        adapter = self.registry.get(adapter_id)
        replaced = slots.activate(adapter, slot)
        self.registry.host.pin(adapter)
        if replaced is not None and slots.slot_of(replaced) is None:
            self.registry.host.unpin(replaced)
        log.info("adapter %s is in slot %d%s", adapter_id, slot, f" (replacing {replaced})" if replaced else "")
        return host_cache_hit

    def prefetch(self, adapter_id: str) -> bool:
        """Brings a loaded adapter back into host memory if the cache evicted it (the router asks
        while it waits for a slot); True when it was there already. Safe to call while steps run."""
        self._require_slots()
        host_cache_hit = adapter_id in self.registry.host
        self.registry.get(adapter_id)
        return host_cache_hit

    def unload(self, adapter_id: str, running: Mapping[int, str]) -> None:
        """Forgets an adapter: its slots and its host copy. Unknown ids are ignored (idempotent)."""
        if adapter_id in running.values():
            raise ValueError(f"adapter {adapter_id!r} still has running requests")
        if self.slots is not None:
            while (slot := self.slots.slot_of(adapter_id)) is not None:
                self.slots.clear(slot, adapter_id)
        if adapter_id in self.registry:
            log.info("unloaded adapter %s", adapter_id)
        self.registry.forget(adapter_id)

    def slot_for(self, request_id: int, adapter_id: str) -> int:
        """The slot serving a new request ("" = the base model: -1)."""
        if not adapter_id:
            return -1
        if self.slots is None:
            raise ValueError(
                f"request {request_id}: adapter {adapter_id!r} is not active: this shard has no adapter slots "
                "(max_active_adapters=0)"
            )
        slot = self.slots.slot_of(adapter_id)
        if slot is None:
            raise ValueError(f"request {request_id}: adapter {adapter_id!r} is not active in a slot")
        return slot

    def _require_slots(self) -> AdapterSlots:
        if self.slots is None:
            raise ValueError(DISABLED)
        return self.slots
