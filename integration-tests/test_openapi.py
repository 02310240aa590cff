"""`GET /openapi.json` on the launched stack: a valid OpenAPI 3.1 document (openapi-spec-validator),
and quiver's real responses, bodies and every SSE chunk, successes and errors, validate against
the schema the document gives for that path, method, status and content type.

The check is closed: every object in a response must be fully described, so a field the server
sends but the document leaves out fails, as do a missing required field and a wrong type
(`test_the_check_catches_an_undocumented_a_missing_and_a_mistyped_field` proves it)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import jsonschema
import pytest
from openapi_spec_validator import validate as validate_spec
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

_URI = "urn:quiver-openapi"
HELLO = [{"role": "user", "content": "Hello"}]
SSE = "text/event-stream"
JSON = "application/json"


def _close(node: Any, in_all_of: bool = False) -> Any:
    """Every `$ref` outside an `allOf` also forbids properties its target does not evaluate
    (`unevaluatedProperties` sees through `$ref` and `allOf`, unlike `additionalProperties`)."""
    if isinstance(node, list):
        return [_close(item, in_all_of) for item in node]
    if not isinstance(node, dict):
        return node
    closed = {key: _close(value, key == "allOf") for key, value in node.items()}
    if "$ref" in closed and not in_all_of:
        closed["unevaluatedProperties"] = False
    return closed


def _escape(key: str) -> str:
    """`key` as one JSON-pointer segment."""
    return key.replace("~", "~0").replace("/", "~1")


class Document:
    def __init__(self, document: dict):
        self.raw = document
        resource = Resource.from_contents(_close(document), default_specification=DRAFT202012)
        self._registry = Registry().with_resource(_URI, resource)

    def schema(self, path: str, method: str, status: int, content_type: str) -> dict:
        responses = self.raw["paths"][path][method]["responses"]
        assert str(status) in responses, f"{method.upper()} {path} does not document {status}"
        content = responses[str(status)].get("content", {})
        assert content_type in content, f"{method.upper()} {path} {status}: no {content_type}"
        pointer = "/".join(["paths", _escape(path), method, "responses", str(status), "content",
                            _escape(content_type), "schema"])
        return {"$ref": f"{_URI}#/{pointer}", "unevaluatedProperties": False}

    def validate(self, instance: Any, path: str, method: str, status: int,
                 content_type: str = JSON) -> None:
        schema = self.schema(path, method, status, content_type)
        validator = jsonschema.Draft202012Validator(schema, registry=self._registry)
        errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path))
        assert not errors, (f"{method.upper()} {path} {status} does not match the document: "
                            + "; ".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
                            + f"\n{json.dumps(instance)[:2000]}")


def _request(base_url: str, method: str, path: str, payload: dict | None) -> tuple[int, str, bytes]:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(base_url + path, data=data, method=method.upper(),
                                 headers={"Content-Type": JSON})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.headers.get("content-type", ""), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("content-type", ""), err.read()


@pytest.fixture(scope="module")
def document(llama) -> Document:
    status, content_type, body = _request(llama.stack.base_url, "get", "/openapi.json", None)
    assert status == 200 and content_type.startswith(JSON)
    return Document(json.loads(body))


@pytest.fixture
def check(llama, document):
    """Sends a request and validates what came back against the document: one JSON body, or
    each `data:` event of a stream. Returns the status and the parsed body or events."""

    def check(method: str, path: str, payload: dict | None = None,
              doc_path: str | None = None) -> tuple[int, Any]:
        doc_path = doc_path or path
        status, content_type, body = _request(llama.stack.base_url, method, path, payload)
        if content_type.startswith(SSE):
            events = [line[len("data:"):].strip() for line in body.decode().splitlines()
                      if line.startswith("data:")]
            assert events[-1] == "[DONE]", events[-3:]
            chunks = [json.loads(event) for event in events[:-1]]
            assert chunks
            for chunk in chunks:
                document.validate(chunk, doc_path, method, status, SSE)
            return status, chunks
        if content_type.startswith(JSON):
            parsed = json.loads(body)
            document.validate(parsed, doc_path, method, status)
            return status, parsed
        assert document.raw["paths"][doc_path][method]["responses"].get(str(status)), status
        return status, body

    return check


def test_the_document_is_valid_openapi_3_1(document):
    validate_spec(document.raw)
    assert document.raw["openapi"].startswith("3.1.")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_responses_match_the_document(check, llama, stream):
    status, body = check("post", "/v1/chat/completions", {
        "model": llama.model, "messages": HELLO, "max_tokens": 6, "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
        "return_token_ids": True, "top_k": 5, "min_p": 0.0, "seed": -3, "stop": ["zz", "yy"],
    })
    assert status == 200
    if stream:
        assert body[0]["choices"][0]["delta"]["role"] == "assistant"
        assert body[-1]["usage"] and body[-1]["choices"] == []


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_completion_responses_match_the_document(check, llama, stream):
    status, body = check("post", "/v1/completions", {
        "model": llama.model, "prompt": ["Hello", "Hi"], "max_tokens": 5, "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
        "return_token_ids": True, "ignore_eos": True, "stop": "zz",
    })
    assert status == 200
    if not stream:
        assert len(body["choices"]) == 2


def test_models_tokens_and_operations_match_the_document(check, document, llama):
    assert check("get", "/v1/models")[0] == 200
    assert check("get", f"/v1/models/{llama.model}", doc_path="/v1/models/{id}")[0] == 200
    status, tokens = check("post", "/tokenize", {"model": llama.model, "messages": HELLO,
                                                 "return_token_strs": True})
    assert status == 200 and tokens["token_strs"]
    assert check("post", "/v1/tokenize", {"prompt": "Hello"})[0] == 200
    assert check("post", "/detokenize", {"tokens": tokens["tokens"]})[0] == 200
    assert check("post", "/v1/detokenize", {"tokens": [5]})[0] == 200
    assert check("get", "/health")[0] == 200
    assert check("get", "/info")[0] == 200
    assert check("get", "/metrics")[0] == 200
    # The document's own schema is an open object; its content is checked by openapi-spec-validator.
    assert "get" in document.raw["paths"]["/openapi.json"]


def test_error_responses_match_the_document(check, llama):
    bad_type = {"model": llama.model, "messages": HELLO, "temperature": "hot"}
    assert check("post", "/v1/chat/completions", bad_type)[0] == 400
    assert check("post", "/v1/completions", {"model": "no-such-model", "prompt": "x"})[0] == 404
    assert check("post", "/v1/completions", {"model": llama.model})[0] == 400
    assert check("get", "/v1/models/no-such-model", doc_path="/v1/models/{id}")[0] == 404
    assert check("post", "/detokenize", {"tokens": [-1]})[0] == 400
    assert check("post", "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})[0] == 404


def test_the_check_catches_an_undocumented_a_missing_and_a_mistyped_field(check, document, llama):
    _, body = check("post", "/v1/chat/completions",
                    {"model": llama.model, "messages": HELLO, "max_tokens": 2})
    broken = [
        {**body, "undocumented": 1},
        {**body, "choices": [{**body["choices"][0], "undocumented": 1}]},
        {key: value for key, value in body.items() if key != "usage"},
        {**body, "usage": {**body["usage"], "total_tokens": "3"}},
        {**body, "choices": [{**body["choices"][0], "finish_reason": "tired"}]},
    ]
    for instance in broken:
        with pytest.raises(AssertionError, match="does not match the document"):
            document.validate(instance, "/v1/chat/completions", "post", 200)
