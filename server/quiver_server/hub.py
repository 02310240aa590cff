"""Turns a MODEL_ID (local directory or Hugging Face Hub repo id) into a local directory.

Downloads go through `huggingface_hub.snapshot_download` into the standard HF cache, so a model
fetched once (by `quiver-server download` or any other HF tool) is reused. `HF_TOKEN` and
`HF_HUB_OFFLINE` are honoured; progress is written to the log rather than drawn as a terminal bar,
because the shard's stderr is a pipe to the launcher.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

logger = logging.getLogger(__name__)

# Only what serving a model needs: no .bin/.pth/.gguf/ONNX duplicates of the same weights.
MODEL_FILE_PATTERNS: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*.jinja",
)


class ModelNotFoundError(RuntimeError):
    """MODEL_ID is neither a local directory nor a repo the hub (or its offline cache) has."""


class _Discard:
    """A file object for tqdm that swallows its terminal output (we log instead)."""

    def write(self, _text: str) -> None:
        pass

    def flush(self) -> None:
        pass


class LoggingProgress(tqdm):
    """A tqdm that reports through `logging` every few seconds instead of drawing a bar.

    huggingface_hub hands this class every progress bar of a snapshot download (file count,
    bytes). Overriding `display` is enough: tqdm routes every redraw through it.
    """

    LOG_INTERVAL_S = 5.0
    LOG_FORMAT = "{desc}: {percentage:3.0f}% ({n_fmt}/{total_fmt}, {elapsed} elapsed, {rate_fmt})"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)  # huggingface_hub's own tqdm takes a group name; plain tqdm doesn't
        kwargs["disable"] = False
        kwargs["file"] = _Discard()
        kwargs.setdefault("mininterval", self.LOG_INTERVAL_S)
        self._last_logged = 0.0
        self._logged_done = False
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        now = time.monotonic()
        done = bool(self.total) and self.n >= self.total
        due = now - self._last_logged >= self.LOG_INTERVAL_S
        if self.n == 0 or self._logged_done or not (due or done):
            return True
        self._last_logged = now
        self._logged_done = done
        line = self.format_meter(**{**self.format_dict, "bar_format": self.LOG_FORMAT})
        logger.info("download progress: %s", line)
        return True


def resolve_model(model_id: str, revision: str | None = None) -> str:
    """Local directory for `model_id`, downloading it from the hub if it is not a directory; a
    local GGUF file gets its companion directory (`gguf_source`)."""
    from quiver_server import gguf_source

    if gguf_source.is_gguf_file(model_id):
        if revision:
            logger.warning("--revision %s ignored: %s is a local file", revision, model_id)
        return gguf_source.prepare(model_id)
    local = Path(model_id).expanduser()
    if local.is_dir():
        if revision:
            logger.warning("--revision %s ignored: %s is a local directory", revision, local)
        return str(local.resolve())
    if model_id.startswith(("/", "./", "../", "~")) or model_id.count("/") > 1:
        raise ModelNotFoundError(f"model directory {model_id!r} does not exist")
    return download_snapshot(model_id, revision=revision, allow_patterns=list(MODEL_FILE_PATTERNS))


def download_snapshot(
    repo_id: str, revision: str | None = None, allow_patterns: list[str] | None = None
) -> str:
    """Fetches (or finds in the cache) the files of `repo_id` matching `allow_patterns`.

    Shared with adapter downloads, which need the same auth/offline/progress handling.
    """
    # Imported here so `quiver-server --help` and local-directory serving stay light.
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = constants.HF_HUB_OFFLINE
    logger.info(
        "resolving %s%s from the hub%s",
        repo_id,
        f"@{revision}" if revision else "",
        " cache (HF_HUB_OFFLINE is set)" if offline else "",
    )
    started = time.monotonic()
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=allow_patterns,
            token=os.environ.get("HF_TOKEN") or None,
            local_files_only=offline,
            tqdm_class=LoggingProgress,
        )
    except LocalEntryNotFoundError as error:
        hint = "it is not in the local cache and HF_HUB_OFFLINE is set" if offline else str(error)
        raise ModelNotFoundError(f"cannot get {repo_id!r}: {hint}") from error
    except HfHubHTTPError as error:
        # Covers missing repos, gated repos without HF_TOKEN and bad revisions; the hub's own
        # message says which.
        raise ModelNotFoundError(f"cannot get {repo_id!r} from the hub: {error}") from error
    except ValueError as error:  # malformed repo ids
        raise ModelNotFoundError(f"{repo_id!r} is neither a directory nor a hub repo id: {error}") from error
    logger.info("%s is at %s (%.1fs)", repo_id, path, time.monotonic() - started)
    return str(path)
