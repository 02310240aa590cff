"""Every bad input of issue 2 gets OpenAI's error object with 400/404 and a message that names
the problem; the server goes on serving right after each."""

from __future__ import annotations

import json

import openai
import pytest

import openai_schema
from conftest import MAX_INPUT_TOKENS, MAX_TOTAL_TOKENS

HELLO = [{"role": "user", "content": "Hello"}]


def _chat(model: str, **overrides) -> tuple[str, dict]:
    return "/chat/completions", {"model": model, "messages": HELLO, "max_tokens": 4, **overrides}


def _completion(model: str, **overrides) -> tuple[str, dict]:
    return "/completions", {"model": model, "prompt": "Hello", "max_tokens": 4, **overrides}


def _without(request: tuple[str, dict], key: str) -> tuple[str, dict]:
    path, body = request
    return path, {k: v for k, v in body.items() if k != key}


BAD = openai.BadRequestError
MISSING = openai.NotFoundError

# (case id, request builder, expected SDK exception, words one of which the message must hold,
#  what OpenAI's `param` field must start with)
CASES = [
    ("messages-wrong-type", lambda m: _chat(m, messages="Hello"), BAD, ["messages"], "messages"),
    ("max-tokens-wrong-type", lambda m: _chat(m, max_tokens="ten"), BAD, ["max_tokens"], "max_tokens"),
    ("temperature-wrong-type", lambda m: _completion(m, temperature="hot"), BAD, ["temperature"],
     "temperature"),
    ("prompt-wrong-type", lambda m: _completion(m, prompt={"text": "Hello"}), BAD, ["prompt"], "prompt"),
    ("missing-messages", lambda m: _without(_chat(m), "messages"), BAD, ["messages"], "messages"),
    ("missing-prompt", lambda m: _without(_completion(m), "prompt"), BAD, ["prompt"], "prompt"),
    ("empty-messages", lambda m: _chat(m, messages=[]), BAD, ["messages"], "messages"),
    ("unknown-role", lambda m: _chat(m, messages=[{"role": "wizard", "content": "hi"}]),
     BAD, ["wizard"], "messages"),
    # The tiny model's template raises for a system message after the first message.
    ("template-raises", lambda m: _chat(m, messages=HELLO + [{"role": "system", "content": "x"}]),
     BAD, ["system message must come first"], "messages"),
    ("prompt-too-long", lambda m: _completion(m, prompt="hello " * (MAX_INPUT_TOKENS + 8)),
     BAD, ["input tokens", "max-input-tokens", "max_input_tokens"], "prompt"),
    ("chat-prompt-too-long",
     lambda m: _chat(m, messages=[{"role": "user", "content": "hello " * (MAX_INPUT_TOKENS + 8)}]),
     BAD, ["input tokens", "max-input-tokens", "max_input_tokens"], "messages"),
    ("max-tokens-beyond-total", lambda m: _completion(m, max_tokens=MAX_TOTAL_TOKENS),
     BAD, ["max_tokens"], "max_tokens"),
    ("max-completion-tokens-beyond-total",
     lambda m: _without(_chat(m, max_completion_tokens=MAX_TOTAL_TOKENS), "max_tokens"),
     BAD, ["max_completion_tokens"], "max_completion_tokens"),
    ("temperature-above-2", lambda m: _chat(m, temperature=2.5), BAD, ["temperature"], "temperature"),
    ("temperature-negative", lambda m: _completion(m, temperature=-0.1), BAD, ["temperature"],
     "temperature"),
    ("top-p-zero", lambda m: _chat(m, top_p=0), BAD, ["top_p"], "top_p"),
    ("top-p-above-1", lambda m: _completion(m, top_p=1.5), BAD, ["top_p"], "top_p"),
    ("presence-penalty-above-2", lambda m: _chat(m, presence_penalty=2.5), BAD, ["presence_penalty"],
     "presence_penalty"),
    ("logit-bias-unknown-token", lambda m: _completion(m, logit_bias={"100000": 1}), BAD, ["100000"],
     "logit_bias"),
    ("seventeen-stops", lambda m: _completion(m, stop=[f"s{i}" for i in range(17)]), BAD, ["16"], "stop"),
    ("json-schema-invalid", lambda m: _chat(m, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}), BAD,
     ["response_format", "strin"], "response_format"),
    ("unknown-model-chat", lambda m: _chat("no-such-model"), MISSING, ["no-such-model"], "model"),
    ("unknown-model-completion", lambda m: _completion("no-such-model"), MISSING, ["no-such-model"],
     "model"),
]


