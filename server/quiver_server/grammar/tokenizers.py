"""llguidance's tokenizers, one per tokenizer file and EOS set, built lazily and kept.

A request's grammar is built for the tokenizer its text is decoded with: an adapter's own
`tokenizer.json` when its directory has one (the router's rule, router/src/adapters/assets.rs),
else the base model's. Building one walks the whole vocabulary (about a second for 128k tokens),
so it happens on a compile thread, once per (file, EOS ids), never per request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import llguidance

from quiver_server.adapters.confined import read_confined
from quiver_server.adapters.size_limits import OTHER_FILES
from quiver_server.bounded_text import clipped
from quiver_server.grammar.errors import GrammarError

TOKENIZER_FILE = "tokenizer.json"
MAX_REASON_CHARS = 200


@dataclass(frozen=True)
class TokenizerSource:
    """Where a tokenizer comes from. `key` identifies the file for the caches (it may hold a
    server path: never shown to clients); `read` returns its bytes."""

    key: str
    read: Callable[[], bytes | None] = field(compare=False, repr=False)
    what: str = "the model"  # how messages name it: "the model" or "adapter 'x'"


def base_source(model_dir: Path) -> TokenizerSource:
    def read() -> bytes | None:
        path = model_dir / TOKENIZER_FILE
        return path.read_bytes() if path.is_file() else None

    return TokenizerSource(key="base", read=read)


def adapter_source(adapter_id: str, directory: Path, root: Path) -> TokenizerSource | None:
    """The adapter's own tokenizer, None when its directory has none (it then uses the base's).
    The file is read only if it resolves inside `root`, like every file of an adapter."""
    if not (directory / TOKENIZER_FILE).exists():
        return None
    return TokenizerSource(
        key=f"adapter:{directory}",
        read=lambda: read_confined(directory, TOKENIZER_FILE, root, OTHER_FILES),
        what=f"adapter {adapter_id!r}",
    )


class TokenizerCache:
    """LLTokenizers by (source, EOS ids). `n_vocab` is the model's logits width: masks cover
    every logit, and ids past the tokenizer's vocabulary are never allowed."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self._built: dict[tuple[str, tuple[int, ...]], llguidance.LLTokenizer] = {}
        self._building: dict[tuple[str, tuple[int, ...]], threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, source: TokenizerSource, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
        key = (source.key, eos_token_ids)
        with self._lock:
            built = self._built.get(key)
            if built is not None:
                return built
            # One build per key; builds of other keys go on meanwhile.
            building = self._building.setdefault(key, threading.Lock())
        with building:
            with self._lock:
                built = self._built.get(key)
            if built is None:
                built = self._build(source, eos_token_ids)
                with self._lock:
                    self._built[key] = built
        return built

    def forget(self, source_key: str) -> None:
        """Drops the tokenizers of a source (an unloaded adapter: its directory may change)."""
        with self._lock:
            for key in [k for k in self._built if k[0] == source_key]:
                del self._built[key]

    def _build(self, source: TokenizerSource, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
        try:
            data = source.read()
        except ValueError as error:  # read_confined's refusals name no path
            raise GrammarError(f"the tokenizer of {source.what} cannot be read: {error}") from None
        if data is None:
            raise GrammarError(f"{source.what} has no {TOKENIZER_FILE}, which constrained decoding needs")
        try:
            return llguidance.LLTokenizer(data.decode(), n_vocab=self.n_vocab, eos_token=list(eos_token_ids))
        except (ValueError, UnicodeDecodeError) as error:
            # Cut short: llguidance may quote the file's text back.
            reason = clipped(str(error), MAX_REASON_CHARS)
            raise GrammarError(f"the tokenizer of {source.what} cannot be used for grammars: {reason}") from None
