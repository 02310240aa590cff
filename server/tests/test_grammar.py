"""Constrained decoding on a random-weight model, where only the grammar can make output valid:
every output parses and validates against its JSON schema (`jsonschema`), matches its regex or
Lark grammar (`re.fullmatch`), greedy and sampled; free rows of a mixed batch get exactly their
tokens alone; a resumed request goes on with the same tokens; logprobs stay raw; bad grammars
are errors that say why."""

from __future__ import annotations


import dataclasses
import json
import math
import re
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from block_tables import Blocks
from bounded_messages import cut_parts
from grammar_models import EOS, build_grammar_model, generate, json_grammar, new_engine, pin, request, text
from tokenizers import Tokenizer

from quiver_server.engine.batch_types import GrammarSpec
from quiver_server.bounded_text import MAX_MESSAGE_BYTES
from quiver_server.engine.engine import Engine
from quiver_server.grammar import GrammarError

PROMPT = [5, 6, 7, 8, 9, 10, 11]

NAME = {"type": "string", "minLength": 1, "maxLength": 8}
SCHEMAS: dict[str, dict] = {
    "json_mode": {"type": "object", "properties": {}, "additionalProperties": False},
    "flat": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "name": NAME},
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array_bounds": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 4}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum": {"enum": ["red", "green", "blue", 7, None]},
    "number_range": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "count": {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 10},
        },
        "required": ["score", "count"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": NAME, "c": {"type": "null"}},
        "required": ["a"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "any_of": {
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 50},
            {"type": "object", "properties": {"x": NAME}, "required": ["x"], "additionalProperties": False},
        ]
    },
    "ref_defs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                               "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {"$ref": "#/$defs/item"},
        "minItems": 1,
        "maxItems": 3,
        "$defs": {
            "item": {
                "type": "object",
                "properties": {"k": {"enum": ["x", "y"]}, "v": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["k", "v"],
                "additionalProperties": False,
            }
        },
    },
    "const_and_bool": {
        "type": "object",
        "properties": {"kind": {"const": "tool"}, "ok": {"type": "boolean"}},
        "required": ["kind", "ok"],
        "additionalProperties": False,
    },
}

SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "seeded": {"temperature": 1.0, "seed": 1234},
    "hot_top_k": {"temperature": 1.5, "top_k": 50, "seed": 7},
    # Penalties and a bias towards a token the grammar forbids: the mask still wins.
    "penalised_biased": {"temperature": 0.8, "seed": 3, "repetition_penalty": 1.3, "presence_penalty": 0.5,
                         "frequency_penalty": 0.5, "logit_bias": {EOS: 50.0, 300: 30.0}},
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tokenizer]:
    return build_grammar_model(tmp_path_factory.mktemp("grammar-model"))


@pytest.fixture(scope="module")
def engine(model: tuple[Path, Tokenizer]) -> Engine:
    return new_engine(model[0])


def test_every_schema_and_sampling_gives_valid_json(engine: Engine, model: tuple[Path, Tokenizer]) -> None:
    """All schemas under each sampling mode in one batch (mixed grammars share a batch)."""
    tokenizer = model[1]
    for mode, sampling in SAMPLINGS.items():
        blocks = Blocks()
        names = list(SCHEMAS)
        requests = [
            request(rid, PROMPT, blocks, grammar=json_grammar(SCHEMAS[name]), **sampling)
            for rid, name in enumerate(names)
        ]
        outputs = generate(engine, requests)
        for rid, name in enumerate(names):
            output = text(tokenizer, outputs[rid])
            assert output == output.strip(), f"{mode}/{name}: free whitespace in {output!r}"
            jsonschema.validate(json.loads(output), SCHEMAS[name])


