"""The S3 adapter cache's byte budget (`--adapter-disk-cache-gib`): after each download, least
recently used version folders go until the cache is within the budget.

"Used" is a version folder's mtime, which `S3Source` touches whenever a load downloads it or
reads the cached copy. Never removed: a folder that a loaded adapter reads from (`in_use`, the
registry's answer) and the one just downloaded; so the cache may stay above a budget that the
loaded adapters alone exceed. A prefix's versions other than the one a load just found go
whatever the budget (none at all: no limit): a load always lists the current ETags, so they can
never be read again, unless a loaded adapter still reads one.

A folder is removed by renaming it to a hidden sibling first, then deleting that: it disappears
at once and whole, so a reader never sees half of one. An adapter whose folder went is fetched
again when it must be read from disk (`AdapterRegistry.get`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

from quiver_server.adapters.s3_location import S3Location
from quiver_server.adapters.size_limits import human_bytes

log = logging.getLogger(__name__)

InUse = Callable[[], Collection[Path]]
EVICTING_MARK = ".evicting-"
_HIDDEN_VERSION = re.compile(r"\.@[0-9a-f]{16}\.")


def no_directories() -> Collection[Path]:
    return ()


class DiskBudget:
    def __init__(self, cache: Path, max_bytes: int, in_use: InUse = no_directories) -> None:
        """max_bytes: the budget for `cache`'s S3 versions (0: no limit); in_use: the directories
        loaded adapters read from, which are never removed."""
        if max_bytes < 0:
            raise ValueError(f"the adapter disk cache budget must not be negative, got {max_bytes} bytes")
        self.cache = cache
        self.max_bytes = max_bytes
        self.in_use = in_use
        self._lock = threading.Lock()  # one eviction pass at a time in this process
        self._last_stamp_ns = 0

    def touch(self, version: Path) -> None:
        """Marks a version folder as just used (its mtime). Each stamp is later than the one
        before, even where the clock that file times use is coarser than two uses apart."""
        with self._lock:
            stamp = self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
        try:
            os.utime(version, ns=(stamp, stamp))
        except FileNotFoundError:
            pass  # removed meanwhile: the caller's read will say so

    def drop_other_versions(self, location: S3Location, current: Path) -> None:
        """Removes the versions of `location` other than `current` (what its objects are now)
        that no loaded adapter reads from."""
        with self._lock:
            self._drop_other_versions(location, current.resolve(), self._in_use())

    def after_download(self, location: S3Location, downloaded: Path) -> None:
        """Removes the older versions of `location` and, past the budget, the least recently
        used versions of any prefix; never `downloaded` or a folder in use."""
        with self._lock:
            downloaded = downloaded.resolve()
            keep = self._in_use() | {downloaded}
            self._drop_other_versions(location, downloaded, keep)
            if self.max_bytes <= 0:
                return
            root = (self.cache / "s3").resolve()
            sized = [(_mtime(version), version, _bytes_under(version)) for version in _all_versions(root)]
            total = sum(size for _, _, size in sized)
            for _, version, size in sorted(sized, key=lambda entry: entry[0]):
                if total <= self.max_bytes:
                    break
                if version in keep:
                    continue
                if self._evict(version, f"the adapter cache holds {human_bytes(total)}, more than its budget of "
                                        f"{human_bytes(self.max_bytes)}; least recently used"):
                    total -= size
            if total > self.max_bytes:
                log.info("the adapter cache holds %s, more than its budget of %s: the rest is in use",
                         human_bytes(total), human_bytes(self.max_bytes))

    def _in_use(self) -> set[Path]:
        return {Path(path).resolve() for path in self.in_use()}

    def _drop_other_versions(self, location: S3Location, current: Path, keep: set[Path]) -> None:
        for version in _versions_in(current.parent):
            if version != current and version not in keep:
                self._evict(version, f"{location} is now another version")

    def _evict(self, version: Path, why: str) -> bool:
        trash = version.with_name(f".{version.name}{EVICTING_MARK}{uuid.uuid4().hex[:8]}")
        try:
            version.rename(trash)  # gone at once, whole
        except FileNotFoundError:
            return False  # another process removed it first
        except OSError as error:
            log.warning("cannot remove %s from the adapter cache: %s", version, error.strerror)
            return False
        shutil.rmtree(trash, ignore_errors=True)
        log.info("removed %s from the adapter cache: %s", version, why)
        return True


def _versions_in(folder: Path) -> list[Path]:
    try:
        children = list(folder.iterdir())
    except FileNotFoundError:
        return []
    return [child for child in children if S3Location.is_version_name(child.name) and child.is_dir()]


def _all_versions(root: Path) -> Iterator[Path]:
    """Every version folder under `<cache>/s3` (not staging or evicting ones: hidden)."""
    for parent, folders, _ in os.walk(root):
        here = Path(parent)
        descend = []
        for name in folders:
            if S3Location.is_version_name(name):
                yield here / name
            elif not _HIDDEN_VERSION.match(name):  # a download's staging, an eviction's trash
                descend.append(name)
        folders[:] = descend


def _bytes_under(folder: Path) -> int:
    total = 0
    for parent, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except FileNotFoundError:
                pass
    return total


def _mtime(folder: Path) -> int:
    try:
        return folder.stat().st_mtime_ns
    except FileNotFoundError:
        return 0
