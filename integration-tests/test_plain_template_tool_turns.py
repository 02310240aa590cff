"""Tool turns on a model whose chat template is plain ChatML: SmolLM2's, the demo model's, which
concatenates `message['content']` and never tests it. An assistant turn with `content: null` (a
chat history as the OpenAI SDKs send it; a Responses tool round trip of `function_call` and
`function_call_output` items) is served with 200, and the prompt the server tokenized is what
transformers' `apply_chat_template` makes of the same messages with `content: ""` (transformers
itself fails on the null, as the server did). Through the official SDK, a `function_call_output`
whose call is not in the input is OpenAI's 400."""

from __future__ import annotations

import copy
import json
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from model_builders import CHAT_TEMPLATES_DIR, build_model_dir
from stack import Stack, StackConfig

SMOLLM2_TEMPLATE = json.loads((CHAT_TEMPLATES_DIR / "smollm2-instruct.json").read_text())["chat_template"]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "9 °C, rain"},
]
# The same conversation as Responses input items.
ITEMS: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "9 °C, rain"},
]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain-template")
    model_dir = build_model_dir("llama", root / "model", chat_template=SMOLLM2_TEMPLATE)
    stack = Stack(StackConfig(model_id=str(model_dir), served_model_name="plain"), root / "stack.log")
    stack.start()
    try:
        with openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
            yield stack, sdk, AutoTokenizer.from_pretrained(model_dir)
    finally:
        stack.stop()


def _reference_ids(tokenizer: Any) -> list[int]:
    """transformers' prompt for `HISTORY` with the null content given as ""."""
    given = copy.deepcopy(HISTORY)
    given[1]["content"] = ""
    ids = tokenizer.apply_chat_template(given, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert "<|im_start|>tool\n9 °C, rain<|im_end|>" in tokenizer.decode(ids)
    return list(ids)


def test_chat_history_with_null_content_renders_as_empty_content(plain) -> None:
    stack, _, tokenizer = plain
    status, response = stack.post_json("/v1/chat/completions", {
        "model": "plain", "messages": HISTORY, "max_tokens": 2, "return_token_ids": True}, timeout=120)
    assert status == 200, f"{response}\n--- log ---\n{stack.log()[-3000:]}"
    assert response["prompt_token_ids"] == _reference_ids(tokenizer)


def test_responses_tool_round_trip_renders_as_the_chat_history(plain) -> None:
    _, sdk, tokenizer = plain
    response = sdk.responses.create(model="plain", input=ITEMS, max_output_tokens=2)
    assert response.status in ("completed", "incomplete"), response
    assert response.usage is not None and response.usage.input_tokens == len(_reference_ids(tokenizer))


def test_an_output_without_its_call_is_openais_400(plain) -> None:
    _, sdk, _ = plain
    orphan = [ITEMS[0], {"type": "function_call_output", "call_id": "call_missing", "output": "9 °C"}]
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model="plain", input=orphan, max_output_tokens=2)
    error = refused.value
    assert error.status_code == 400 and error.type == "invalid_request_error", error.body
    assert error.param == "input[1]", error.body
    assert "No tool call found for function call output with call_id call_missing" in error.message, error.body