REGEXES = [
    r"(yes|no|maybe)",
    r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)",
    r"\d{3}-\d{4}",
    r"(ab|cd)+x{0,2}",
]
LARK = (
    'start: greeting " " name "!"?\n'
    'greeting: "hello" | "hi"\n'
    "name: /[A-Z][a-z]{1,6}/\n"
)
LARK_AS_REGEX = r"(hello|hi) [A-Z][a-z]{1,6}!?"


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_regex_and_lark_outputs_match(engine: Engine, model: tuple[Path, Tokenizer], sampling: str) -> None:
    blocks = Blocks()
    grammars = [GrammarSpec("regex", pattern, (EOS,)) for pattern in REGEXES] + [GrammarSpec("lark", LARK, (EOS,))]
    expected = REGEXES + [LARK_AS_REGEX]
    # bounded so a random model's `+` ends: the regex allows EOS as soon as it matches
    requests = [request(rid, PROMPT, blocks, max_new_tokens=64, grammar=g, **SAMPLINGS[sampling])
                for rid, g in enumerate(grammars)]
    outputs = generate(engine, requests)
    for rid, pattern in enumerate(expected):
        tokens = outputs[rid]
        if tokens[-1] != EOS:  # `(ab|cd)+` may go on to max_new_tokens: still a valid prefix
            assert len(tokens) == 64 and rid == 3
            assert re.fullmatch(r"(ab|cd)*(a|c)?", model[1].decode(tokens)), model[1].decode(tokens)
            continue
        assert re.fullmatch(pattern, text(model[1], tokens)), (pattern, text(model[1], tokens))


def test_free_rows_of_a_mixed_batch_get_their_tokens_alone(engine: Engine) -> None:
    free: dict[str, dict[str, Any]] = {"greedy": {}, "seeded": {"temperature": 0.9, "seed": 99}}
    alone = {}
    for rid, (name, sampling) in enumerate(free.items()):
        alone[name] = generate(engine, [request(rid, PROMPT, Blocks(), max_new_tokens=24, **sampling)])[rid]
    constrained = json_grammar(SCHEMAS["nested"])
    grammar_alone = generate(engine, [request(9, PROMPT, Blocks(), grammar=constrained)])[9]
    blocks = Blocks()
    mixed = generate(engine, [
        request(0, PROMPT, blocks, max_new_tokens=24, **free["greedy"]),
        request(9, PROMPT, blocks, grammar=constrained),
        request(1, PROMPT, blocks, max_new_tokens=24, **free["seeded"]),
    ])
    assert mixed[0] == alone["greedy"]
    assert mixed[1] == alone["seeded"]
    assert mixed[9] == grammar_alone


def test_grammar_rows_of_a_mixed_step_get_the_tokens_they_get_alone(
    engine: Engine, model: tuple[Path, Tokenizer]
) -> None:
    """A constrained request decodes while a mixed step carries another constrained request's
    prompt: both masks are filled beside the one forward pass, and each request's output is
    the one it gets alone, valid under its schema."""
    names = {1: "nested", 2: "ref_defs"}
    sampling = {1: {}, 2: {"temperature": 1.0, "seed": 11}}
    alone = {rid: generate(engine, [request(rid, PROMPT, Blocks(), grammar=json_grammar(SCHEMAS[name]),
                                            **sampling[rid])])[rid]
             for rid, name in names.items()}
    blocks = Blocks()
    first, second = (pin(engine, [request(rid, PROMPT, blocks, grammar=json_grammar(SCHEMAS[names[rid]]),
                                          **sampling[rid])])[0] for rid in names)
    out: dict[int, list[int]] = {1: [], 2: []}

    def record(generations) -> None:  # noqa: ANN001
        for g in generations:
            out[g.request_id].append(g.token_id)

    record(engine.prefill(1, [first]).generations)
    decoded, prefilled = engine.mixed_step([1], 2, [second])
    assert decoded.grammar_ns > 0
    record(decoded.generations)
    record(prefilled.generations)
    while True:
        running = [rid for rid in engine.batches[1].request_ids
                   if out[rid][-1] != EOS and len(out[rid]) < first.max_new_tokens]
        if not running:
            break
        engine.filter_batch(1, running)
        record(engine.decode([1]).generations)
    engine.clear_cache(1)
    engine.grammars.release([first.grammar_id, second.grammar_id])
    assert out == alone
    for rid, name in names.items():
        jsonschema.validate(json.loads(text(model[1], out[rid])), SCHEMAS[name])


