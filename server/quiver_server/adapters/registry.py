"""The adapters this shard knows: where each one lives on disk, and its host-memory copy.

`load` finds the adapter's directory (a local path, or a remote source's download: the hub's into
the HF cache, an S3 bucket's into quiver's adapter cache — the disk tier), reads and checks it,
and puts it in the host cache. It is thread-safe and meant to
run off the engine's thread, so a download never stalls decoding. An adapter the host cache
evicted stays known: `get` reads it from its directory again when a slot needs it, and an S3
adapter whose directory the disk cache's budget evicted (`disk_budget`) is downloaded again
first, unless its objects changed since it was loaded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection
from pathlib import Path

import torch

from quiver_server.adapters.confined import is_inside
from quiver_server.adapters.errors import AdapterNotFoundError, AdapterStoreError
from quiver_server.adapters.host_cache import HostAdapterCache
from quiver_server.adapters.hub_source import HubSource
from quiver_server.adapters.loader import BIN_FILE, SAFETENSORS_FILE, LoadedAdapter, load_adapter_dir
from quiver_server.adapters.peft_config import CONFIG_FILE
from quiver_server.adapters.remote_source import RemoteSource
from quiver_server.adapters.s3_source import S3Source
from quiver_server.adapters.size_limits import AdapterSizeLimits
from quiver_server.adapters.spec import BaseModelSpec
from quiver_server.engine.batch_types import AdapterInfo
from quiver_server.hub import MODEL_FILE_PATTERNS

log = logging.getLogger(__name__)

SOURCES = ("hub", "local", "s3")
_BASE_ONLY_FILES = {"config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json"}
# The adapter itself, plus its own tokenizer and chat template if it has them (the router reads
# those from the same directory).
ADAPTER_FILE_PATTERNS = (CONFIG_FILE, SAFETENSORS_FILE, BIN_FILE) + tuple(
    pattern for pattern in MODEL_FILE_PATTERNS if pattern not in _BASE_ONLY_FILES
)


class AdapterRegistry:
    def __init__(
        self,
        spec: BaseModelSpec,
        dtype: torch.dtype,
        device: torch.device,
        max_cpu_adapters: int,
        adapter_root: str | None = None,
        s3_buckets: Collection[str] = (),
        disk_cache_bytes: int = 0,
    ) -> None:
        """s3_buckets: the buckets S3 adapters may come from (`--s3-adapter-buckets`; empty: none);
        disk_cache_bytes: the S3 download cache's budget (`--adapter-disk-cache-gib`; 0: no limit)."""
        self.spec = spec
        self.dtype = dtype
        self.pin_memory = device.type == "cuda"
        self.host = HostAdapterCache(max_cpu_adapters)
        self.max_rank = 0  # the slots' capacity, set at warmup; loads are checked against it
        self._known: dict[str, AdapterInfo] = {}
        self._roots: dict[str, Path] = {}  # adapter id -> what its files must resolve inside
        self._from_s3: set[str] = set()  # ids whose directory the S3 cache may evict: fetched again
        # adapter id -> the digest of the weights it was loaded with (`LoadedAdapter.digest`)
        self._digests: dict[str, str] = {}
        # Canonical --adapter-root: a local adapter's files must resolve inside it. Without it,
        # each local adapter is confined to its own directory.
        self.adapter_root = Path(adapter_root).resolve() if adapter_root else None
        self.s3 = S3Source(s3_buckets, ADAPTER_FILE_PATTERNS, disk_budget_bytes=disk_cache_bytes,
                           in_use=self.directories_in_use)
        self.remote: dict[str, RemoteSource] = {"hub": HubSource(ADAPTER_FILE_PATTERNS), "s3": self.s3}
        self._lock = threading.Lock()
        self._reading: dict[str, threading.Lock] = {}  # adapter id -> held while it is read again

    def __contains__(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._known

    def info(self, adapter_id: str) -> AdapterInfo | None:
        with self._lock:
            return self._known.get(adapter_id)

    def directories_in_use(self) -> list[Path]:
        """The directories known adapters read from (the S3 cache never evicts them)."""
        with self._lock:
            return [Path(known.path) for known in self._known.values()]

    def location(self, adapter_id: str) -> tuple[Path, Path] | None:
        """(directory, what its files must resolve inside) of a known adapter, None if unknown."""
        with self._lock:
            known, root = self._known.get(adapter_id), self._roots.get(adapter_id)
        if known is None or root is None:
            return None
        return Path(known.path), root

    def load(self, adapter_id: str, source: str, path: str, revision: str) -> AdapterInfo:
        """Idempotent: loading a known id again from the same place returns what it has."""
        if not adapter_id:
            raise ValueError("adapter_id is empty")
        directory, root = self._locate(adapter_id, source, path, revision)
        known = self.info(adapter_id)
        if known is not None:
            if Path(known.path) != directory:
                # No paths: the router shows the message to the client.
                raise ValueError(f"adapter {adapter_id!r} is already loaded from another place; unload it first")
            return known
        started = time.monotonic()
        try:
            adapter = self._read(adapter_id, directory, root)
        except (ValueError, OSError):
            if source != "s3" or path or directory.is_dir():
                raise
            # Another prefix's download evicted this version between its fetch and this read.
            log.info("adapter %s was removed from the adapter cache before it was read; fetching it again", adapter_id)
            directory, root = self._locate(adapter_id, source, path, revision)
            adapter = self._read(adapter_id, directory, root)
        with self._lock:
            # Another thread may have loaded the same id meanwhile: the first one wins.
            known = self._known.setdefault(adapter_id, adapter.info())
            self._roots.setdefault(adapter_id, root)
            self._digests.setdefault(adapter_id, adapter.digest)
            if source == "s3" and known == adapter.info():
                self._from_s3.add(adapter_id)
        if known != adapter.info():
            raise ValueError(f"adapter {adapter_id!r} was loaded from another place meanwhile; unload it first")
        self.host.put(adapter)
        log.info(
            "loaded adapter %s from %s: rank %d, scaling %g, %s (%.1f MiB, %.2fs)",
            adapter_id, directory, adapter.rank, adapter.scaling, " ".join(adapter.target_modules),
            adapter.nbytes / 2**20, time.monotonic() - started,
        )
        return adapter.info()

    def get(self, adapter_id: str) -> LoadedAdapter:
        """The host copy of a known adapter, read from disk again if the cache evicted it. A
        prefetch and an activation asking at once read it once."""
        adapter = self.host.get(adapter_id)
        if adapter is not None:
            return adapter
        with self._lock:
            reading = self._reading.setdefault(adapter_id, threading.Lock())
        with reading:
            return self.host.get(adapter_id) or self._read_again(adapter_id)

    def _read_again(self, adapter_id: str) -> LoadedAdapter:
        with self._lock:
            known, root = self._known.get(adapter_id), self._roots.get(adapter_id)
        if known is None or root is None:
            raise ValueError(f"adapter {adapter_id!r} is not loaded")
        with self._lock:
            from_s3 = adapter_id in self._from_s3
        directory = Path(known.path)
        if from_s3 and not directory.is_dir():
            root = self._fetch_again(adapter_id, directory)
        log.info("adapter %s was evicted from host memory; reading it from %s again", adapter_id, known.path)
        adapter = self._read(adapter_id, directory, root)
        with self._lock:
            loaded_with = self._digests.get(adapter_id)
        if loaded_with is not None and adapter.digest != loaded_with:
            # Other weights under a loaded id would mix with what it served before (and with the
            # router's cached prompt blocks, which it names by the id).
            log.warning("adapter %s: its files in %s changed since it was loaded: refused", adapter_id, directory)
            raise ValueError(
                f"adapter {adapter_id!r}: its files changed since it was loaded; unload it and load it again"
            )
        if from_s3:
            self.s3.budget.touch(directory)  # the version was just used
        self.host.put(adapter)
        return adapter

    def forget(self, adapter_id: str) -> None:
        with self._lock:
            self._known.pop(adapter_id, None)
            self._roots.pop(adapter_id, None)
            self._from_s3.discard(adapter_id)
            self._digests.pop(adapter_id, None)
            self._reading.pop(adapter_id, None)
        self.host.remove(adapter_id)

    def _fetch_again(self, adapter_id: str, directory: Path) -> Path:
        """An S3 adapter whose version folder the disk budget evicted: downloaded again into the
        same folder, or refused if the objects changed since the load (another version: other
        weights under an id the router's prefix cache keys on). Returns what its files must
        resolve inside."""
        log.info("adapter %s was evicted from the adapter cache; downloading it again", adapter_id)
        files = self.s3.fetch(adapter_id, "", AdapterSizeLimits.of(self.spec, self.max_rank))
        if files.directory != directory:
            log.warning("adapter %s changed in its bucket since it was loaded (version %s, now %s): refused",
                        adapter_id, directory.name, files.directory.name)
            raise AdapterStoreError(
                f"adapter {adapter_id!r} changed in its bucket since it was loaded, and the copy it was loaded "
                "from was evicted from the adapter cache; unload it and load it again"
            )
        with self._lock:
            if adapter_id in self._roots:
                self._roots[adapter_id] = files.root
        return files.root

    def _read(self, adapter_id: str, directory: Path, root: Path) -> LoadedAdapter:
        try:
            return load_adapter_dir(adapter_id, directory, self.spec, self.max_rank, self.dtype, self.pin_memory, root,
                                    hint_root=self.adapter_root)
        except ValueError as error:
            raise ValueError(f"adapter {adapter_id!r}: {error}") from error

    def _locate(self, adapter_id: str, source: str, path: str, revision: str) -> tuple[Path, Path]:
        """(directory, what its files must resolve inside): a local adapter's adapter root (else its own
        directory), a remote source's download (its own rule: `remote_source`). A remote adapter with
        a `path` is another rank's download, which this rank reads rather than fetches again."""
        if source not in SOURCES:
            raise ValueError(f"adapter source must be one of {', '.join(SOURCES)}, got {source!r}")
        if source == "local":
            return self._local(adapter_id, path)
        remote = self.remote[source]
        if path:
            files = remote.downloaded(adapter_id, Path(path))
        else:
            files = remote.fetch(adapter_id, revision, AdapterSizeLimits.of(self.spec, self.max_rank))
        return files.directory, files.root

    def _local(self, adapter_id: str, path: str) -> tuple[Path, Path]:
        if not path:
            raise ValueError(f"local adapter {adapter_id!r} needs the directory to read it from (path)")
        directory = Path(path).expanduser().resolve()
        if self.adapter_root is not None and not is_inside(directory, self.adapter_root):
            log.warning("refused adapter %r: %s is outside %s", adapter_id, directory, self.adapter_root)
            raise ValueError("the adapter directory leads outside the adapter root")
        if not directory.is_dir():
            raise AdapterNotFoundError("the adapter directory does not exist")
        return directory, self.adapter_root or directory
