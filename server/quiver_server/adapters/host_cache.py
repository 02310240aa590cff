"""Host-memory tier: loaded adapters, least recently used evicted first, bounded in count.

An adapter held by a device slot is pinned: slots are refilled from here, and the router may
re-activate it at any time, so it is never the one evicted. Pinned adapters do not count
against the bound (`--max-cpu-adapters` is what the host keeps *besides* the slots' adapters):
were they counted, a server with more slots than host places would have every fresh load evict
every other unpinned adapter, and most adapters would be read from disk twice, once to load and
once to activate. Evicting only drops the weights; the registry remembers where the adapter came
from and reads it from disk again if needed.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from quiver_server.adapters.loader import LoadedAdapter

log = logging.getLogger(__name__)


class HostAdapterCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the host adapter cache needs room for at least one adapter, got {capacity}")
        self.capacity = capacity
        self._adapters: OrderedDict[str, LoadedAdapter] = OrderedDict()  # oldest use first
        self._pinned: set[str] = set()
        # Loads run on their own threads (a download must not stall decoding), activation on
        # the engine's.
        self._lock = threading.Lock()

    def __contains__(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._adapters

    def __len__(self) -> int:
        with self._lock:
            return len(self._adapters)

    def ids(self) -> list[str]:
        """Cached adapter ids, least recently used first."""
        with self._lock:
            return list(self._adapters)

    def get(self, adapter_id: str) -> LoadedAdapter | None:
        with self._lock:
            adapter = self._adapters.get(adapter_id)
            if adapter is not None:
                self._adapters.move_to_end(adapter_id)
            return adapter

    def put(self, adapter: LoadedAdapter) -> list[str]:
        """Adds (or refreshes) an adapter as the most recently used; returns the ids evicted."""
        with self._lock:
            self._adapters[adapter.adapter_id] = adapter
            self._adapters.move_to_end(adapter.adapter_id)
            return self._trim(keep=adapter.adapter_id)

    def pin(self, adapter: LoadedAdapter) -> list[str]:
        """Keeps `adapter`, just copied into a slot, until `unpin`; returns the ids evicted. A load
        on another thread may have evicted it since the activation took it from here (with the
        cache full of pinned adapters, every load evicts all the others): it is put back."""
        with self._lock:
            self._pinned.add(adapter.adapter_id)
            if adapter.adapter_id in self._adapters:
                return []
            self._adapters[adapter.adapter_id] = adapter
            return self._trim()

    def unpin(self, adapter_id: str) -> list[str]:
        """Returns the ids evicted now that this one may go."""
        with self._lock:
            self._pinned.discard(adapter_id)
            return self._trim()

    def unpin_all(self) -> None:
        with self._lock:
            self._pinned.clear()
            self._trim()

    def remove(self, adapter_id: str) -> None:
        with self._lock:
            self._adapters.pop(adapter_id, None)
            self._pinned.discard(adapter_id)

    def _trim(self, keep: str | None = None) -> list[str]:
        evicted: list[str] = []
        unpinned = [adapter_id for adapter_id in self._adapters if adapter_id not in self._pinned]
        excess = len(unpinned) - self.capacity
        for adapter_id in unpinned:
            if excess <= 0:
                break
            if adapter_id != keep:
                del self._adapters[adapter_id]
                evicted.append(adapter_id)
                excess -= 1
        if evicted:
            log.info("host adapter cache full (%d): evicted %s", self.capacity, ", ".join(evicted))
        return evicted