def test_a_resumed_request_goes_on_with_the_same_tokens(engine: Engine, model: tuple[Path, Tokenizer]) -> None:
    grammar = json_grammar(SCHEMAS["array_of_objects"])
    for sampling in ({}, {"temperature": 1.0, "seed": 5, "frequency_penalty": 0.4}):
        whole = generate(engine, [request(1, PROMPT, Blocks(), grammar=grammar, **sampling)])[1]
        cut = len(whole) // 2
        first = generate(engine, [request(1, PROMPT, Blocks(), grammar=grammar, **sampling)], steps=cut)[1]
        assert first == whole[:cut]
        resumed = request(1, PROMPT + first, Blocks(), max_new_tokens=160 - cut, grammar=grammar,
                          draws_done=cut, **sampling)
        rest = generate(engine, [resumed])[1]
        assert first + rest == whole
        jsonschema.validate(json.loads(text(model[1], whole)), SCHEMAS["array_of_objects"])


def test_logprobs_stay_raw(engine: Engine) -> None:
    """The grammar's token has the logprob the unconstrained model gives it after the same prompt
    (read as a prompt logprob of prompt + token, no grammar involved)."""
    grammar = json_grammar(SCHEMAS["flat"])
    step = engine.prefill(1, pin(engine, [request(1, PROMPT, Blocks(), grammar=grammar, top_logprobs=3)]))
    engine.clear_cache(1)
    token, logprob = step.generations[0].token_id, step.generations[0].logprob
    assert step.grammar_ns > 0
    plain = request(2, PROMPT + [token], Blocks(), max_new_tokens=1)
    check = engine.prefill(2, [dataclasses.replace(plain, prompt_logprobs=0)])
    engine.clear_cache(2)
    assert math.isclose(check.generations[0].prompt_logprobs[-1].logprob, logprob, abs_tol=1e-4)
    # The alternatives are the raw distribution's: the most likely first, whatever the grammar allows.
    tops = step.generations[0].top_logprobs
    assert tops[0].logprob >= logprob and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)


def test_grammar_time_is_reported_only_with_a_grammar(engine: Engine) -> None:
    blocks = Blocks()
    free = engine.prefill(1, [request(1, PROMPT, blocks)])
    assert free.grammar_ns == 0
    engine.decode([1])
    constrained = engine.prefill(2, pin(engine, [request(2, PROMPT, blocks, grammar=json_grammar(SCHEMAS["flat"]))]))
    assert 0 < constrained.grammar_ns <= constrained.forward_ns
    merged = engine.decode([1, 2])
    assert 0 < merged.grammar_ns <= merged.forward_ns
    engine.clear_cache()


def _error(engine: Engine, grammar: GrammarSpec) -> str:
    with pytest.raises(GrammarError) as caught:
        engine.grammars.pin(999, "", grammar)
    assert not engine.grammars.is_pinned(999)
    return str(caught.value)


def test_bad_grammars_are_errors_that_say_why(engine: Engine, model: tuple[Path, Tokenizer]) -> None:
    messages = {
        "invalid type": _error(engine, json_grammar({"type": "integr"})),
        "not json": _error(engine, GrammarSpec("json_schema", '{"type": "object"', (EOS,))),
        "not an object": _error(engine, GrammarSpec("json_schema", "[1, 2]", (EOS,))),
        "unsupported keyword": _error(engine, json_grammar({"type": "object", "dependentSchemas": {"a": {}}})),
        "unknown format": _error(engine, json_grammar({"type": "string", "format": "bogus-format"})),
        "bad regex": _error(engine, GrammarSpec("regex", "a(b", (EOS,))),
        "bad lark": _error(engine, GrammarSpec("lark", "start: missing_rule", (EOS,))),
        "no kind": _error(engine, GrammarSpec("", "x", (EOS,))),
        "eos out of range": _error(engine, GrammarSpec("regex", "x", (5000,))),
        "no eos": _error(engine, GrammarSpec("regex", "x", ())),
        # llguidance quotes the grammar back: 200 KB of it once came back whole (issue 48).
        "huge bad regex": _error(engine, GrammarSpec("regex", "[z-a" + "x" * 200_000, (EOS,))),
    }
    assert "integr" in messages["invalid type"]
    assert messages["not json"].startswith("the JSON schema is not valid JSON")
    assert "JSON object" in messages["not an object"]
    assert "dependentSchemas" in messages["unsupported keyword"]
    assert "bogus-format" in messages["unknown format"]
    assert "regex" in messages["bad regex"] and "unclosed group" in messages["bad regex"]
    assert "missing_rule" in messages["bad lark"]
    assert "kind" in messages["no kind"]
    assert "5000" in messages["eos out of range"]
    assert "eos_token_ids" in messages["no eos"]
    huge = messages["huge bad regex"]
    head, cut = cut_parts(huge)
    assert len(huge.encode()) <= MAX_MESSAGE_BYTES and "does not compile" in head and cut > 199_000
    for message in messages.values():
        assert str(model[0]) not in message and "/tmp" not in message, message
    # A refused grammar is never pinned, so a prefill naming it is a bad request (ValueError)
    # before any step.
    refused = request(1, PROMPT, Blocks(), grammar=json_grammar({"type": "integr"}))
    with pytest.raises(GrammarError, match="integr"):
        pin(engine, [refused])
    with pytest.raises(ValueError, match="not pinned"):
        engine.prefill(7, [refused])
    assert 7 not in engine.batches


