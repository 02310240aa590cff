"""Responses, stream chunks, the model list and error bodies validate against OpenAI's published
schemas (testdata/openai-openapi/openapi.yaml), on the raw bytes the server sent."""

from __future__ import annotations

import json

import openai
import pytest

import openai_schema
from openai_schema import COMPLETION_CHUNK
from served import raw_json

HELLO = [{"role": "user", "content": "Hello"}]


def _sse_events(response) -> list[str]:
    """`data:` payloads of an SSE response, in order, [DONE] included."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            events.append(line[len("data:"):].strip())
    return events


def _validate_stream(response, schema: str) -> list[dict]:
    assert response.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(response)
    assert events and events[-1] == "[DONE]", f"a stream ends with data: [DONE]: {events[-3:]}"
    assert events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        openai_schema.validate(chunk, schema)
    return chunks


def test_chat_completion_matches_schema(client, llama):
    raw = client.chat.completions.with_raw_response.create(model=llama.model, messages=HELLO, max_tokens=8)
    body = raw_json(raw)
    openai_schema.validate(body, "CreateChatCompletionResponse")
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == llama.model


def test_completion_matches_schema(client, llama):
    raw = client.completions.with_raw_response.create(model=llama.model, prompt="Hello", max_tokens=8)
    body = raw_json(raw)
    openai_schema.validate(body, "CreateCompletionResponse")
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"


@pytest.mark.parametrize("usage", [False, True], ids=["plain", "include_usage"])
def test_chat_stream_chunks_match_schema(client, llama, usage):
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    with client.chat.completions.with_streaming_response.create(
        model=llama.model, messages=HELLO, max_tokens=8, stream=True, **extra
    ) as response:
        chunks = _validate_stream(response, "CreateChatCompletionStreamResponse")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["id"].startswith("chatcmpl-")
    if usage:
        # OpenAI sends usage: null on every chunk but the last when include_usage is set.
        assert chunks[-1]["usage"] and chunks[-1]["choices"] == []


@pytest.mark.parametrize("usage", [False, True], ids=["plain", "include_usage"])
def test_completion_stream_chunks_match_schema(client, llama, usage):
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    with client.completions.with_streaming_response.create(
        model=llama.model, prompt="Hello", max_tokens=8, stream=True, **extra
    ) as response:
        chunks = _validate_stream(response, COMPLETION_CHUNK)
    assert all(c["object"] == "text_completion" for c in chunks)


def test_model_list_and_model_match_schema(client, llama):
    listing = raw_json(client.models.with_raw_response.list())
    openai_schema.validate(listing, "ListModelsResponse")
    assert llama.model in [m["id"] for m in listing["data"]]

    model = raw_json(client.models.with_raw_response.retrieve(llama.model))
    openai_schema.validate(model, "Model")
    assert model["id"] == llama.model


def test_unknown_model_lookup_is_404_in_openai_shape(client, llama):
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    openai_schema.validate(caught.value.response.json(), "ErrorResponse")


def test_health_and_info(llama):
    assert llama.stack.get("/health")[0] == 200
    status, body = llama.stack.get("/info")
    assert status == 200
    assert isinstance(json.loads(body), dict)