def _assert_still_serving(client, model: str) -> None:
    response = client.chat.completions.create(model=model, messages=HELLO, max_tokens=2)
    assert response.choices[0].finish_reason in ("stop", "length")


def _assert_error_body(body: dict, status: int, words: list[str], context: str,
                       param: str | None = None) -> None:
    openai_schema.validate(body, "ErrorResponse")
    if param is not None:
        assert (body["error"]["param"] or "").startswith(param), f"{context}: {body}"
    message = body["error"]["message"]
    assert any(w.lower() in message.lower() for w in words), (
        f"{context}: message {message!r} names none of {words}"
    )
    assert body["error"]["type"], context
    if status == 404:
        assert body["error"]["type"] in ("invalid_request_error", "not_found_error"), body


@pytest.mark.parametrize("name,build,error,words,param", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_bad_input_gets_openai_error_and_server_keeps_serving(client, llama, name, build, error,
                                                             words, param, stream):
    path, body = build(llama.model)
    if stream:
        # Refused before the stream starts: a plain error response, not an SSE event.
        body = {**body, "stream": True}
    with pytest.raises(error) as caught:
        client.post(path, body=body, cast_to=object)
    status = 404 if error is openai.NotFoundError else 400
    assert caught.value.status_code == status
    _assert_error_body(caught.value.response.json(), status, words, name, param)
    _assert_still_serving(client, llama.model)


@pytest.mark.parametrize(
    "raw",
    [b"{", b'{"model": "x", "messages": [}', b"not json at all", b"[1, 2, 3]", b""],
    ids=["unterminated", "bad-array", "not-json", "not-an-object", "empty"],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_malformed_json_gets_400_in_openai_shape(client, llama, raw, path):
    status, body = llama.stack.post_raw(path, raw)
    assert status == 400, (status, body)
    words = ["json", "body", "expected", "parse", "invalid", "syntax", "eof"]
    _assert_error_body(json.loads(body), status, words, f"{path} {raw!r}")
    _assert_still_serving(client, llama.model)


def test_wrong_content_type_still_answers_in_openai_shape(client, llama):
    status, body = llama.stack.post_raw("/v1/chat/completions", b"model=x", content_type="text/plain")
    assert 400 <= status < 500, status
    openai_schema.validate(json.loads(body), "ErrorResponse")
    _assert_still_serving(client, llama.model)


def test_unknown_fields_are_named_refused_ones_refused_and_known_extras_accepted(client, llama):
    """Nothing is silently ignored (docs/api.md, field by field): a field quiver does not know is
    accepted without effect and named in the `quiver-ignored-fields` header; another server's
    extension a client relies on is a 400 naming it; fields OpenAI clients send that have no
    effect here are accepted without a header."""
    raw = client.chat.completions.with_raw_response.create(
        model=llama.model, messages=HELLO, max_tokens=2, extra_body={"some_vendor_field": {"x": 1}})
    assert raw.headers.get("quiver-ignored-fields") == "some_vendor_field"
    assert raw.parse().choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=llama.model, messages=HELLO, max_tokens=2,
                                       extra_body={"grammar": {"type": "json", "value": {}}})
    error = refused.value.response.json()["error"]
    assert error["param"] == "grammar"
    assert error["code"] == "unsupported_parameter"
    raw = client.chat.completions.with_raw_response.create(
        model=llama.model, messages=HELLO, max_tokens=2, user="u", metadata={"k": "v"}, store=False,
        extra_body={"some_vendor_field": None},
    )
    assert "quiver-ignored-fields" not in raw.headers
    assert raw.parse().choices[0].finish_reason in ("stop", "length")