def test_a_compile_over_the_time_budget_is_refused(model: tuple[Path, Tokenizer]) -> None:
    # Every build thread is held until the refusal came, so the build cannot finish within
    # the budget however fast it is or however the threads are scheduled.
    engine = new_engine(model[0], grammar_budget_s=0.05)
    compiler = engine.grammars.compiler
    release = threading.Event()
    holders = [compiler._builders.submit(release.wait) for _ in range(compiler._builders._max_workers)]
    try:
        message = _error(engine, json_grammar(SCHEMAS["nested"]))
    finally:
        release.set()
    assert message.startswith("grammar too complex") and "budget" in message
    for holder in holders:
        holder.result()
    # The build goes on once a thread is free and is cached: asking again succeeds.
    engine.grammars.compiler.budget_s = 60.0
    engine.grammars.pin(1, "", json_grammar(SCHEMAS["nested"]))


def test_compiles_are_cached_and_each_request_has_its_own_state(engine: Engine) -> None:
    grammar = GrammarSpec("regex", "cached-[0-9]{2}", (EOS,))
    assert engine.grammars.pin(1, "", grammar) > 0
    assert engine.grammars.pin(2, "", grammar) == 0
    engine.grammars.release([1, 2])
    # Two requests of the same grammar, both greedy on the same prompt: the same output, so
    # neither advanced the other's state.
    blocks = Blocks()
    outputs = generate(engine, [request(rid, PROMPT, blocks, grammar=grammar) for rid in (1, 2)])
    assert outputs[1] == outputs[2] and outputs[1][-1] == EOS


def test_a_pinned_grammar_outlives_the_cache_and_is_never_compiled_again(model: tuple[Path, Tokenizer]) -> None:
    """With room for one compiled grammar, another compile evicts the first from the cache; the
    request pinned under it still prefills (a resumed one too) from the pin, with no compile:
    the build threads are held, so any compile there would fail over its budget."""
    engine = new_engine(model[0], grammar_cache_size=1, grammar_budget_s=0.05)
    pinned_schema = json_grammar(SCHEMAS["array_of_objects"])
    engine.grammars.compiler.budget_s = 60.0
    engine.grammars.pin(1, "", pinned_schema)
    engine.grammars.pin(2, "", GrammarSpec("regex", "evicts-[0-9]", (EOS,)))
    engine.grammars.release([2])
    engine.grammars.compiler.budget_s = 0.05
    compiler = engine.grammars.compiler
    release = threading.Event()
    holders = [compiler._builders.submit(release.wait) for _ in range(compiler._builders._max_workers)]
    try:
        def run(prompt: list[int], steps: int | None, max_new_tokens: int = 160, **resume: int) -> list[int]:
            spec = dataclasses.replace(
                request(1, prompt, Blocks(), max_new_tokens=max_new_tokens, **resume), grammar_id=1
            )
            return generate(engine, [spec], steps=steps)[1]

        whole = run(PROMPT, None)
        cut = len(whole) // 2
        rest = run(PROMPT + whole[:cut], None, max_new_tokens=160 - cut, draws_done=cut)
    finally:
        release.set()
    for holder in holders:
        holder.result()
    assert whole[:cut] + rest == whole
    jsonschema.validate(json.loads(text(model[1], whole)), SCHEMAS["array_of_objects"])
    engine.grammars.release([1])
    assert engine.grammars.pinned_count == 0
    with pytest.raises(ValueError, match="grammar 1 is not pinned"):
        engine.prefill(3, [dataclasses.replace(request(1, PROMPT, Blocks()), grammar_id=1)])
