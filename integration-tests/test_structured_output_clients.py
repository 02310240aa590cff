"""Structured output and tools as real clients use them, against the launched stack on
random-weight models: the official SDK's `client.chat.completions.parse(...)` with a pydantic
model (as `response_format`, and as a strict function tool), and langchain-openai's
`with_structured_output` (method "json_schema" and "function_calling") and `bind_tools` with a
forced tool_choice. Each returns instances that pydantic itself validated.

The pydantic models bound every field (max_length, Literal, integer ranges, list lengths): a
random model only finishes text the schema bounds. For the same reason langchain's tool paths pass
`strict=True`: without it langchain sends objects open to additional properties, through which a
random model wanders until max_tokens (JSON Schema's default, which llguidance follows; strict
mode is how OpenAI clients ask for closed objects). `bind_tools` turns parallel calls off: with
them, `required` allows any number of calls, and a random model may go on calling until
max_tokens."""

from __future__ import annotations

from typing import Any, Literal, NoReturn

import openai
import pytest
import tiktoken
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field, SecretStr

from structured_checks import LORA, MAX_TOKENS, MODELS, OWN_TOKENIZER, client, start_structured_stack, validate

QUESTION = "Plan a short trip."


class City(BaseModel):
    name: str = Field(max_length=12)
    country: Literal["fr", "de", "jp"]
    population: int = Field(ge=0, le=10_000_000)
    coastal: bool


class Trip(BaseModel):
    """A trip through one or two cities."""

    cities: list[City] = Field(min_length=1, max_length=2)
    days: int = Field(ge=1, le=30)


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=10)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = start_structured_stack(tmp_path_factory, "structured-clients")
    yield stack
    stack.stop()


@pytest.fixture(autouse=True)
def no_tiktoken(monkeypatch: pytest.MonkeyPatch) -> None:
    """tiktoken fetches encodings from the network on first use; none is reachable here, and no
    chat call may need one."""

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise AssertionError(f"ChatOpenAI asked tiktoken for an encoding: {args} {kwargs}")

    monkeypatch.setattr(tiktoken, "get_encoding", refuse)
    monkeypatch.setattr(tiktoken, "encoding_for_model", refuse)


def langchain_chat(stack, model: str) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=stack.base_url + "/v1",
        api_key=SecretStr("unused"),
        model=model,
        temperature=0,
        max_tokens=MAX_TOKENS,  # type: ignore[call-arg]
        max_retries=0,
    )


@pytest.mark.parametrize("model", MODELS)
def test_sdk_parse_response_format(stack, model):
    with client(stack) as sdk:
        completion = sdk.chat.completions.parse(
            model=model, messages=[{"role": "user", "content": QUESTION}], response_format=Trip,
            max_tokens=MAX_TOKENS, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Trip), choice.message
    # The SDK validated with pydantic; jsonschema checks the same text against pydantic's schema.
    validate(Trip.model_json_schema(), choice.message.content or "")


def test_sdk_parse_stream(stack):
    with client(stack) as sdk, sdk.chat.completions.stream(
            model=LORA, messages=[{"role": "user", "content": QUESTION}], response_format=Trip,
            max_tokens=MAX_TOKENS, temperature=0) as stream:
        for _ in stream:
            pass
        completion = stream.get_final_completion()
    assert isinstance(completion.choices[0].message.parsed, Trip)


def test_sdk_parse_forced_function_tool(stack):
    tool = openai.pydantic_function_tool(GetWeather)
    with client(stack) as sdk:
        completion = sdk.chat.completions.parse(
            model=MODELS[0], messages=[{"role": "user", "content": "Weather?"}], tools=[tool],
            tool_choice={"type": "function", "function": {"name": "GetWeather"}}, max_tokens=MAX_TOKENS,
            temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert len(calls) >= 1
    for call in calls:
        assert call.type == "function"
        assert call.function.name == "GetWeather"
        assert isinstance(call.function.parsed_arguments, GetWeather), call


@pytest.mark.parametrize("model", [MODELS[0], LORA])
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(stack, model, method):
    structured = langchain_chat(stack, model).with_structured_output(Trip, method=method, strict=True)
    result = structured.invoke(QUESTION)
    assert isinstance(result, Trip), result


def test_langchain_with_structured_output_include_raw(stack):
    structured = langchain_chat(stack, MODELS[0]).with_structured_output(Trip, method="json_schema", include_raw=True)
    result = structured.invoke(QUESTION)
    assert isinstance(result, dict) and result["parsing_error"] is None, result
    assert isinstance(result["parsed"], Trip)


@pytest.mark.parametrize("tool_choice", ["GetWeather", "required", "any"])
def test_langchain_bind_tools_forced(stack, tool_choice):
    bound = langchain_chat(stack, OWN_TOKENIZER).bind_tools([GetWeather], tool_choice=tool_choice, strict=True,
                                                          parallel_tool_calls=False)
    message = bound.invoke("What is the weather?")
    assert isinstance(message, AIMessage)
    assert message.tool_calls, message
    assert not message.invalid_tool_calls, message.invalid_tool_calls
    for call in message.tool_calls:
        assert call["name"] == "GetWeather"
        GetWeather.model_validate(call["args"])
        assert call["id"]
    assert message.response_metadata["finish_reason"] == "tool_calls"

