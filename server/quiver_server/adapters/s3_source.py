"""S3 adapters (`s3://bucket/prefix`), read with boto3 from any S3-compatible store.

boto3's standard configuration applies: credentials from the environment, the shared config and
credentials files, a profile (`AWS_PROFILE`) or the instance's role; the endpoint from
`AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3` (MinIO, R2 ...). The client is made at the first S3
load, so a server that never loads one never imports boto3.

A load lists the objects directly under `prefix/` (and `additional_chat_templates/`), keeps the
files an adapter directory may hold, checks their listed sizes against the limits, and downloads
them into the cache (`s3_location`) unless the cache already holds that exact set of objects:
the version folder is named by a digest of their ETags, so a re-uploaded file is downloaded again
and an unchanged adapter never is. Each object is fetched with `If-Match` its listed ETag, its
byte count checked against the listing and, for a single-part upload, its MD5 against the ETag;
the version folder appears complete or not at all (`staged_dir.write_staged`). Each load removes
the prefix's other (older) versions, and each download, past `--adapter-disk-cache-gib`, the least
recently used versions; neither removes one that a loaded adapter reads from (`disk_budget`).

The store's errors become ours: no such bucket or prefix -> AdapterNotFoundError (404); refused
credentials and any other failure -> AdapterStoreError (500), whose message names the store's
error code only. botocore's exceptions are neither logged nor chained: their text is the store's.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quiver_server.adapters.disk_budget import DiskBudget, InUse, no_directories
from quiver_server.adapters.errors import AdapterNotFoundError, AdapterStoreError
from quiver_server.adapters.peft_config import CONFIG_FILE
from quiver_server.adapters.remote_source import AdapterFiles
from quiver_server.adapters.s3_location import S3Location, adapter_cache, parse_s3_id, prefix_problem
from quiver_server.adapters.size_limits import AdapterSizeLimits, human_bytes
from quiver_server.staged_dir import write_staged

log = logging.getLogger(__name__)

CHUNK_BYTES = 2**20
NOT_FOUND_CODES = frozenset({"NoSuchBucket", "NoSuchKey", "404"})
REFUSED_CODES = frozenset({
    "AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
    "InvalidToken", "TokenRefreshRequired", "InvalidClientTokenId", "403",
})
# Server-side encryption with KMS keys or the customer's key: the ETag is no MD5 of the bytes.
_OPAQUE_ETAG_ENCRYPTION = ("aws:kms", "aws:kms:dsse")
_ERROR_CODE = re.compile(r"[A-Za-z0-9.]{1,64}")
_MD5_ETAG = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class Listed:
    key: str
    etag: str  # as the store quotes it
    size: int


class S3Source:
    def __init__(
        self,
        buckets: Collection[str],
        file_patterns: tuple[str, ...],
        cache: Path | None = None,
        disk_budget_bytes: int = 0,
        in_use: InUse = no_directories,
    ) -> None:
        """buckets: `--s3-adapter-buckets` (empty: S3 adapters are off); file_patterns: what an
        adapter directory may hold; cache: default `s3_location.adapter_cache()`;
        disk_budget_bytes: `--adapter-disk-cache-gib` (0: no limit); in_use: the directories
        loaded adapters read from, never evicted (`disk_budget`)."""
        self.buckets = frozenset(buckets)
        self.file_patterns = file_patterns
        self.cache = adapter_cache() if cache is None else cache
        self.budget = DiskBudget(self.cache, disk_budget_bytes, in_use)
        self._client: Any = None  # a boto3 S3 client (thread-safe), made at the first load
        self._client_lock = threading.Lock()
        self._prefix_locks: dict[S3Location, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def fetch(self, adapter_id: str, revision: str, limits: AdapterSizeLimits) -> AdapterFiles:
        location = self._checked(adapter_id)
        if revision:
            raise ValueError("S3 adapters have no revisions: a prefix names one adapter")
        # One download per prefix at a time: a second load waits, then finds the first one's copy.
        with self._lock_for(location):
            client = self._s3()
            objects = self._list(client, location)
            if CONFIG_FILE not in objects:
                raise AdapterNotFoundError(f"there is no adapter under {location}/ (no {CONFIG_FILE})")
            for name, listed in objects.items():
                limits.for_file(name).check(name, listed.size)
            target = location.cache_folder(self.cache) / location.version_name(_manifest_digest(objects))
            if target.is_dir():
                log.info("%s is unchanged since it was downloaded (same ETags): using the cached copy", location)
                self.budget.touch(target)
                self.budget.drop_other_versions(location, target)
            else:
                self._download_into(client, location, objects, target)
                self.budget.touch(target)
                self.budget.after_download(location, target)
        target = target.resolve()
        return AdapterFiles(target, target)

    def downloaded(self, adapter_id: str, directory: Path) -> AdapterFiles:
        location = self._checked(adapter_id)
        directory = directory.expanduser().resolve()
        folder = location.cache_folder(self.cache).resolve()
        if directory.parent != folder or not location.is_version_name(directory.name):
            log.warning("refused %s: %s is not a version of %s in the adapter cache", adapter_id, directory, folder)
            raise ValueError("the adapter directory is not where this server's cache keeps that S3 adapter")
        if not directory.is_dir():
            raise AdapterNotFoundError("the adapter directory does not exist")
        self.budget.touch(directory)
        return AdapterFiles(directory, directory)

    # ---- steps ----------------------------------------------------------------------------------

    def _checked(self, adapter_id: str) -> S3Location:
        location = parse_s3_id(adapter_id)
        if not self.buckets:
            raise ValueError("S3 adapters are not enabled on this server (--s3-adapter-buckets)")
        if location.bucket not in self.buckets:
            raise ValueError(f"bucket {location.bucket!r} is not one this server loads adapters from")
        return location

    def _lock_for(self, location: S3Location) -> threading.Lock:
        with self._locks_lock:
            return self._prefix_locks.setdefault(location, threading.Lock())

    def _s3(self) -> Any:
        with self._client_lock:
            if self._client is None:
                with _store_errors("reach", "the object store"):
                    import boto3  # here: a server without S3 adapters never imports it

                    self._client = boto3.session.Session().client("s3")
            return self._client

    def _list(self, client: Any, location: S3Location) -> dict[str, Listed]:
        """name below the prefix -> object, for the files an adapter directory may hold."""
        found, folders = self._list_level(client, location, location.key_prefix)
        subfolders = {pattern.rsplit("/", 1)[0] + "/" for pattern in self.file_patterns if "/" in pattern}
        for folder in sorted(subfolders):
            if location.key_prefix + folder in folders:
                found.update(self._list_level(client, location, location.key_prefix + folder)[0])
        objects: dict[str, Listed] = {}
        for key, listed in found.items():
            name = key[len(location.key_prefix):]
            if not any(fnmatch.fnmatchcase(name, pattern) for pattern in self.file_patterns):
                continue
            if prefix_problem(name) is not None:
                log.warning("skipped an object of %s whose name cannot be a file name: %r", location, name)
                continue
            objects[name] = listed
        if "adapter_model.safetensors" in objects:
            objects.pop("adapter_model.bin", None)  # the loader would read the safetensors file only
        return objects

    def _list_level(self, client: Any, location: S3Location, prefix: str) -> tuple[dict[str, Listed], set[str]]:
        """(key -> object, the folders) directly under `prefix`."""
        objects: dict[str, Listed] = {}
        folders: set[str] = set()
        with _store_errors("list", str(location)):
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=location.bucket, Prefix=prefix, Delimiter="/"
            )
            for page in pages:
                for item in page.get("Contents", []):
                    objects[item["Key"]] = Listed(item["Key"], item["ETag"], int(item["Size"]))
                folders.update(common["Prefix"] for common in page.get("CommonPrefixes", []))
        return objects, folders

    def _download_into(self, client: Any, location: S3Location, objects: dict[str, Listed], target: Path) -> None:
        total = sum(listed.size for listed in objects.values())
        log.info("downloading %s: %d files, %s", location, len(objects), human_bytes(total))
        started = time.monotonic()

        def fill(staging: Path) -> None:
            for name, listed in sorted(objects.items()):
                _download(client, location, name, listed, staging / name)

        try:
            write_staged(target, fill)
        except OSError as error:
            if target.is_dir():  # another process downloaded the same version first
                log.info("%s was downloaded by another process meanwhile: using its copy", location)
                return
            log.warning("cannot write %s into the adapter cache at %s: %s", location, target, error)
            raise AdapterStoreError(
                f"cannot write {location} into the adapter cache ({error.strerror or type(error).__name__})"
            ) from None
        log.info("downloaded %s (%s in %.1fs)", location, human_bytes(total), time.monotonic() - started)


def _download(client: Any, location: S3Location, name: str, listed: Listed, path: Path) -> None:
    """One object into `path`: refused unless exactly the listed bytes (and, where the ETag is an
    MD5, those bytes' MD5) arrived."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.md5(usedforsecurity=False)
    count = 0
    with _store_errors("download", f"{location}/{name}"):
        # If-Match: the object the listing described, or an error if it changed since.
        response = client.get_object(Bucket=location.bucket, Key=listed.key, IfMatch=listed.etag)
        with open(path, "wb") as out:
            for chunk in response["Body"].iter_chunks(CHUNK_BYTES):
                count += len(chunk)
                if count > listed.size:
                    break
                digest.update(chunk)
                out.write(chunk)
    if count != listed.size:
        raise _corrupt(location, name, f"{'more' if count > listed.size else 'fewer'} bytes arrived than it has")
    etag = listed.etag.strip('"')
    opaque = response.get("ServerSideEncryption") in _OPAQUE_ETAG_ENCRYPTION or response.get("SSECustomerAlgorithm")
    if _MD5_ETAG.fullmatch(etag) and not opaque and digest.hexdigest() != etag:
        raise _corrupt(location, name, "the bytes that arrived do not have the MD5 its ETag says")


def _corrupt(location: S3Location, name: str, why: str) -> AdapterStoreError:
    log.warning("refused the download of %s from %s: %s", name, location, why)
    return AdapterStoreError(f"the download of {name} from {location} was corrupt: {why}")


def _manifest_digest(objects: dict[str, Listed]) -> str:
    manifest = sorted((name, listed.etag, listed.size) for name, listed in objects.items())
    return hashlib.sha256(json.dumps(manifest).encode()).hexdigest()


def _refused(what: str, code: str) -> AdapterStoreError:
    return AdapterStoreError(f"the object store refused the server's credentials for {what} ({code})")


@contextmanager
def _store_errors(operation: str, what: str) -> Iterator[None]:
    """botocore's exceptions as ours, logged by their error code only (never their text)."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        FlexibleChecksumError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    try:
        yield
    except ClientError as error:
        raw = str(error.response.get("Error", {}).get("Code", ""))
        code = raw if _ERROR_CODE.fullmatch(raw) else "an unnamed error"
        log.warning("S3 %s of %s: the store answered %s", operation, what, code)
        if code in NOT_FOUND_CODES:
            raise AdapterNotFoundError(f"{what} does not exist ({code})") from None
        if code in REFUSED_CODES:
            raise _refused(what, code) from None
        if code == "PreconditionFailed":
            raise AdapterStoreError(f"{what} changed while it was downloaded; load it again") from None
        raise AdapterStoreError(f"the object store answered {code} for {what}") from None
    except (NoCredentialsError, PartialCredentialsError) as error:
        log.warning("S3 %s of %s: %s", operation, what, type(error).__name__)
        raise _refused(what, f"{type(error).__name__}: the server has none") from None
    except FlexibleChecksumError:
        log.warning("S3 %s of %s: the checksum of the bytes that arrived is wrong", operation, what)
        raise AdapterStoreError(f"the download of {what} was corrupt: its checksum is wrong") from None
    except BotoCoreError as error:
        # Their text may quote the endpoint or the configuration: the class says enough.
        log.warning("S3 %s of %s: %s", operation, what, type(error).__name__)
        raise AdapterStoreError(f"cannot {operation} {what} ({type(error).__name__})") from None
