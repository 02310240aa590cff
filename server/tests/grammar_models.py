"""A tiny random-weight model with a real byte-level BPE tokenizer, and a router-like driver that
runs requests to their end, for the constrained-decoding tests.

The tokenizer is the demo model's trainer (an input to both sides); outputs are decoded with the
`tokenizers` library, which knows nothing of llguidance, and checked against `jsonschema`/`re`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path

from block_tables import Blocks
from tiny_models import build_tiny_model
from tokenizers import Tokenizer

from quiver_server.engine.batch_types import GrammarSpec, RequestSpec, SamplingParams
from quiver_server.tiny_model import train_tokenizer
from quiver_server.engine.engine import Engine

TOKENIZER_VOCAB = 400
# Wider than the tokenizer, as real models pad their embeddings: ids past it must never be allowed.
MODEL_VOCAB = 416
EOS = 2  # <|im_end|> (the demo tokenizer's special tokens are ids 0-2)
CACHE_GIB = 0.02


def build_grammar_model(directory: Path, seed: int = 0) -> tuple[Path, Tokenizer]:
    """A tiny Llama whose directory holds a trained tokenizer.json."""
    tokenizer = train_tokenizer(TOKENIZER_VOCAB)
    path = build_tiny_model(directory, "llama", seed=seed, vocab_size=MODEL_VOCAB, bos_token_id=0, eos_token_id=EOS)
    tokenizer.save(str(path / "tokenizer.json"))
    return path, tokenizer


def permuted_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """The same tokens under other ids (the ordinary ones reversed, special ids kept): an id of
    one maps to a different string in the other."""
    data = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    ordinary = sorted(i for i in vocab.values() if i > EOS)
    remap = dict(zip(ordinary, reversed(ordinary), strict=True))
    data["model"]["vocab"] = {token: remap.get(i, i) for token, i in vocab.items()}
    return Tokenizer.from_str(json.dumps(data))


def new_engine(path: Path, **kwargs: object) -> Engine:
    engine = Engine(str(path), "tiny", dtype="float32", device="cpu", cpu_kv_cache_gib=CACHE_GIB, **kwargs)  # type: ignore[arg-type]
    engine.warmup(max_batch_prefill_tokens=512, max_total_tokens=512, max_batch_size=16)
    return engine


def json_grammar(schema: object) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema), (EOS,))


# Grammar ids as the router hands them out, and what each one stands for until it is pinned.
_GRAMMAR_IDS = itertools.count(1)
_UNPINNED: dict[int, tuple[str, GrammarSpec]] = {}


def request(
    rid: int,
    prompt: Sequence[int],
    blocks: Blocks,
    max_new_tokens: int = 160,
    grammar: GrammarSpec | None = None,
    adapter_id: str = "",
    **sampling: object,
) -> RequestSpec:
    """A request; its grammar gets an id of its own, pinned by `pin` (which `generate` calls)."""
    grammar_id = 0
    if grammar is not None:
        grammar_id = next(_GRAMMAR_IDS)
        _UNPINNED[grammar_id] = (adapter_id, grammar)
    return RequestSpec(
        id=rid, input_ids=list(prompt), blocks=blocks.table(len(prompt) + max_new_tokens),
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
        max_new_tokens=max_new_tokens, adapter_id=adapter_id, grammar_id=grammar_id,
    )


def pin(engine: Engine, requests: list[RequestSpec]) -> list[RequestSpec]:
    """Compiles and pins the requests' grammars on `engine`, as the router's CompileGrammar does
    before their Prefill."""
    for r in requests:
        if r.grammar_id in _UNPINNED:
            adapter_id, grammar = _UNPINNED.pop(r.grammar_id)
            engine.grammars.pin(r.grammar_id, adapter_id, grammar)
    return requests


def generate(
    engine: Engine, requests: list[RequestSpec], batch_id: int = 1, steps: int | None = None
) -> dict[int, list[int]]:
    """Runs `requests` as one batch as the router would: their grammars pinned first and released
    at the end; a request leaves the batch after EOS or its max_new_tokens (or after `steps`
    tokens, to preempt it). Returns each one's tokens."""
    limits = {r.id: r.max_new_tokens if steps is None else min(steps, r.max_new_tokens) for r in requests}
    out: dict[int, list[int]] = {r.id: [] for r in requests}
    # What this call pins it releases; a grammar pinned by the caller stays pinned.
    pinned_here = [r.grammar_id for r in requests if r.grammar_id in _UNPINNED]
    step = engine.prefill(batch_id, pin(engine, requests))
    while True:
        for generation in step.generations:
            out[generation.request_id].append(generation.token_id)
        running = [rid for rid in step.request_ids if out[rid][-1] != EOS and len(out[rid]) < limits[rid]]
        if not running:
            engine.clear_cache(batch_id)
            engine.grammars.release(pinned_here)
            return out
        engine.filter_batch(batch_id, running)
        step = engine.decode([batch_id])


def text(tokenizer: Tokenizer, tokens: list[int]) -> str:
    """The output's text without its final EOS (which the grammar requires: the output ended)."""
    assert tokens and tokens[-1] == EOS, f"the output did not end with EOS: {tokens}"
    return tokenizer.decode(tokens[:-1], skip_special_tokens=False)
