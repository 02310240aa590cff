"""Hub adapters (`owner/name[@revision]`): downloaded into the Hugging Face cache by
`hub.download_snapshot`, with the model downloads' auth, offline mode and progress logging.

A snapshot's files are links into its repository's `blobs/`, so that folder is their root. The
hub's file sizes are not asked for up front: the loader checks each file's size before reading it.
"""

from __future__ import annotations

from pathlib import Path

from quiver_server.adapters.confined import hub_cache_repo
from quiver_server.adapters.errors import AdapterNotFoundError
from quiver_server.adapters.remote_source import AdapterFiles
from quiver_server.adapters.size_limits import AdapterSizeLimits
from quiver_server.hub import ModelNotFoundError, download_snapshot


class HubSource:
    def __init__(self, file_patterns: tuple[str, ...]) -> None:
        self.file_patterns = file_patterns

    def fetch(self, adapter_id: str, revision: str, limits: AdapterSizeLimits) -> AdapterFiles:
        # A hub id may carry its revision as owner/name@revision.
        repo, _, id_revision = adapter_id.partition("@")
        try:
            downloaded = download_snapshot(
                repo, revision=revision or id_revision or None, allow_patterns=list(self.file_patterns)
            )
        except ModelNotFoundError as error:
            raise AdapterNotFoundError(str(error)) from error
        return _files(Path(downloaded).resolve())

    def downloaded(self, adapter_id: str, directory: Path) -> AdapterFiles:
        directory = directory.expanduser().resolve()
        if not directory.is_dir():
            raise AdapterNotFoundError("the adapter directory does not exist")
        return _files(directory)


def _files(directory: Path) -> AdapterFiles:
    return AdapterFiles(directory, hub_cache_repo(directory) or directory)
