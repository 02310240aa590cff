"""The OpenAI Agents SDK (`openai-agents`) running an agent with one function tool against quiver,
through its Responses model class (`OpenAIResponsesModel`, the SDK's default) and through its
Chat Completions one: the SDK sends its own requests, reads quiver's responses with its own
parser, calls the tool with the arguments the model wrote, and ends with the tool's result.
The model is a random one behind Hermes 2 Pro's tool-use template, so the call is made by the
grammar that `tool_choice: "required"` sets; the tool's argument is an enum (a free string from a
random model could run to the token limit), which the SDK's own argument check holds it to.
Tracing is off: the SDK would otherwise export traces to OpenAI."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from structured_checks import start_structured_stack

HERMES = "hermes-template"  # an adapter whose own template reads `tools` (Hermes 2 Pro's)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    set_tracing_disabled(True)
    stack = start_structured_stack(tmp_path_factory, "agents")
    yield stack
    stack.stop()


def _run(stack, model_class: Any) -> tuple[Any, list[str]]:
    """Runs a one-tool agent; its result and the cities the tool was called with."""
    cities: list[str] = []

    @function_tool
    def get_weather(city: Literal["Oslo", "Paris", "Lima"]) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"Sunny in {city}."

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
        agent = Agent(
            name="weather", instructions="Use the tool.", tools=[get_weather],
            model=model_class(model=HERMES, openai_client=client),
            model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=120,
                                         parallel_tool_calls=False),
            tool_use_behavior="stop_on_first_tool",
        )
        try:
            return await Runner.run(agent, "What is the weather in Oslo?", max_turns=2)
        finally:
            await client.close()

    return asyncio.run(run()), cities


@pytest.mark.parametrize("model_class", [OpenAIResponsesModel, OpenAIChatCompletionsModel],
                         ids=["responses", "chat-completions"])
def test_an_agent_calls_its_tool_and_ends_with_its_result(stack, model_class: Any) -> None:
    result, cities = _run(stack, model_class)
    assert len(cities) == 1, cities
    assert result.final_output == f"Sunny in {cities[0]}."
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    assert len(calls) == 1, result.new_items
