"""The S3 adapters' disk cache (`--adapter-disk-cache-bytes`): past its budget, unused versions are
evicted (least recently used first, never one in use), an older version goes once a newer one is
downloaded, and an adapter evicted from disk and host memory, or between its fetch and its read, is
fetched again, against moto's S3 server as in test_adapters_s3_source.py."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from quiver_server.adapters.errors import AdapterStoreError
from quiver_server.adapters.remote_source import AdapterFiles
from quiver_server.adapters.spec import BaseModelSpec
from s3_adapter_fixtures import BUCKET, CONFIG, WEIGHTS, assert_same_weights, registry_for
from s3_store import S3Store, StoreProxy

# The shared fixtures (base model, adapters, the S3 store, the shard), by name.
pytest_plugins = ["s3_adapter_fixtures"]


def _version_bytes(adapter: Path) -> int:
    """What one version folder of `adapter` ("second": no template) holds in the cache."""
    return sum((adapter / name).stat().st_size for name in (CONFIG, WEIGHTS))


def _upload_copies(store: S3Store, adapter: Path, *prefixes: str) -> list[str]:
    for prefix in prefixes:
        store.upload_dir(BUCKET, prefix, adapter)
    return [f"s3://{BUCKET}/{prefix}" for prefix in prefixes]


def test_past_the_budget_unused_versions_are_evicted_but_never_one_in_use(
    spec: BaseModelSpec, adapters: dict[str, Path], store: S3Store, proxy: StoreProxy,
    caplog: pytest.LogCaptureFixture
) -> None:
    a, b, c = _upload_copies(store, adapters["second"], "budget/a", "budget/b", "budget/c")
    size = _version_bytes(adapters["second"])
    registry = registry_for(spec, disk_cache_bytes=size * 3 // 2)  # less than two adapters
    path_a = Path(registry.load(a, "s3", "", "").path)
    assert sum(p.stat().st_size for p in path_a.iterdir()) == size
    # Both loaded: over the budget, but neither is evicted.
    path_b = Path(registry.load(b, "s3", "", "").path)
    assert path_a.is_dir() and path_b.is_dir()
    # a unloaded: the next download evicts its folder; b (loaded) and c (just downloaded) stay.
    registry.forget(a)
    caplog.set_level(logging.INFO)
    path_c = Path(registry.load(c, "s3", "", "").path)
    assert not path_a.exists() and path_b.is_dir() and path_c.is_dir()
    assert list(path_a.parent.iterdir()) == []  # no trash left behind
    assert f"removed {path_a} from the adapter cache" in caplog.text
    # Loaded again: downloaded again.
    gets = len(proxy.object_gets)
    registry.forget(c)
    assert Path(registry.load(a, "s3", "", "").path) == path_a
    assert f"{BUCKET}/budget/a/{WEIGHTS}" in proxy.object_gets[gets:]
    assert path_b.is_dir() and not path_c.exists()


def test_the_least_recently_used_version_is_evicted_first(
    spec: BaseModelSpec, adapters: dict[str, Path], store: S3Store, proxy: StoreProxy
) -> None:
    a, b, c = _upload_copies(store, adapters["second"], "lru/a", "lru/b", "lru/c")
    registry = registry_for(spec, disk_cache_bytes=_version_bytes(adapters["second"]) * 5 // 2)  # room for two
    paths = {}
    for adapter_id in (a, b):
        paths[adapter_id] = Path(registry.load(adapter_id, "s3", "", "").path)
        registry.forget(adapter_id)
    gets = len(proxy.object_gets)
    registry.load(a, "s3", "", "")  # the cached copy: a is now more recently used than b
    registry.forget(a)
    assert proxy.object_gets[gets:] == []
    paths[c] = Path(registry.load(c, "s3", "", "").path)
    registry.forget(c)
    assert paths[a].is_dir() and not paths[b].exists() and paths[c].is_dir()
    registry.load(b, "s3", "", "")  # downloaded again: now a is the least recently used
    assert not paths[a].exists() and paths[b].is_dir() and paths[c].is_dir()


def test_an_older_version_is_removed_once_a_newer_one_is_downloaded(
    spec: BaseModelSpec, adapters: dict[str, Path], store: S3Store, proxy: StoreProxy
) -> None:
    adapter_id = f"s3://{BUCKET}/versions"
    store.upload_dir(BUCKET, "versions", adapters["first"])
    registry = registry_for(spec)  # no budget: older versions go all the same
    old = Path(registry.load(adapter_id, "s3", "", "").path)
    store.upload_dir(BUCKET, "versions", adapters["second"])
    # Still loaded: the newer version is downloaded (and the load refused), the older one kept.
    with pytest.raises(ValueError, match="already loaded from another place"):
        registry.load(adapter_id, "s3", "", "")
    assert old.is_dir() and len(list(old.parent.iterdir())) == 2
    registry.forget(adapter_id)
    new = Path(registry.load(adapter_id, "s3", "", "").path)  # the cached newer version
    assert list(old.parent.iterdir()) == [new]
    store.upload_dir(BUCKET, "versions", adapters["first"])
    registry.forget(adapter_id)
    newest = Path(registry.load(adapter_id, "s3", "", "").path)  # downloaded
    assert newest == old and list(old.parent.iterdir()) == [newest]


def _evicted_by_another_server(spec: BaseModelSpec, adapters: dict[str, Path], store: S3Store, path: Path) -> None:
    """Another server sharing the cache, with a budget of one adapter, evicts `path`."""
    (other,) = _upload_copies(store, adapters["second"], f"refetch/other-{path.parent.name}")
    registry_for(spec, disk_cache_bytes=_version_bytes(adapters["second"])).load(other, "s3", "", "")
    assert not path.exists()


def test_an_adapter_evicted_from_disk_and_host_is_fetched_again(
    spec: BaseModelSpec, adapters: dict[str, Path], store: S3Store, proxy: StoreProxy
) -> None:
    (adapter_id,) = _upload_copies(store, adapters["second"], "refetch/same")
    registry = registry_for(spec, max_cpu_adapters=1)
    path = Path(registry.load(adapter_id, "s3", "", "").path)
    registry.load("local", "local", str(adapters["second"]), "")  # evicts its host copy
    assert adapter_id not in registry.host
    _evicted_by_another_server(spec, adapters, store, path)
    gets = len(proxy.object_gets)
    assert_same_weights(registry, adapter_id, "local")
    assert f"{BUCKET}/refetch/same/{WEIGHTS}" in proxy.object_gets[gets:]
    assert path.is_dir() and registry.location(adapter_id) == (path, path)


def test_a_version_evicted_between_its_fetch_and_its_read_is_fetched_again(
    spec: BaseModelSpec, adapters: dict[str, Path], store: S3Store, proxy: StoreProxy,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another prefix's download may evict a cached version after its load found it, before the
    registry knows it is in use: the load fetches it again."""
    (adapter_id,) = _upload_copies(store, adapters["second"], "refetch/raced")
    registry = registry_for(spec)
    fetch = registry.s3.fetch
    evicted: list[Path] = []

    def fetch_then_evict(*args: Any) -> AdapterFiles:
        files = fetch(*args)
        if not evicted:
            evicted.append(files.directory)
            shutil.rmtree(files.directory)
        return files

    monkeypatch.setattr(registry.s3, "fetch", fetch_then_evict)
    info = registry.load(adapter_id, "s3", "", "")
    assert Path(info.path) == evicted[0] and evicted[0].is_dir()
    registry.load("local", "local", str(adapters["second"]), "")
    assert_same_weights(registry, adapter_id, "local")


def test_an_adapter_that_changed_in_its_bucket_is_not_fetched_again(
    spec: BaseModelSpec, adapters: dict[str, Path], store: S3Store, proxy: StoreProxy
) -> None:
    (adapter_id,) = _upload_copies(store, adapters["second"], "refetch/changed")
    registry = registry_for(spec, max_cpu_adapters=1)
    path = Path(registry.load(adapter_id, "s3", "", "").path)
    registry.load("local", "local", str(adapters["first"]), "")  # evicts its host copy
    _evicted_by_another_server(spec, adapters, store, path)
    store.upload_dir(BUCKET, "refetch/changed", adapters["first"])
    with pytest.raises(AdapterStoreError, match=rf"adapter '{adapter_id}' changed in its bucket since it was "
                                                r"loaded.*unload it and load it again"):
        registry.get(adapter_id)
    assert adapter_id in registry and not path.exists()
