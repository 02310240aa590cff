"""Structured output and tool calls after the thinking block, through the whole stack, on the
thinking parrots (thinking_models): the constraint must let the reply think first (Qwen3's
template leaves that to the reply; DeepSeek-R1's opens the block in the prompt, so the
constraint starts inside it), then hold. The schemas and tools force one output, so the
constrained part is known: the JSON parses to the schema's only value, the call is the forced
call, and the reasoning is the parrot's known thinking, separate from both (and never parsed as
a call, although it is free text before the call's marker).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessageParam

from thinking_models import ANSWER, QWEN3_REPLY, R1_REPLY, reasoning_of, split_at_markers

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Should I?"}]
MAX_TOKENS = 60
# One value satisfies it: `{"answer":"yes"}` (compact, as the engine writes JSON).
SCHEMA = {"type": "object", "properties": {"answer": {"const": "yes"}}, "required": ["answer"],
          "additionalProperties": False}
ARGUMENTS = {"unit": "celsius"}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather.",
    "parameters": {"type": "object", "properties": {"unit": {"const": "celsius"}}, "required": ["unit"],
                   "additionalProperties": False}}}


def _parrots(request) -> tuple[Any, str]:
    """(served parrot, its reply) of the parametrized template."""
    if request.param == "qwen3":
        return request.getfixturevalue("qwen3_parrot"), QWEN3_REPLY
    return request.getfixturevalue("r1_parrot"), R1_REPLY


@pytest.fixture(params=["qwen3", "r1"])
def parrot(request):
    return _parrots(request)


def _reasoning(reply: str) -> str | None:
    return split_at_markers(reply, prompt_opened=not reply.startswith("<think>"))[0]


def test_json_schema_holds_after_the_thinking(parrot):
    served, reply = parrot
    response_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    with served.client() as client:
        response = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                  response_format=response_format)
        chunks = list(client.chat.completions.create(model=served.model, messages=MESSAGES,
                                                     max_tokens=MAX_TOKENS, response_format=response_format,
                                                     stream=True))
    message = response.choices[0].message
    assert reasoning_of(message) == _reasoning(reply)
    assert json.loads(message.content) == {"answer": "yes"}
    assert response.choices[0].finish_reason == "stop"
    deltas = [choice.delta for chunk in chunks for choice in chunk.choices]
    assert "".join(reasoning_of(delta) or "" for delta in deltas) == _reasoning(reply)
    assert "".join(delta.content or "" for delta in deltas) == message.content


@pytest.mark.parametrize("choice", [
    "required",
    {"type": "function", "function": {"name": "get_weather"}},
], ids=["required", "named"])
def test_forced_call_after_the_thinking(parrot, choice):
    served, reply = parrot
    kwargs: dict[str, Any] = dict(model=served.model, messages=MESSAGES, max_tokens=MAX_TOKENS, tools=[TOOL],
                                  tool_choice=choice, parallel_tool_calls=False)
    with served.client() as client:
        response = client.chat.completions.create(**kwargs)
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls"
    assert reasoning_of(message) == _reasoning(reply)
    assert message.content is None
    assert [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls] == [
        ("get_weather", ARGUMENTS)]
    # Streamed: the reasoning deltas, then one call, OpenAI's delta shape.
    deltas = [choice.delta for chunk in chunks for choice in chunk.choices]
    assert "".join(reasoning_of(delta) or "" for delta in deltas) == _reasoning(reply)
    calls = [call for delta in deltas for call in delta.tool_calls or []]
    assert calls[0].id and calls[0].function.name == "get_weather"
    assert json.loads("".join(call.function.arguments or "" for call in calls)) == ARGUMENTS
    assert not any(delta.content for delta in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tools_let_a_thinking_reply_answer_in_text(qwen3_parrot):
    """`auto` allows text: the parrot thinks, then answers without a call."""
    with qwen3_parrot.client() as client:
        response = client.chat.completions.create(model=qwen3_parrot.model, messages=MESSAGES,
                                                  max_tokens=MAX_TOKENS, tools=[TOOL], tool_choice="auto")
    reasoning, content = split_at_markers(QWEN3_REPLY, prompt_opened=False)
    assert reasoning_of(response.choices[0].message) == reasoning
    assert response.choices[0].message.content == content
    assert not response.choices[0].message.tool_calls
    assert response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra", [
    {"guided_regex": "(Yes|No), sure!"},
    {"structured_outputs": {"choice": [ANSWER, "No"]}},
], ids=["regex", "choice"])
def test_regex_and_choice_hold_after_the_thinking(parrot, extra):
    """The parrot's own answer satisfies both: a regex lexeme and a nested Lark grammar after
    the thinking block let it through, after its thinking."""
    served, reply = parrot
    with served.client() as client:
        response = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                  extra_body=extra)
    reasoning, content = split_at_markers(reply, prompt_opened=not reply.startswith("<think>"))
    assert reasoning_of(response.choices[0].message) == reasoning
    assert response.choices[0].message.content == content
    assert response.choices[0].finish_reason == "stop"
