"""`POST /v1/responses` through the official openai SDK, on the structured-output stack's tiny
models. A Responses request is the chat request it amounts to: its text, usage and finish are
the chat endpoint's for the same conversation (which the chat tests hold to transformers); items
in, items out. Every response and every streamed event validates against OpenAI's published
schema (`Response`, `ResponseStreamEvent`), events come in the documented order with their
sequence numbers, the SDK's own stream accumulator rebuilds the non-streamed response, a
function tool round trip (call, output fed back) renders as the chat conversation with its
`tool_calls` and `tool` message does, and what quiver does not do is refused by name."""

from __future__ import annotations

import json
from typing import Any, cast

import httpx
import openai
import pytest

import openai_schema
from structured_checks import SERVED_NAME, client, load_schema, post, start_structured_stack, validate

HERMES = "hermes-template"  # an adapter whose own template reads `tools` (Hermes 2 Pro's)
TOOLS: list[dict[str, Any]] = [{"type": "function", "name": "get_weather", "description": "Current weather in a city.",
          "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                         "properties": {"city": {"type": "string", "maxLength": 10}}}}]
PERSON: dict[str, Any] = {"type": "json_schema", "name": "person", "schema": load_schema("person"), "strict": True}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = start_structured_stack(tmp_path_factory, "responses")
    yield stack
    stack.stop()


def _sdk(stack) -> Any:
    """The official SDK's client, untyped: these tests send items and tools as plain dicts."""
    return cast(Any, client(stack))


def _created(stack, **request: Any) -> dict[str, Any]:
    """A non-streamed response as sent, validated against OpenAI's schema."""
    response = post(stack, "/v1/responses", request)
    openai_schema.validate(response, "Response", closed=True)
    return response


def _events(stack, **request: Any) -> list[dict[str, Any]]:
    """A streamed response's events as sent: each `data` validated against OpenAI's schema, its
    SSE `event` name its `type`."""
    events = []
    with httpx.stream("POST", stack.base_url + "/v1/responses", json={**request, "stream": True},
                      timeout=300) as response:
        assert response.status_code == 200, response.read()
        fields: dict[str, str] = {}
        for line in response.iter_lines():
            if line:
                key, _, value = line.partition(": ")
                fields[key] = value
                continue
            if "data" in fields:  # a blank line ends an event (keep-alive comments have no data)
                event = json.loads(fields["data"])
                openai_schema.validate(event, "ResponseStreamEvent", closed=True)
                assert fields.get("event") == event["type"], (fields, event)
                events.append(event)
            fields = {}
    return events


def test_text_input_answers_as_chat_does(stack) -> None:
    response = _created(stack, model=SERVED_NAME, input="Tell me about the sea.", instructions="Be brief.",
                        max_output_tokens=12, temperature=0)
    with _sdk(stack) as sdk:
        chat = sdk.chat.completions.create(
            model=SERVED_NAME, max_tokens=12, temperature=0,
            messages=[{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Tell me about the sea."}])
    (message,) = response["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["text"] == chat.choices[0].message.content
    assert response["usage"]["input_tokens"] == chat.usage.prompt_tokens
    assert response["usage"]["output_tokens"] == chat.usage.completion_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert response["status"] == ("incomplete" if cut else "completed")
    assert response["incomplete_details"] == ({"reason": "max_output_tokens"} if cut else None)
    assert (response["instructions"], response["max_output_tokens"]) == ("Be brief.", 12)


@pytest.mark.parametrize("model", [SERVED_NAME, "lora"])
def test_input_items_are_the_conversation_chat_gets(stack, model: str) -> None:
    items = [
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Answer in French."}]},
        {"role": "user", "content": "Hello."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bonjour."}]},
        {"role": "user",
         "content": [{"type": "input_text", "text": "How"}, {"type": "input_text", "text": "are you?"}]},
    ]
    with _sdk(stack) as sdk:
        response = sdk.responses.create(model=model, input=items, max_output_tokens=10, temperature=0)
        chat = sdk.chat.completions.create(model=model, max_tokens=10, temperature=0, messages=[
            {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": "Bonjour."}, {"role": "user", "content": "How\nare you?"}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_a_json_schema_format_streams_in_order_and_validates(stack) -> None:
    request = {"model": SERVED_NAME, "input": "A person, please.", "text": {"format": PERSON},
               "max_output_tokens": 300, "temperature": 0}
    plain = _created(stack, **request)
    assert plain["status"] == "completed", plain
    text = plain["output"][0]["content"][0]["text"]
    validate(load_schema("person"), text)

    events = _events(stack, **request)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    kinds = [event["type"] for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == text
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text
    # The same tokens (the prompt's cached part differs: the plain request cached it).
    for count in ("input_tokens", "output_tokens", "total_tokens"):
        assert final["usage"][count] == plain["usage"][count]

    # The SDK's own accumulator rebuilds the same response from the events.
    with _sdk(stack) as sdk, sdk.responses.stream(
            model=SERVED_NAME, input="A person, please.", max_output_tokens=300, temperature=0,
            text={"format": PERSON}) as stream:
        accumulated = stream.get_final_response()
    assert accumulated.output_text == text


def test_a_function_tool_round_trip(stack) -> None:
    """A required call, then its output fed back as items: the second request renders as the chat
    conversation with the assistant's `tool_calls` and a `tool` message does."""
    with _sdk(stack) as sdk:
        first = sdk.responses.create(model=HERMES, input="Weather in Oslo?", tools=TOOLS,
                                     tool_choice="required", parallel_tool_calls=False, max_output_tokens=200,
                                     temperature=0)
        (call,) = first.output
        assert call.type == "function_call" and call.name == "get_weather", first.output
        validate(TOOLS[0]["parameters"], call.arguments)
        assert first.status == "completed"
        fed_back = [{"role": "user", "content": "Weather in Oslo?"}, call.model_dump(exclude_none=True),
                    {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}]
        second = _created(stack, model=HERMES, input=fed_back, tools=TOOLS, max_output_tokens=8, temperature=0)
        chat = sdk.chat.completions.create(
            model=HERMES, max_tokens=8, temperature=0,
            tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}],
            messages=[{"role": "user", "content": "Weather in Oslo?"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": call.call_id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}]},
                      {"role": "tool", "tool_call_id": call.call_id, "name": call.name,
                       "content": "Sunny, 21 C."}])
    assert chat.usage is not None
    assert second["usage"]["input_tokens"] == chat.usage.prompt_tokens
    texts = [item["content"][0]["text"] for item in second["output"] if item["type"] == "message"]
    calls = [(item["name"], item["arguments"]) for item in second["output"] if item["type"] == "function_call"]
    assert texts == ([chat.choices[0].message.content] if chat.choices[0].message.content else [])
    assert calls == [(c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls or []]


def test_a_streamed_call_spells_the_plain_one(stack) -> None:
    request = {"model": HERMES, "input": "Weather in Oslo?", "tools": TOOLS, "tool_choice": "required",
               "parallel_tool_calls": False, "max_output_tokens": 200, "temperature": 0}
    plain = _created(stack, **request)
    events = _events(stack, **request)
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    (call,) = plain["output"]
    assert arguments == done["arguments"] == call["arguments"] and done["name"] == call["name"]
    assert events[-1]["type"] == "response.completed"


@pytest.mark.parametrize(("field", "value", "code"), [
    ("store", True, "unsupported_value"),
    ("previous_response_id", "resp_abc", "unsupported_parameter"),
    ("background", True, "unsupported_value"),
    ("include", ["reasoning.encrypted_content"], "unsupported_value"),
    ("tools", [{"type": "web_search"}], "unsupported_value"),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}],
     "unsupported_value"),
])
def test_what_is_not_done_is_refused_by_name(stack, field: str, value: Any, code: str) -> None:
    body = {"model": SERVED_NAME, "input": "Hi", "max_output_tokens": 2, field: value}
    status, response = stack.post_json("/v1/responses", body)
    assert status == 400, response
    openai_schema.validate(response, "ErrorResponse")
    assert response["error"]["code"] == code and response["error"]["param"].startswith(field), response


@pytest.mark.parametrize(("field", "value"), [("max_output_tokens", 10**6), ("input", "word " * 5000)])
def test_errors_name_the_responses_field(stack, field: str, value: Any) -> None:
    """Refused on the chat path (`max_tokens`, `messages`), named as the request names them."""
    status, response = stack.post_json("/v1/responses", {"model": SERVED_NAME, "input": "Hi", field: value})
    assert status == 400, response
    assert response["error"]["param"] == field, response


def test_store_false_is_what_it_does_and_an_unknown_field_is_named(stack) -> None:
    with _sdk(stack) as sdk:
        raw = sdk.responses.with_raw_response.create(model=SERVED_NAME, input="Hi", max_output_tokens=2,
                                                     store=False, extra_body={"made_up": 1})
    assert raw.headers["quiver-ignored-fields"] == "made_up"
    # OpenAI's published Response has no `store`: the request's is not echoed.
    assert raw.http_response.json()["status"] == "incomplete"


def test_an_sdk_error_is_openai_shaped(stack) -> None:
    with _sdk(stack) as sdk, pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(model=SERVED_NAME, input="Hi", previous_response_id="resp_1")
    assert caught.value.param == "previous_response_id"
