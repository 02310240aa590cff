"""Hostile traffic against chat and completions (issue 12): the bad-input corpus and
hypothesis-generated bodies are never answered with a 5xx and always in OpenAI's shape, and
afterwards the server has every KV block back and still gives transformers' greedy tokens.

(Schemathesis against quiver's own OpenAPI description, `GET /openapi.json`, belongs here
too; not done yet.)"""

from __future__ import annotations

import json
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reliability_bodies import requests
from reliability_checks import assert_base_matches_reference, assert_openai_answer, send, wait_idle
from reliability_corpus import Case, load_cases
from reliability_soak import scaled

# Ids only; the bodies are built with the served model's name once the stack is up.
CASE_IDS = [case.id for case in load_cases("$MODEL")]
CORPUS_ROUNDS = scaled(1)
FUZZ_EXAMPLES = scaled(150)


@lru_cache(maxsize=4)
def _cases(model: str) -> dict[str, Case]:
    return {case.id: case for case in load_cases(model)}


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_corpus_case_is_answered_in_openai_shape(llama, case_id):
    case = _cases(llama.model)[case_id]
    for _ in range(CORPUS_ROUNDS):
        answer = send(llama.stack, case.path, case.body, case.content_type)
        assert_openai_answer(case.path, answer, case.id)
        if case.expect_status is not None:
            assert answer.status == case.expect_status, f"{case.id}: {answer.status} {answer.body[:300]!r}"


# Reproducible in CI: the same examples every run (derandomize), no example database on disk,
# and no per-example deadline (a loaded 2-core box is slow, and time is not what is tested).
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(data=st.data())
def test_generated_bodies_are_answered_in_openai_shape(llama, data):
    path, body = data.draw(requests(llama.model), label="request")
    # allow_nan: a NaN or infinity in a body goes out as a bare literal, which is not JSON.
    answer = send(llama.stack, path, json.dumps(body, allow_nan=True).encode())
    assert_openai_answer(path, answer, f"{path} {body!r}")


def test_server_is_idle_and_correct_after_the_hostile_traffic(llama):
    """Runs after the two above (file order): nothing they sent left a block, a request or a
    wrong answer behind."""
    wait_idle(llama.stack)
    assert_base_matches_reference(llama.stack, llama.model, str(llama.model_dir))
    wait_idle(llama.stack)
