"""The tiny model (the demo before it was real, whose ChatML template renders tools) serves a chat
whose history holds OpenAI tool turns (an assistant call with
`content: null`, then `tool` results) with tools declared: 200, and the prompt the server
tokenized is exactly what transformers' `apply_chat_template` makes from the model's own
tokenizer files for the same messages and tools. A malformed tool call is an OpenAI-shaped 400."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from quiver_server.tiny_model import write_tiny_model
from stack import Stack, StackConfig

TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather in Oslo and Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
    ]},
    {"role": "tool", "tool_call_id": "c1", "content": "9 °C, rain"},
    {"role": "tool", "tool_call_id": "c2", "content": "21 °C"},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-turns")
    model_dir = Path(write_tiny_model(root / "model"))
    stack = Stack(StackConfig(model_id=str(model_dir)), root / "tiny.log")
    stack.start()
    try:
        yield stack, model_dir
    finally:
        stack.stop()


def _model_name(stack: Stack) -> str:
    status, body = stack.get("/v1/models")
    assert status == 200, body
    return json.loads(body)["data"][0]["id"]


def test_tool_call_history_renders_like_transformers(tiny):
    stack, model_dir = tiny
    body = {"model": _model_name(stack), "messages": HISTORY, "tools": TOOLS, "max_tokens": 4,
            "return_token_ids": True}
    status, response = stack.post_json("/v1/chat/completions", body, timeout=120)
    assert status == 200, f"{response}\n--- log ---\n{stack.log()[-3000:]}"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rendered = tokenizer.apply_chat_template(
        HISTORY, tools=[*TOOLS], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert isinstance(rendered, list), type(rendered)
    want = [token for token in rendered if isinstance(token, int)]
    assert len(want) == len(rendered), rendered
    assert "<tool_response>" in tokenizer.decode(want)  # the reference rendered the tool turns
    assert response["prompt_token_ids"] == want
    assert response["usage"]["prompt_tokens"] == len(want)


def test_malformed_tool_call_is_an_openai_400(tiny):
    stack, _ = tiny
    broken = [HISTORY[1], {"role": "assistant", "content": None,
                           "tool_calls": [{"id": "c1", "type": "function", "function": {"arguments": "{}"}}]}]
    status, response = stack.post_json("/v1/chat/completions",
                                       {"model": _model_name(stack), "messages": broken, "max_tokens": 1})
    assert status == 400, response
    assert response["error"]["param"] == "messages[1].tool_calls[0].function.name", response
    assert response["error"]["type"] == "invalid_request_error", response
