"""Where adapters that are not on local disk come from: the hub (`hub_source`), an S3 bucket
(`s3_source`); another store (GCS, Azure) is one more file implementing `RemoteSource`.

A source turns an adapter id into a local directory holding the adapter's files (downloading them
into a cache if needed) and the root those files must resolve inside (`confined.read_confined`).
Rank 0 fetches; the other ranks of a tensor-parallel shard get rank 0's directory and only check
that it is one this source would have written. Both run on the adapter-load thread, never on the
engine's, so a slow store does not stall decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from quiver_server.adapters.size_limits import AdapterSizeLimits


@dataclass(frozen=True)
class AdapterFiles:
    directory: Path  # canonical
    root: Path  # canonical; every file read from `directory` must resolve inside it


class RemoteSource(Protocol):
    def fetch(self, adapter_id: str, revision: str, limits: AdapterSizeLimits) -> AdapterFiles:
        """The adapter's files on local disk, downloaded unless the cache holds them already.

        ValueError: a malformed or refused id (the client's fault); AdapterNotFoundError: no such
        adapter; AdapterStoreError: the store failed or refused the server. A file larger than
        `limits` allows is refused, before its download where the store tells sizes up front."""
        ...

    def downloaded(self, adapter_id: str, directory: Path) -> AdapterFiles:
        """Another rank's `fetch` of `adapter_id`, which wrote `directory`: checked to be where
        this source puts that adapter (ValueError) and to exist (AdapterNotFoundError)."""
        ...
