"""Bad structured-output and tool input is refused before any generation: an OpenAI-shaped 400
naming the offending field in `param`, and the server keeps serving (a valid constrained request
right after each refusal, and one running beside them all, still succeed).

A schema too big for the grammar engine's budget is one of them: an enum of 200,000 strings
makes llguidance's initial lexer exceed its size limit (checked with
`llguidance.LLMatcher(...).get_error()` on this tier's tokenizer: "initial lexer configuration
(grammar) too big"), and the body still fits the router's 4 MiB limit."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from reliability_checks import MAX_MESSAGE_BYTES
from structured_checks import (
    CHAT,
    MODELS,
    json_schema_format,
    load_schema,
    post,
    start_structured_stack,
    validate,
)

BASE = MODELS[0]
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                   "required": ["city"], "additionalProperties": False}}}
HUGE_ENUM = {"enum": [f"value-{i}" for i in range(200_000)]}

# (name, extra body fields, expected param: exact, or a prefix ending in "*").
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("invalid-schema-type", {"response_format": json_schema_format("bad", {"type": "strin"})}, "response_format"),
    ("schema-not-an-object", {"response_format": json_schema_format("bad", "string")}, "response_format"),  # type: ignore[arg-type]
    ("unknown-response-format", {"response_format": {"type": "xml"}}, "response_format"),
    ("json-schema-without-schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("json-schema-missing", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("schema-over-budget", {"response_format": json_schema_format("huge", HUGE_ENUM)}, "response_format"),
    ("regex-does-not-compile", {"structured_outputs": {"regex": "([a-z]"}}, "structured_outputs"),
    ("lark-does-not-parse", {"structured_outputs": {"grammar": "start: foo(\n"}}, "structured_outputs"),
    ("two-constraints", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("empty-structured-outputs", {"structured_outputs": {}}, "structured_outputs"),
    ("guided-regex-does-not-compile", {"guided_regex": "[a-"}, "guided_regex"),
    ("guided-json-invalid", {"guided_json": {"type": "strin"}}, "guided_json"),
    ("tool-choice-undeclared", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("tool-choice-without-tools", {"tool_choice": "required"}, "tool*"),
    ("tool-without-name", {"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}],
                           "tool_choice": "required"}, "tools*"),
    ("tool-bad-parameters", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "strin"}}}], "tool_choice": "required"}, "tools*"),
    ("tool-not-a-function", {"tools": [{"type": "banana"}]}, "tools*"),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = start_structured_stack(tmp_path_factory, "structured-errors")
    yield stack
    stack.stop()


def valid_request(stack) -> None:
    schema = load_schema("person")
    response = post(stack, "/v1/chat/completions", {
        "model": BASE, "messages": CHAT, "max_tokens": 400, "temperature": 0,
        "response_format": json_schema_format("person", schema)})
    validate(schema, response["choices"][0]["message"]["content"])


@pytest.mark.parametrize(("extra", "param"), [(extra, param) for _, extra, param in BAD], ids=[n for n, _, _ in BAD])
def test_bad_input_is_a_400_with_param(stack, extra, param):
    body = {"model": BASE, "messages": CHAT, "max_tokens": 16, **extra}
    status, response = stack.post_json("/v1/chat/completions", body, timeout=120)
    assert status == 400, (status, response)
    error = response["error"]
    assert error["type"] == "invalid_request_error", error
    if param.endswith("*"):
        assert (error["param"] or "").startswith(param[:-1]), error
    else:
        assert error["param"] == param, error
    assert "/tmp" not in error["message"] and "/work" not in error["message"], error
    valid_request(stack)


def test_bad_response_format_on_completions(stack):
    body = {"model": BASE, "prompt": "x", "max_tokens": 4,
            "response_format": json_schema_format("x", {"type": "strin"})}
    status, response = stack.post_json("/v1/completions", body, timeout=120)
    assert status == 400, response
    assert response["error"]["param"] == "response_format", response


def test_refusals_beside_a_running_request(stack):
    """Refusals do not disturb a constrained request in flight."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        running = pool.submit(valid_request, stack)
        refusals = [pool.submit(stack.post_json, "/v1/chat/completions",
                                {"model": BASE, "messages": CHAT, "max_tokens": 16, **extra}, 120)
                    for name, extra, _ in BAD if name != "schema-over-budget"]
        assert all(future.result()[0] == 400 for future in refusals)
        running.result()


# Each about 200 KB of the client's own text inside an input the server refuses (issue 48: the
# refusals once quoted it whole, an 800 KB body for a 200 KB regex).
LONG = 200_000
ECHOING: list[tuple[str, str, dict[str, Any]]] = [
    ("regex", "/v1/chat/completions", {"structured_outputs": {"regex": "(" * LONG}}),
    ("lark", "/v1/chat/completions", {"structured_outputs": {"grammar": "start: " + "foo(" * (LONG // 4)}}),
    ("schema", "/v1/chat/completions", {"response_format": json_schema_format("x", {"type": "s" * LONG})}),
    ("role", "/v1/chat/completions", {"messages": [{"role": "r" * LONG, "content": "hi"}]}),
    ("tool-choice", "/v1/chat/completions", {"tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "n" * LONG}}}),
]


@pytest.mark.parametrize(("path", "extra"), [(path, extra) for _, path, extra in ECHOING],
                         ids=[name for name, _, _ in ECHOING])
def test_a_refusal_never_echoes_unbounded_input(stack, path, extra):
    body = {"model": BASE, "messages": CHAT, "max_tokens": 16, **extra}
    status, response = stack.post_json(path, body, timeout=120)
    assert status == 400, (status, str(response)[:300])
    message = response["error"]["message"]
    assert len(message.encode()) <= MAX_MESSAGE_BYTES, f"{len(message.encode())} bytes: {message[:300]}"
    assert "bytes cut" in message, message
    valid_request(stack)
