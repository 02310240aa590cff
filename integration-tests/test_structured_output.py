"""`response_format: json_schema` through the whole stack, on random-weight models where only the
grammar can make the output valid: for every schema of testdata/structured/ (nested objects,
bounded arrays, enums, ranges, optional fields, patterns and formats, anyOf, $ref/$defs, const,
nullable, additionalProperties false), on the base model, a LoRA adapter and an adapter with its
own tokenizer, streamed and not, the text parses and validates with `jsonschema` (Draft 2020-12,
formats checked) and ends with finish_reason "stop".

All of those requests run at once, together with unconstrained greedy requests of every model:
constrained and free requests of different adapters share batches, and the free ones must return
exactly what they return alone."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from client_streams import join_chat
from structured_checks import (
    CHAT,
    MAX_TOKENS,
    MODELS,
    json_schema_format,
    load_schema,
    post,
    schema_names,
    start_structured_stack,
    stream_chat,
    validate,
)

SCHEMAS = schema_names()
CASES = list(itertools.product(SCHEMAS, MODELS, [False, True]))
FREE_MAX_TOKENS = 24
FREE_CHAT = [{"role": "user", "content": "Tell me a story."}]


def test_the_corpus_is_large_enough():
    assert len(SCHEMAS) >= 20, SCHEMAS


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = start_structured_stack(tmp_path_factory, "structured-output")
    yield stack
    stack.stop()


def constrained_body(name: str, model: str) -> dict[str, Any]:
    return {"model": model, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "response_format": json_schema_format(name, load_schema(name))}


def free_body(model: str) -> dict[str, Any]:
    # ignore_eos: every free request runs its full length, so parity covers FREE_MAX_TOKENS steps.
    return {"model": model, "messages": FREE_CHAT, "max_tokens": FREE_MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}


def run_case(stack, case: tuple[str, str, bool]) -> tuple[str, str | None]:
    """(text, finish_reason) of one constrained request."""
    name, model, streamed = case
    body = constrained_body(name, model)
    if streamed:
        joined = join_chat(stream_chat(stack, body))
        return joined.text, joined.finish_reasons[-1] if joined.finish_reasons else None
    choice = post(stack, "/v1/chat/completions", body)["choices"][0]
    assert not choice["message"].get("tool_calls"), choice
    return choice["message"]["content"], choice["finish_reason"]


def free_text(stack, model: str) -> str:
    return post(stack, "/v1/chat/completions", free_body(model))["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def runs(stack) -> dict[str, Any]:
    """Every constrained case and every model's free request, issued concurrently; the free
    requests also run alone first, as the reference for what they return in mixed batches."""
    alone = {model: free_text(stack, model) for model in MODELS}
    with ThreadPoolExecutor(max_workers=32) as pool:
        free = {model: pool.submit(free_text, stack, model) for model in MODELS}
        cases = {case: pool.submit(run_case, stack, case) for case in CASES}
        # The free requests again, once the constrained ones are in flight.
        free_again = {model: pool.submit(free_text, stack, model) for model in MODELS}
        return {
            "alone": alone,
            "mixed": {model: [free[model], free_again[model]] for model in MODELS},
            "cases": cases,
        }


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-{m}-{'stream' if s else 'plain'}" for n, m, s in CASES])
def test_output_validates(runs, case):
    text, finish_reason = runs["cases"][case].result()
    validate(load_schema(case[0]), text)
    assert finish_reason == "stop", f"{case}: finish_reason {finish_reason}, text {text!r}"


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize("model", MODELS)
def test_streamed_equals_plain(runs, name, model):
    """Greedy under a grammar is deterministic: the stream spells what the plain request got."""
    plain, _ = runs["cases"][(name, model, False)].result()
    streamed, _ = runs["cases"][(name, model, True)].result()
    assert streamed == plain


@pytest.mark.parametrize("model", MODELS)
def test_free_requests_unchanged_in_mixed_batches(runs, model):
    for future in runs["mixed"][model]:
        assert future.result() == runs["alone"][model], f"{model}: free greedy text changed beside constrained requests"


def test_constrained_output_differs_from_free(stack):
    """The grammar really constrains: unconstrained, the random model does not write JSON."""
    body = {**constrained_body("person", MODELS[0]), "max_tokens": 40, "response_format": {"type": "text"}}
    text = post(stack, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    with pytest.raises(AssertionError):
        validate(load_schema("person"), text)


def test_mask_cost_is_exported(stack, runs):
    """The router exports the shard's per-step grammar cost as a Prometheus histogram."""
    for future in runs["cases"].values():
        future.result()
    metrics = stack.metrics()
    counts = [value for series, value in metrics.items() if series.startswith("quiver_grammar_mask_seconds_count")]
    assert counts and sum(counts) > 0, sorted(s for s in metrics if "grammar" in s)
