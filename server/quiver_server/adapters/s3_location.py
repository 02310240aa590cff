"""`s3://bucket/prefix` adapter ids (LoRAX's spelling), and where their files go in the cache.

The prefix becomes folders of the local adapter cache, so an id is refused (ValueError, a 400)
unless every component is a plain name: no `.`, `..` or empty component (`a//b`, a trailing `/`),
no backslash or control character, none longer than a file name may be. The router checks the
same (router/src/adapters/s3_id.rs) before a shard sees the id; this is the shard's own check.

Cache layout: `<cache>/s3/<bucket>/<prefix components>/@<version>/`, the version a digest of the
objects' names, sizes and ETags. A component that starts with `@` is stored as `@@...`, so no
prefix can name a folder that is another prefix's version.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

SCHEME = "s3://"
ENV_CACHE = "QUIVER_ADAPTER_CACHE"
VERSION_MARK = "@"
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_VERSION = re.compile(r"@[0-9a-f]{16}")
MAX_NAME_BYTES = 255  # a file name, on Linux filesystems
SHAPE = "S3 adapter ids are s3://bucket/prefix"


def adapter_cache() -> Path:
    """$QUIVER_ADAPTER_CACHE, else `adapters` in quiver's cache ($QUIVER_CACHE_DIR, which the
    launcher sets from --cache-dir; default ~/.cache/quiver). Not resolved: it may not exist yet."""
    explicit = os.environ.get(ENV_CACHE)
    if explicit:
        return Path(explicit).expanduser()
    return Path(os.environ.get("QUIVER_CACHE_DIR") or "~/.cache/quiver").expanduser() / "adapters"


def bucket_problem(bucket: str) -> str | None:
    """Why `bucket` is not a general purpose bucket's name by S3's rules, None if it is one."""
    if not _BUCKET.fullmatch(bucket):
        return ("a bucket name has 3 to 63 lowercase letters, digits, '.' and '-', and starts and ends with a "
                "letter or digit")
    if ".." in bucket:
        return "a bucket name has no '..'"
    return None


def parse_buckets(names: str) -> tuple[str, ...]:
    """`--s3-adapter-buckets b1,b2`; ValueError for a name S3 would not accept."""
    buckets = tuple(name.strip() for name in names.split(",") if name.strip())
    for bucket in buckets:
        problem = bucket_problem(bucket)
        if problem is not None:
            raise ValueError(f"{bucket!r} is not a bucket name: {problem}")
    return buckets


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "a/b/c": no leading or trailing "/"

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}"

    @property
    def key_prefix(self) -> str:
        """What the adapter's object keys start with."""
        return f"{self.prefix}/"

    def cache_folder(self, cache: Path) -> Path:
        """The folder holding this prefix's versions in `cache`."""
        escaped = [VERSION_MARK + part if part.startswith(VERSION_MARK) else part for part in self.prefix.split("/")]
        return cache.joinpath("s3", self.bucket, *escaped)

    @staticmethod
    def version_name(digest: str) -> str:
        return VERSION_MARK + digest[:16]

    @staticmethod
    def is_version_name(name: str) -> bool:
        return _VERSION.fullmatch(name) is not None


def parse_s3_id(adapter_id: str) -> S3Location:
    """The bucket and prefix of `s3://bucket/prefix`; ValueError saying what is wrong."""
    if not adapter_id.startswith(SCHEME):
        raise ValueError(f"{SHAPE}; {adapter_id!r} does not start with {SCHEME}")
    bucket, slash, prefix = adapter_id[len(SCHEME):].partition("/")
    problem = bucket_problem(bucket)
    if problem is not None:
        raise ValueError(f"{SHAPE}; {problem}")
    if not slash or not prefix:
        raise ValueError(f"{SHAPE}; the prefix is missing")
    problem = prefix_problem(prefix)
    if problem is not None:
        raise ValueError(f"{SHAPE}; {problem}")
    return S3Location(bucket, prefix)


def prefix_problem(prefix: str) -> str | None:
    """Why `prefix` (or a key's part below an adapter's prefix) cannot be a path in the cache."""
    if "\\" in prefix:
        return "the prefix must not contain '\\'"
    if _CONTROL.search(prefix):
        return "the prefix must not contain control characters"
    for component in prefix.split("/"):
        if component in ("", ".", ".."):
            return "the prefix must not have empty, '.' or '..' components ('//', a trailing '/')"
        # One byte more for the escape of a leading '@'.
        if len(component.encode()) + 1 > MAX_NAME_BYTES:
            return f"a component of the prefix has more than {MAX_NAME_BYTES - 1} bytes"
    return None
