"""What the engine and the service ask of the grammar package: is this Grammar well-formed,
compile it for a request's tokenizer and pin it under the router's id, hand each request under
that id its own matcher, and release the pin when the router says its requests are done."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import llguidance

from quiver_server.engine.batch_types import GRAMMAR_KINDS, GrammarSpec
from quiver_server.grammar.compiler import DEFAULT_BUDGET_S, DEFAULT_CACHE_SIZE, GrammarCompiler
from quiver_server.grammar.errors import GrammarError
from quiver_server.grammar.masks import GrammarMasks
from quiver_server.grammar.tokenizers import TokenizerCache, TokenizerSource, adapter_source, base_source

log = logging.getLogger(__name__)

# adapter id -> (its directory, what its files must resolve inside); None if not loaded.
AdapterLocator = Callable[[str], "tuple[Path, Path] | None"]


def validate_grammar(spec: GrammarSpec, vocab_size: int) -> None:
    """The checks that need no compile (GrammarError, a ValueError)."""
    if spec.kind not in GRAMMAR_KINDS:
        raise GrammarError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {spec.kind or 'none'}")
    if not spec.eos_token_ids:
        raise GrammarError("grammar eos_token_ids is empty: a constrained request could never end")
    for token in spec.eos_token_ids:
        if not 0 <= token < vocab_size:
            raise GrammarError(f"grammar eos token id {token} is out of range for vocab size {vocab_size}")


class Grammars:
    def __init__(
        self,
        model_dir: Path,
        vocab_size: int,
        locate_adapter: AdapterLocator,
        budget_s: float = DEFAULT_BUDGET_S,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self.vocab_size = vocab_size
        self._base = base_source(model_dir)
        self._locate_adapter = locate_adapter
        self.compiler = GrammarCompiler(TokenizerCache(vocab_size), budget_s, cache_size)
        self.masks = GrammarMasks(vocab_size)
        # grammar id -> its compiled prototype, out of the cache's reach until released.
        self._pinned: dict[int, llguidance.LLMatcher] = {}
        self._pins_lock = threading.Lock()

    def pin(self, grammar_id: int, adapter_id: str, spec: GrammarSpec) -> int:
        """Compiles `spec` for the tokenizer of `adapter_id` ("" = the base model), or finds it
        cached, and pins it under `grammar_id`; returns the ns spent compiling (0 when cached).
        A grammar that does not compile raises GrammarError and pins nothing. Thread-safe;
        meant for a compile thread."""
        if grammar_id <= 0:
            raise ValueError("a grammar is pinned under a positive id")
        validate_grammar(spec, self.vocab_size)
        prototype, spent = self.compiler.compile(self._source(adapter_id), spec)
        with self._pins_lock:
            self._pinned[grammar_id] = prototype
        return spent

    def release(self, grammar_ids: Iterable[int]) -> None:
        """Unpins grammars whose requests are all done (ids not pinned are ignored)."""
        with self._pins_lock:
            for grammar_id in grammar_ids:
                self._pinned.pop(grammar_id, None)

    def is_pinned(self, grammar_id: int) -> bool:
        with self._pins_lock:
            return grammar_id in self._pinned

    @property
    def pinned_count(self) -> int:
        with self._pins_lock:
            return len(self._pinned)

    def matcher(self, grammar_id: int, generated: Sequence[int] = ()) -> llguidance.LLMatcher:
        """A request's own matcher of the grammar pinned under `grammar_id`, past the tokens it
        `generated` before a preemption. Nothing is compiled here."""
        with self._pins_lock:
            prototype = self._pinned.get(grammar_id)
        if prototype is None:
            raise ValueError(f"grammar {grammar_id} is not pinned on this shard")
        matcher = prototype.deep_copy()
        if generated and not matcher.consume_tokens(list(generated)):
            # The router replays what this grammar allowed, so this is a bug somewhere; the
            # request can then only end (EOS), as with any matcher in its error state.
            log.warning("a resumed request's tokens do not fit its grammar: %s", matcher.get_error())
        return matcher

    def forget_adapter(self, adapter_id: str) -> None:
        """Drops what was built for an adapter's own tokenizer (called before it is unloaded)."""
        source = self._adapter_source(adapter_id)
        if source is not None:
            self.compiler.forget(source.key)
            self.compiler.tokenizers.forget(source.key)

    def _source(self, adapter_id: str) -> TokenizerSource:
        if not adapter_id:
            return self._base
        if self._locate_adapter(adapter_id) is None:
            raise GrammarError(f"adapter {adapter_id!r} is not loaded")
        return self._adapter_source(adapter_id) or self._base

    def _adapter_source(self, adapter_id: str) -> TokenizerSource | None:
        located = self._locate_adapter(adapter_id) if adapter_id else None
        return adapter_source(adapter_id, *located) if located is not None else None
