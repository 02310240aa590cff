"""A Grammar -> a prototype LLMatcher for one tokenizer, within a size/fuel and a time budget,
cached by (tokenizer, kind, text, EOS ids). Every request gets a `deep_copy()` of the prototype.

llguidance drops the GIL while it builds a matcher, so a build runs on a thread of its own while
the caller waits at most `budget_s`: a grammar that takes longer is refused as too complex
(its build finishes in the background, bounded by the fuel limits, and its result is kept for
the next asker). Compiles of the same key at the same time share one build.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

import llguidance

from quiver_server.engine.batch_types import GrammarSpec
from quiver_server.bounded_text import bounded
from quiver_server.grammar.errors import GrammarError
from quiver_server.grammar.tokenizers import TokenizerCache, TokenizerSource

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

log = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 5.0
DEFAULT_CACHE_SIZE = 256
KIND_NAMES = {"json_schema": "JSON schema", "regex": "regex", "lark": "Lark grammar"}
# JSON without free whitespace between tokens (API contract: compact output); a model cannot pad
# its output with spaces forever.
JSON_OVERRIDES: JsonCompileOptions = {"whitespace_flexible": False}

CacheKey = tuple[str, str, str, tuple[int, ...]]


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar (its JSON form) of a GrammarSpec; GrammarError if it is not one."""
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.text)
        except json.JSONDecodeError as error:
            raise GrammarError(f"the JSON schema is not valid JSON: {error}") from None
        except RecursionError:
            raise GrammarError("the JSON schema is nested too deeply") from None
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OVERRIDES)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.text)
    raise GrammarError(f"grammar kind must be one of {', '.join(KIND_NAMES)}, got {spec.kind or 'none'}")


class GrammarCompiler:
    def __init__(
        self,
        tokenizers: TokenizerCache,
        budget_s: float = DEFAULT_BUDGET_S,
        cache_size: int = DEFAULT_CACHE_SIZE,
        limits: llguidance.LLParserLimits | None = None,
        build_threads: int = 2,
    ) -> None:
        if budget_s <= 0 or cache_size < 1:
            raise ValueError("the grammar compile budget and cache size must be positive")
        self.tokenizers = tokenizers
        self.budget_s = budget_s
        self.cache_size = cache_size
        # llguidance's defaults bound a grammar's size and each step's work; verbose errors would
        # dump parser state into the client's message.
        self.limits = limits or llguidance.LLParserLimits(verbose_errors=False)
        # A matcher, or the GrammarError of a grammar that does not compile (deterministic, so
        # asking again gets the same answer without the work).
        self._cache: OrderedDict[CacheKey, llguidance.LLMatcher | GrammarError] = OrderedDict()
        self._in_flight: dict[CacheKey, Future[llguidance.LLMatcher]] = {}
        self._lock = threading.Lock()
        self._builders = ThreadPoolExecutor(max_workers=build_threads, thread_name_prefix="quiver-grammar-build")

    def compile(self, source: TokenizerSource, spec: GrammarSpec) -> tuple[llguidance.LLMatcher, int]:
        """(the prototype matcher, ns this call spent compiling: 0 when cached). GrammarError
        when the grammar is invalid for the tokenizer, over the limits, or over the budget."""
        key: CacheKey = (source.key, spec.kind, spec.text, spec.eos_token_ids)
        cached = self._cached(key)
        if cached is not None:
            return cached, 0
        start = time.perf_counter_ns()
        # Outside the budget: built once per tokenizer, and no fault of this grammar.
        tokenizer = self.tokenizers.get(source, spec.eos_token_ids)
        grammar = llguidance_grammar(spec)
        with self._lock:
            future = self._in_flight.get(key)
            started = future is None
            if future is None:
                future = self._builders.submit(_build, tokenizer, grammar, self.limits, KIND_NAMES[spec.kind])
                self._in_flight[key] = future
        if started:
            # Outside the lock: a build already done runs the callback here, and it takes the lock.
            future.add_done_callback(lambda done: self._finished(key, done))
        try:
            matcher = future.result(timeout=self.budget_s)
        except FutureTimeout:
            log.warning("grammar compile over the %g s budget (%s, %d chars)", self.budget_s, spec.kind,
                        len(spec.text))
            raise GrammarError(
                f"grammar too complex: compiling it took longer than the server's budget of {self.budget_s:g} s"
            ) from None
        return matcher, time.perf_counter_ns() - start

    def forget(self, source_key: str) -> None:
        """Drops the cached grammars of a tokenizer source."""
        with self._lock:
            for key in [k for k in self._cache if k[0] == source_key]:
                del self._cache[key]

    def _cached(self, key: CacheKey) -> llguidance.LLMatcher | None:
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:
                return None
            self._cache.move_to_end(key)
        if isinstance(entry, GrammarError):
            raise entry
        return entry

    def _finished(self, key: CacheKey, future: Future[llguidance.LLMatcher]) -> None:
        error = None if future.cancelled() else future.exception()
        with self._lock:
            self._in_flight.pop(key, None)
            if future.cancelled() or (error is not None and not isinstance(error, GrammarError)):
                return
            self._cache[key] = error if isinstance(error, GrammarError) else future.result()
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)


def _build(
    tokenizer: llguidance.LLTokenizer, grammar: str, limits: llguidance.LLParserLimits, kind: str
) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    if not matcher.is_error():
        # The first mask: its lexer work is done here rather than in the first step, and a
        # grammar whose very first step is over the fuel limits is refused now.
        matcher.compute_bitmask()
    if matcher.is_error():
        # llguidance may quote the grammar back, and the grammar is the client's.
        raise GrammarError(bounded(f"the {kind} does not compile: {matcher.get_error()}"))
    return matcher
